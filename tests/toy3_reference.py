"""The toy3 experiment written plainly in numpy from SPEC's definitions (sections 1-4): the
reference tests/test_toy3.py and tests/test_toy3_merging.py check moejax against, and the per-expert
loop baseline of scripts/bench_toy3.py."""

from __future__ import annotations

import numpy as np


def np_route(sel_TE, scores_TE, top_k):
    """Top-k of `sel` (stable: ties to the lower index), gates from the unbiased scores, renormalised."""
    idx = np.argsort(-sel_TE, axis=1, kind="stable")[:, :top_k]
    gate = np.take_along_axis(scores_TE, idx, axis=1)
    return idx, gate / (gate.sum(axis=1, keepdims=True) + 1e-20)


def np_balance(scores_TE, steps, rate, top_k):
    bias = np.zeros(scores_TE.shape[1], np.float32)
    for _ in range(steps):
        idx, _ = np_route(scores_TE + bias, scores_TE, top_k)
        load = np.bincount(idx.ravel(), minlength=scores_TE.shape[1])
        bias = (bias - np.float32(rate) * np.sign(load - load.mean())).astype(np.float32)
    return bias


def np_routed_output(x_TD, idx_TK, gate_TK, w1, w2):
    """Per-expert loop over routed tokens: y = sum_k g f_idx(x); also each pair's ||f||."""
    y = np.zeros_like(x_TD)
    norms = np.zeros(idx_TK.shape, np.float32)
    for j in range(w1.shape[0]):
        tok, slot = np.nonzero(idx_TK == j)
        if tok.size == 0:
            continue
        f = np.maximum(x_TD[tok] @ w1[j], 0) @ w2[j]
        norms[tok, slot] = np.linalg.norm(f, axis=1)
        np.add.at(y, tok, gate_TK[tok, slot, None] * f)
    return y, norms


def np_output_norm_scores(idx_TK, norms_TK, n_experts):
    """man, msan and max_act from their definitions: each expert's routed pairs' output norms."""
    out = {"man": np.zeros(n_experts), "msan": np.zeros(n_experts), "max_act": np.zeros(n_experts)}
    for j in range(n_experts):
        n = norms_TK[idx_TK == j].astype(np.float64)
        if n.size:
            out["man"][j], out["msan"][j], out["max_act"][j] = n.mean(), (n ** 2).mean(), n.max()
    return out


def np_aimer(w1, w2):
    """-(mean |w|) / sqrt(mean w^2) over each expert's w1 and w2 entries pooled."""
    w = np.concatenate([w1.reshape(len(w1), -1), w2.reshape(len(w2), -1)], axis=1).astype(np.float64)
    return -np.abs(w).mean(1) / np.sqrt((w ** 2).mean(1))


def np_scores(name, counts, gate_norm_sum, norm_sum, router, bias, mean_input, seed, routed=None, experts=None):
    """routed: (chosen experts [T, K], output norms [T, K]) for man, msan, max_act; experts: (w1, w2)
    for aimer."""
    router = router.astype(np.float64)
    if name in ("man", "msan", "max_act"):
        return np_output_norm_scores(*routed, router.shape[0])[name]
    if name == "aimer":
        return np_aimer(*experts)
    return {
        "frequency": lambda: counts,
        "reap": lambda: np.where(counts > 0, gate_norm_sum / np.maximum(counts, 1), 0.0),
        "ean": lambda: norm_sum,
        "w_mean": lambda: router @ mean_input,
        "bias": lambda: -bias.astype(np.float64),
        "signed": lambda: router.sum(axis=1),
        "l1": lambda: np.abs(router).sum(axis=1),
        "random": lambda: np.random.default_rng([seed, 0]).random(router.shape[0]),
    }[name]()


def np_keep_mask(score, keep):
    mask = np.zeros(score.shape[0], bool)
    mask[np.argsort(-score, kind="stable")[:keep]] = True
    return mask


def variant_rows(row: dict, kept_E, counts_E, y_pruned_TD, y_TD) -> list[dict]:
    """One pruned variant's result rows (SPEC section 4): overlap of its kept set with frequency's at
    the same keep, and the relative error of its routed output, over all tokens and per-token median."""
    err, ref = ((y_pruned_TD - y_TD) ** 2).sum(1), (y_TD ** 2).sum(1)
    return [{**row, "metric": "overlap_frequency",
             "value": float((kept_E & np_keep_mask(counts_E, row["keep"])).sum())},
            {**row, "metric": "rel_error", "value": err.sum() / ref.sum()},
            {**row, "metric": "rel_error_median", "value": float(np.median(err / ref))}]


def numpy_toy3(cfg, inputs, seeds):
    """The toy3 experiment in numpy on the given drawn inputs; returns the same tidy rows as moejax."""
    import pandas as pd

    keeps = cfg.keep_counts()
    rows = []
    for seed, inp in zip(seeds, inputs):
        router, w1, w2 = inp["router"], inp["w1"], inp["w2"]
        for o, offset in enumerate(cfg.offsets):
            x_cal, x_held = inp["x_cal"][o], inp["x_held"][o]
            s_cal = 1 / (1 + np.exp(-(x_cal @ router.T)))
            s_held = 1 / (1 + np.exp(-(x_held @ router.T)))
            balanced = np_balance(s_cal, cfg.balance_steps, cfg.balance_rate, cfg.top_k)
            for load in cfg.loads:
                bias = balanced if load == "balanced" else np.zeros_like(balanced)
                base = dict(offset=offset, load=load, seed=int(seed))
                idx, gate = np_route(s_cal + bias, s_cal, cfg.top_k)
                _, norms = np_routed_output(x_cal, idx, gate, w1, w2)
                counts = np.bincount(idx.ravel(), minlength=router.shape[0]).astype(np.float64)
                gns = np.bincount(idx.ravel(), weights=(gate * norms).ravel().astype(np.float64),
                                  minlength=router.shape[0])
                ns = np.bincount(idx.ravel(), weights=norms.ravel().astype(np.float64), minlength=router.shape[0])
                usage = np.sort(counts)[::-1]
                rows.append({**base, "score": None, "keep": None, "metric": "top16_share",
                             "value": usage[:16].sum() / usage.sum()})
                idx_h, gate_h = np_route(s_held + bias, s_held, cfg.top_k)
                y, _ = np_routed_output(x_held, idx_h, gate_h, w1, w2)
                for name in cfg.scores:
                    score = np_scores(name, counts, gns, ns, router, bias, x_cal.mean(0, dtype=np.float64), seed)
                    for keep in keeps:
                        kept = np_keep_mask(score, keep)
                        sel = np.where(kept, s_held + bias, -np.inf)
                        y_p, _ = np_routed_output(x_held, *np_route(sel, s_held, cfg.top_k), w1, w2)
                        rows += variant_rows({**base, "score": name, "keep": keep}, kept, counts, y_p, y)
    return pd.DataFrame(rows)
