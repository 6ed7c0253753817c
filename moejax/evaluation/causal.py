"""Causal expert importance: what removing one expert does to each skill, measured rather than
inferred from routing statistics.

For every routed expert e of every MoE layer l, the model with e alone removed (its router slot
masked: each token that chose e takes the next-best kept expert, exactly as `moejax prune` writes
the pruned checkpoint; the variant masks of `moejax.models.variant`) scores the held-out documents
of each task t, a list of (context, continuation) byte strings:

    nll[t]          = mean_d  -sum_{j in continuation_d} log p(x_j | x_<j)          (nats per document)
    exact_match[t]  = mean_d  [every continuation byte is the argmax given the bytes before it]
    nll_increase[l, e, t]     = nll_removed[t] - nll_full[t]
    exact_match_drop[l, e, t] = exact_match_full[t] - exact_match_removed[t]

For a skills document the context is the prompt and the continuation the answer and terminator:
its exact match is greedy decoding producing exactly the answer and stopping (the skills_NAME_ll
task's acc; `moejax.evaluation.skills_tasks`). Teacher forcing makes it one forward per document.

The observational side (every score of `moejax.scoring`, measured on the same documents or on
calibration text) and its agreement with the causal side are `moejax.evaluation.causal_stats`.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class DocBatch:
    """Documents right-padded into rows: ids [N, S] (pad 0), the next-token targets [N, S], and
    continuation_NS marking the predictions that score (the continuation's bytes); task_N names
    each row's task."""

    ids_NS: np.ndarray
    targets_NS: np.ndarray
    continuation_NS: np.ndarray
    task_N: np.ndarray

    @classmethod
    def of(cls, docs: dict, multiple: int = 16) -> "DocBatch":
        """docs: {task: [(context, continuation)]} (str or bytes; byte-level ids), padded to a
        multiple of `multiple` positions (one compiled shape)."""
        rows = [(task, _bytes(c), _bytes(x)) for task, pairs in docs.items() for c, x in pairs]
        if not rows or any(not c or not x for _, c, x in rows):
            raise ValueError("DocBatch: every document needs a non-empty context and continuation")
        S = -(-max(len(c) + len(x) for _, c, x in rows) // multiple) * multiple
        ids = np.zeros((len(rows), S), np.int32)
        targets = np.zeros((len(rows), S), np.int32)
        cont = np.zeros((len(rows), S), bool)
        for i, (_, c, x) in enumerate(rows):
            whole = list(c + x)
            ids[i, :len(whole) - 1] = whole[:-1]
            targets[i, :len(whole) - 1] = whole[1:]
            cont[i, len(c) - 1:len(whole) - 1] = True
        return cls(ids, targets, cont, np.array([t for t, _, _ in rows]))


def _bytes(s) -> bytes:
    return s if isinstance(s, bytes) else s.encode("utf-8")


def _chunks(n_rows: int, batch_size: int):
    """(start, rows taken, row indices [batch_size]) of each fixed-size chunk of n_rows rows, the
    last filled with copies of its first row (dropped by the caller): one compiled shape."""
    for i in range(0, n_rows, batch_size):
        n = min(batch_size, n_rows - i)
        yield i, n, np.r_[np.arange(i, i + n), np.full(batch_size - n, i)]


def token_scores(scorer, batch: DocBatch, variant, batch_size: int = 64) -> tuple[np.ndarray, np.ndarray]:
    """(-log p(target) [N, S] float64, target == argmax [N, S]) at every position under `variant`;
    `scorer` is `moejax.inference.nll.compiled_scorer(model)`. Rows go in fixed chunks of batch_size
    (`_chunks`)."""
    nll, hit = np.zeros(batch.ids_NS.shape), np.zeros(batch.ids_NS.shape, bool)
    for i, n, pick in _chunks(len(batch.ids_NS), batch_size):
        logp, greedy = scorer(batch.ids_NS[pick], batch.targets_NS[pick], variant)
        nll[i:i + n], hit[i:i + n] = -np.asarray(logp, np.float64)[:n], np.asarray(greedy)[:n]
    return nll, hit


def doc_scores(scorer, batch: DocBatch, variant, batch_size: int = 64) -> tuple[np.ndarray, np.ndarray]:
    """(NLL of each document's continuation [N] (float64 sums of float32 log-probabilities), whether
    each continuation is the greedy one [N]) under `variant` (`token_scores`)."""
    nll, hit = token_scores(scorer, batch, variant, batch_size)
    cont = batch.continuation_NS
    return np.where(cont, nll, 0.0).sum(1), np.where(cont, hit, True).all(1)


def task_means(batch: DocBatch, nll: np.ndarray, greedy: np.ndarray) -> dict:
    """{task: (mean NLL, exact match)}."""
    return {t: (float(nll[batch.task_N == t].mean()), float(greedy[batch.task_N == t].mean()))
            for t in dict.fromkeys(batch.task_N.tolist())}


def single_removals(config):
    """(layer, expert, masks bool [num_hidden_layers, E]) for every routed expert of every MoE
    layer, each mask keeping every expert but that one."""
    E = config.n_experts
    for layer in config.moe_layers:
        for expert in range(config.experts_in_layer(layer)):
            masks = np.zeros((config.num_hidden_layers, E), bool)
            for l in config.moe_layers:
                masks[l, :config.experts_in_layer(l)] = True
            masks[layer, expert] = False
            yield layer, expert, masks


def zeroed(config, layer: int, expert: int) -> dict:
    """The variant in which `expert` of `layer` outputs zero and nothing else changes: the router
    still chooses it and the other chosen experts keep their gates (no re-routing). This is the
    intervention of the causal audit arXiv 2606.10703 (a hook zeroing the expert's output), as an
    expert map: the slot a novice whose constant is zero."""
    import jax.numpy as jnp

    from moejax.moe.expert_map import ExpertMap

    E = config.experts_in_layer(layer)
    novice = np.zeros(E, bool)
    novice[expert] = True
    return {layer: ExpertMap(jnp.ones(E, bool), novice_E=jnp.asarray(novice),
                             constants_EH=jnp.zeros((E, config.hidden_size), jnp.float32))}


def zeroing_deltas(model, batch: DocBatch, batch_size: int = 64) -> dict:
    """{(layer, expert): the per-token loss change [N, S] when that expert alone is zeroed (`zeroed`)},
    every MoE layer's every routed expert, against the unpruned model's per-token loss."""
    from moejax.inference.nll import compiled_scorer

    scorer = compiled_scorer(model)
    full, _ = token_scores(scorer, batch, None, batch_size)
    cfg = model.config
    return {(l, e): token_scores(scorer, batch, zeroed(cfg, l, e), batch_size)[0] - full
            for l in cfg.moe_layers for e in range(cfg.experts_in_layer(l))}


def chosen_experts(model, batch: DocBatch, batch_size: int = 64) -> dict:
    """{MoE layer: the unpruned model's chosen experts [N, S, K]} at every position."""
    import jax
    from flax import nnx

    graphdef, state = nnx.split(model)

    @jax.jit
    def route(state, ids_BS):
        _, routing, _ = nnx.merge(graphdef, state)(ids_BS, return_routing=True)
        return {l: r.expert_idx_TK.reshape(*ids_BS.shape, -1) for l, r in routing.items()}

    out: dict = {}
    for _, n, pick in _chunks(len(batch.ids_NS), batch_size):
        for l, idx in route(state, batch.ids_NS[pick]).items():
            out.setdefault(l, []).append(np.asarray(idx)[:n])
    return {l: np.concatenate(parts) for l, parts in out.items()}


def causal_importance(model, docs: dict, batch_size: int = 64, progress=None):
    """The tidy table of every single-expert removal (module docstring): columns layer, expert, task,
    metric (nll, exact_match, nll_increase, exact_match_drop), value; the unpruned model's nll and
    exact_match as layer = expert = -1."""
    import pandas as pd

    from moejax.inference.nll import compiled_scorer
    from moejax.models.variant import check_variant

    scorer = compiled_scorer(model)
    batch = DocBatch.of(docs)
    full = task_means(batch, *doc_scores(scorer, batch, None, batch_size))
    rows = [dict(layer=-1, expert=-1, task=t, metric=m, value=v)
            for t, (nll, em) in full.items() for m, v in (("nll", nll), ("exact_match", em))]
    removals = list(single_removals(model.config))
    for i, (layer, expert, masks) in enumerate(removals):
        variant = check_variant(masks, model.config)
        removed = task_means(batch, *doc_scores(scorer, batch, variant, batch_size))
        for t, (nll, em) in removed.items():
            rows += [dict(layer=layer, expert=expert, task=t, metric="nll", value=nll),
                     dict(layer=layer, expert=expert, task=t, metric="exact_match", value=em),
                     dict(layer=layer, expert=expert, task=t, metric="nll_increase", value=nll - full[t][0]),
                     dict(layer=layer, expert=expert, task=t, metric="exact_match_drop", value=full[t][1] - em)]
        if progress:
            progress(i + 1, len(removals))
    return pd.DataFrame(rows)
