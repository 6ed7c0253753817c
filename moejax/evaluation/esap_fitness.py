"""EvoESAP's fitness (`moejax.allocation.evo_esap`): the ESAP of candidate allocations against the
unpruned model, teacher forced on calibration tokens held apart from the scoring ones, many
candidates in one walk over the layers.

A candidate is kept counts per MoE layer; at layer l it keeps the count_l best experts of the
variant's ranking (`select_kept`, ties to the lower index) and routes over them, as a pruned
checkpoint does (EvoESAP masks the router logits of the others to -inf). The candidates of a call
are held-out streams of the carried pass's machinery (`carry_heldout`), so each decoder layer is
read once per generation for all of them; the unpruned model's last hidden states are computed once,
when the fitness is made. The head then gives each candidate's ESAP against them at every position
that predicts a next token (`moejax.inference.agreement`), and a candidate's fitness is its mean
over those positions:

    fitness(c) = (1 / N) sum_{sequences, t} sum_v min(p_t[v], q_t^c[v])

the token-weighted mean EvoESAP's `esp-dataset` takes (it also scores a sequence's last position,
which predicts nothing here and is left out).

Under group-limited routing (n_group > 1) a candidate is evaluated as it will be used. With
`collapse` (what `moejax prune` and `merge --collapse-groups` write): with the groups where its kept
sets keep them (`keeps_groups`, the caller's rule), else routing over all kept experts (n_group =
topk_group = 1), each kind in a walk of its own. Without it (the carried pass, which evaluates
masks under the model's own routing): with the groups, and a candidate under which some token
could not be routed to top_k kept experts (`check_routable`) scores -inf, so it is never chosen.
"""

from __future__ import annotations

import dataclasses
import time

import jax.numpy as jnp
import numpy as np
from flax import nnx

from moejax.errors import ConfigError
from moejax.evaluation.carried_heldout import TableGroup, carry_heldout
from moejax.hf.model_io import OpenCheckpoint
from moejax.inference.stream import batch_geometry, embed, head_pass
from moejax.models.registry import config_from_dict
from moejax.models.variant import check_routable
from moejax.scoring.select import select_kept
from moejax.variants import Kept
from moejax.variants.plan import stacked_expert_map

STREAM_TOKENS = 2048   # tokens of all streams one call computes (as the carried pass)


class EsapFitness:
    """fitness(kept counts [P, L], the `layers` in order) -> ESAP [P]; `evaluated` candidates and
    `seconds` spent so far (for the rate)."""

    def __init__(self, ckpt: OpenCheckpoint, ids_NS: np.ndarray, rankings: dict, layers: list, *,
                 batch_size: int = 8, dtype=jnp.float32, collapse: bool = True, keeps_groups=None):
        ckpt.config.require_passes("ESAP fitness (the evo_esap search)")
        whole = [l for l in layers if ckpt.config.is_kept_whole(l)]
        if whole:
            raise ConfigError(f"ESAP fitness: layers {whole} are kept whole (docs/families.md: {ckpt.config.TITLE}'s "
                              "hash layers), so no candidate may choose their experts; search over "
                              "`config.scored_layers`")
        self.ckpt, self.dtype = ckpt, dtype
        self.rankings, self.layers = {l: np.asarray(rankings[l], np.float64) for l in layers}, list(layers)
        ids_NS = np.asarray(ids_NS)
        self.batches = [ids_NS[i:i + batch_size] for i in range(0, len(ids_NS), batch_size)]
        self.geometry = [batch_geometry(ckpt, b, None, dtype) for b in self.batches]
        self.embedded = embed(ckpt, self.batches, dtype)
        self.tokens = max(b.size for b in self.batches)
        self.collapsed = None   # the checkpoint with its routing groups collapsed, made when first needed
        self.collapse, self.keeps_groups = collapse, keeps_groups or self._routable
        self.reference = self._walk(ckpt, None)   # the unpruned model's last hidden states, [1, B, S, H]
        self.evaluated, self.seconds = 0, 0.0

    def kept(self, counts_PL) -> list[dict]:
        """Each candidate's {layer: bool [E]} of kept experts."""
        return [{l: select_kept(self.rankings[l], int(c), f"layer {l}") for l, c in zip(self.layers, row)}
                for row in np.asarray(counts_PL)]

    def __call__(self, counts_PL) -> np.ndarray:
        t0 = time.perf_counter()
        kept = self.kept(counts_PL)
        esap = self.esap(kept)
        self.evaluated += len(kept)
        self.seconds += time.perf_counter() - t0
        return esap

    def esap(self, kept: list[dict]) -> np.ndarray:
        """The mean ESAP of each kept-set candidate ({layer: bool [E]}) against the unpruned model."""
        out = np.full(len(kept), -np.inf)
        for ckpt, which in self._by_routing(kept):
            out[which] = self._agreement(self._walk(ckpt, [kept[i] for i in which]))
        return out

    def _by_routing(self, kept: list[dict]) -> list:
        """[(checkpoint to walk, candidate indices)]: the checkpoint as it is, and (group-limited
        routing) with its groups collapsed for the candidates whose kept sets break them."""
        cfg = self.ckpt.config
        if cfg.router_settings().get("n_group", 1) <= 1:
            return [(self.ckpt, list(range(len(kept))))]
        keeps = [self.keeps_groups(k) for k in kept]
        grouped = [i for i, ok in enumerate(keeps) if ok]
        collapsed = [i for i, ok in enumerate(keeps) if not ok]
        out = [(self.ckpt, grouped)] if grouped else []
        if collapsed and self.collapse:
            if self.collapsed is None:
                settings = {**cfg.settings_dict(), "n_group": 1, "topk_group": 1}
                self.collapsed = dataclasses.replace(self.ckpt, config=config_from_dict(
                    cfg.with_settings(settings), f"{self.ckpt.path} (groups collapsed)", uniform_experts=False))
            out.append((self.collapsed, collapsed))
        return out

    def _routable(self, kept: dict) -> bool:
        """Whether every token can be routed to top_k of the candidate's kept experts under the
        model's routing groups (`check_routable`)."""
        try:
            for layer, mask in kept.items():
                check_routable(mask, layer, self.ckpt.config, "candidate")
        except ConfigError:
            return False
        return True

    def _walk(self, ckpt: OpenCheckpoint, kept: list[dict] | None) -> list:
        """The last hidden states [A, B, S, H] per batch of the candidates `kept` (None: the
        unpruned model, one stream) through every decoder layer of `ckpt`."""
        cfg = ckpt.config
        n = 1 if kept is None else len(kept)
        held = {"fitness": [x[None] for x in self.embedded]}
        carries = {"fitness": [None] * len(self.batches)}
        geo = {"fitness": self.geometry}
        chunk = max(1, STREAM_TOKENS // self.tokens)
        for layer_idx in range(cfg.num_hidden_layers):
            layer = ckpt.decoder_layer(layer_idx, self.dtype, expert_dtype=ckpt.stored_expert_dtype(self.dtype))
            graphdef, state = nnx.split(layer)
            groups = None   # a MoE layer kept whole (DeepSeek-V4's hash layers) runs as it is, by the tokens' ids
            if layer.is_moe and kept is not None and not cfg.is_kept_whole(layer_idx):
                own = layer.mlp.expert_weights()
                plans = [Kept(k[layer_idx]) if layer_idx in k else None for k in kept]
                groups = [TableGroup(list(range(n)), lambda: stacked_expert_map(plans, own, cfg.n_experts))]
            carry_heldout(graphdef, state, held, carries, geo, groups, chunk, n, None, {"fitness": self.batches})
            del layer, graphdef, state, groups
        return held["fitness"]

    def _agreement(self, xs: list) -> np.ndarray:
        """Each stream's mean ESAP against the unpruned model's (`reference`), stacked first."""
        streams = [jnp.concatenate([ref, x]) for ref, x in zip(self.reference, xs)]
        out = head_pass(self.ckpt, {"fitness": streams}, {"fitness": self.batches}, self.dtype, agreement=True)
        per_batch = out.esap["fitness"]   # [1 + A, B, S - 1] each
        total = sum(b.sum(axis=(1, 2), dtype=np.float64) for b in per_batch)
        count = sum(b[0].size for b in per_batch)
        return np.asarray(total[1:] / count, np.float64)
