"""The toy3 experiment (SPEC section 4): when does a data-free router score pick the experts
that calibration would pick?

One toy MoE layer (top 4 of 64, ReLU-MLP experts). For each seed, condition
(offset direction x load) and score, keep the top-`keep` experts and measure how wrong the pruned
layer is on held-out tokens.

    router  sigmoid:  s = sigmoid(logits), chosen = top 4 of s + bias (DeepSeek-V3; the default)
            softmax:  s = softmax(logits) over the experts, chosen = top 4 of s, no bias
                      (Qwen3-MoE, Mixtral); either way gates = s of the chosen, renormalised over the 4
    offset  ones:     x = mu + noise, mu along the all-ones vector, ||mu|| = 0.5 sqrt(d)
            random:   mu along a random unit direction (per seed)
    load    skewed:   bias 0
            balanced: 300 steps of bias -= 0.002 sign(load - mean(load)) on the calibration tokens
                      (sigmoid only: a softmax router has no balance bias, and Qwen3-MoE / Mixtral
                      balance by an auxiliary loss in training, which a router-only toy does not
                      define; so router=softmax refuses loads containing `balanced`, and scores
                      that read the bias)

Seeds are vectorised inside one job. How the work is laid out:
  host (numpy)   draw every seed's layer and tokens;
  stage 1 (jit)  balance, route the calibration tokens
                 (sorted grouped-matmul backend: only routed pairs) and tabulate f_j(x) for
                 every held-out token and expert once (each pruned variant's output is a
                 gate-weighted sum of entries of that table, so no variant recomputes an expert);
  host (numpy)   float64 statistics, scores, kept sets (ties to the lower index);
  stage 2 (jit)  route the held-out tokens under every kept set (masks, one compile) and
                 measure the errors (SPEC section 3).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import time

import numpy as np

from moejax.errors import ConfigError
from moejax.experiments import refuse_unknown_settings
from moejax.parallel.mesh import MeshConfig, mesh_context
from moejax.scoring.scores import scores_for
from moejax.scoring.select import resolve_keep

log = logging.getLogger(__name__)

OFFSETS = ("ones", "random")
LOADS = ("skewed", "balanced")
ROUTERS = ("sigmoid", "softmax")  # toy_layer.ROUTERS, not imported: validating needs no JAX
DEFAULT_SCORES = ("frequency", "signed", "l1", "random", "reap", "ean")


@dataclasses.dataclass(frozen=True)
class Toy3Config:
    """Every setting of toy3; defaults are SPEC section 4."""

    seed: int = 0                 # first seed
    seeds: int = 8                # seeds seed .. seed + seeds - 1, vectorised in one job
    keep: tuple = (8, 16, 32, 48)  # counts, or ratios of E (floats in (0, 1])
    scores: tuple = DEFAULT_SCORES
    offsets: tuple = OFFSETS
    loads: tuple = LOADS
    d_model: int = 32
    d_hidden: int = 64
    n_experts: int = 64
    top_k: int = 4
    n_calib: int = 6000
    n_heldout: int = 6000
    balance_steps: int = 300
    balance_rate: float = 0.002
    offset_scale: float = 0.5     # ||mu|| = offset_scale * sqrt(d)
    router: str = "sigmoid"       # sigmoid (balance bias, DeepSeek-V3) or softmax (no bias, Qwen3-MoE)
    backend: str = "sorted"       # dispatch backend of the calibration pass ("ep" on a mesh); the Hydra
    #                               config's toy.backend=auto picks it from the mesh (settings_from)
    mesh_data: int = 1            # devices: data x expert (from the Hydra `mesh` group)
    mesh_expert: int = 1
    seed_batch: int = 8           # seeds vectorised together (bounds memory)

    @classmethod
    def from_mapping(cls, cfg: dict) -> "Toy3Config":
        """Build from a plain dict (a resolved Hydra config), rejecting unknown keys and bad values."""
        cfg = dict(cfg)
        refuse_unknown_settings(cls, cfg, "toy3")
        if "keep" in cfg and cfg["keep"] is not None:
            keep = cfg["keep"]
            cfg["keep"] = tuple(keep) if isinstance(keep, (list, tuple)) else (keep,)
        elif "keep" in cfg:
            del cfg["keep"]
        for key in ("scores", "offsets", "loads"):
            if key in cfg:
                cfg[key] = tuple(cfg[key]) if isinstance(cfg[key], (list, tuple)) else (cfg[key],)
        out = cls(**cfg)
        out.validate()
        return out

    def validate(self) -> None:
        for name in ("seed", "seeds", "d_model", "d_hidden", "n_experts", "top_k", "n_calib",
                     "n_heldout", "balance_steps", "seed_batch", "mesh_data", "mesh_expert"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"toy3: {name} must be an integer, got {value!r}")
        if self.seeds < 1:
            raise ConfigError(f"toy3: seeds={self.seeds}; need at least one seed (seeds >= 1)")
        if self.seed < 0:
            raise ConfigError(f"toy3: seed={self.seed}; seeds are non-negative integers")
        for name, value, valid in (("offsets", self.offsets, OFFSETS), ("loads", self.loads, LOADS)):
            bad = [v for v in value if v not in valid]
            if bad or not value:
                raise ConfigError(f"toy3: {name}={list(value)}; valid values: {list(valid)}")
        self.check_router()
        if "reap_code" in self.scores:
            raise ConfigError("toy3: the reap_code score needs expert outputs for pairs the layer did not "
                              "route, which the toy does not compute; use reap")
        if not self.keep:
            raise ConfigError("toy3: keep is empty; give a count, a ratio of E, or a list of them")
        self.keep_counts()
        if self.n_calib < 1 or self.n_heldout < 1 or self.seed_batch < 1:
            raise ConfigError("toy3: n_calib, n_heldout and seed_batch must be >= 1")
        mesh = MeshConfig(self.mesh_data, self.mesh_expert)
        if self.backend == "ep" and self.n_experts % mesh.expert:
            raise ConfigError(f"toy3: n_experts={self.n_experts} does not split over mesh.expert={mesh.expert}")
        if mesh.expert_parallel and self.backend != "ep":
            raise ConfigError(f"toy3: mesh.expert={mesh.expert} needs toy.backend=ep (got {self.backend!r})")

    def check_router(self) -> None:
        """A softmax router has no balance bias: the `balanced` load (bias trained by auxiliary-loss-free
        steps) and scores that read the bias are not defined for it; refused here, naming the setting."""
        if self.router not in ROUTERS:
            raise ConfigError(f"toy3: router={self.router!r}; valid routers: {list(ROUTERS)}")
        has_bias = self.has_balance_bias
        if not has_bias and "balanced" in self.loads:
            raise ConfigError(f"toy3: loads={list(self.loads)} with router={self.router}: the balanced load trains "
                              "the sigmoid router's balance bias, and a softmax router has none; "
                              "use loads=[skewed] (toy.loads=[skewed])")
        scores_for(self.scores, has_bias, where=f"toy3 (router={self.router})")

    @property
    def has_balance_bias(self) -> bool:
        """Whether the layer's router has a balance bias (e_score_correction_bias): sigmoid only."""
        return self.router == "sigmoid"

    def keep_counts(self) -> list[int]:
        return [resolve_keep(k, self.n_experts, self.top_k) for k in self.keep]


# What moejax.experiments.runner looks for in an experiment module (see moejax.experiments).
Config = Toy3Config


def settings_from(cfg: dict) -> dict:
    """toy3's settings from the resolved Hydra config: the `toy` block plus seed, seeds and keep."""
    settings = dict(cfg.get("toy") or {})
    settings.update({k: cfg[k] for k in ("seed", "seeds", "keep") if cfg.get(k) is not None})
    mesh = MeshConfig.from_dict(cfg.get("mesh"))
    settings.update(mesh_data=mesh.data, mesh_expert=mesh.expert)
    if settings.get("backend", "auto") == "auto":  # the routed experts' backend follows the mesh
        settings["backend"] = "ep" if mesh.expert_parallel else "sorted"
    return settings


def summary_title(cfg: Toy3Config) -> str:
    return f"{cfg.router} router: mean rel_error over {cfg.seeds} seed(s) (± std), by keep:"


def draw_inputs(cfg: Toy3Config, seeds) -> list[dict]:
    """Everything random about each seed (SPEC section 4), drawn on the host with numpy: the
    layer's weights router [E, d], w1 [E, d, h], w2 [E, h, d], and the tokens under each offset,
    x_cal [O, n_calib, d] and x_held [O, n_heldout, d], all float32.

    numpy rather than jax.random: the draw is cheap either way, but XLA took ~2.6 s to compile
    the jax.random version, a quarter of a cold run. Weights, offset direction, calibration and
    held-out tokens come from separate child streams, so changing a token count leaves the
    weights as they were. (The `random` score uses its own stream, [seed, 0].)
    """
    return [_draw(cfg, int(seed)) for seed in seeds]


def _draw(cfg: Toy3Config, seed: int) -> dict:
    g_model, g_dir, g_cal, g_held = (np.random.default_rng(s)
                                     for s in np.random.SeedSequence([seed, 1]).spawn(4))
    d, h, n_experts = cfg.d_model, cfg.d_hidden, cfg.n_experts

    def normal(gen, shape, std=1.0):
        return gen.standard_normal(shape, dtype=np.float32) * np.float32(std)

    router = normal(g_model, (n_experts, d), d ** -0.5)
    w1 = normal(g_model, (n_experts, d, h), d ** -0.5)
    w2 = normal(g_model, (n_experts, h, d), h ** -0.5)
    v = g_dir.standard_normal(d)
    directions = {"ones": np.ones(d) / np.sqrt(d), "random": v / np.linalg.norm(v)}
    mu_OD = (cfg.offset_scale * np.sqrt(d) * np.stack([directions[o] for o in cfg.offsets])).astype(np.float32)
    # The same noise under both offsets: the offset comparison is paired.
    x_cal = mu_OD[:, None] + normal(g_cal, (cfg.n_calib, d))
    x_held = mu_OD[:, None] + normal(g_held, (cfg.n_heldout, d))
    return {"router": router, "w1": w1, "w2": w2, "x_cal": x_cal, "x_held": x_held}


@functools.lru_cache(maxsize=8)
def _stage_one(cfg: Toy3Config):
    """Per seed: balancing, the calibration pass and the held-out table, from the drawn inputs
    (`draw_inputs`, stacked over seeds). Returns a jitted function (cached per config, so repeated
    runs reuse it)."""
    import jax
    import jax.numpy as jnp

    from moejax.models import toy_layer
    from moejax.moe.balancing import balance_bias

    @jax.jit
    def run(router_Z, w1_Z, w2_Z, x_cal_ZOTD, x_held_ZOTD):
        def weights(s):
            return {"router": router_Z[s], "w1": w1_Z[s], "w2": w2_Z[s]}

        logits_cal_ZOTE = jax.vmap(jax.vmap(toy_layer.router_logits, in_axes=(None, 0)))(router_Z, x_cal_ZOTD)
        zeros_ZOE = jnp.zeros(logits_cal_ZOTE.shape[:2] + logits_cal_ZOTE.shape[3:], jnp.float32)
        if "balanced" in cfg.loads:  # sigmoid only (Toy3Config.check_router)
            balanced_ZOE = balance_bias(logits_cal_ZOTE, toy_layer.router_config(cfg.top_k, cfg.router),
                                        cfg.balance_steps, cfg.balance_rate)
        # a softmax router has no bias: its zeros choose nothing (s + 0 = s)
        bias_ZOWE = jnp.stack([balanced_ZOE if ld == "balanced" else zeros_ZOE for ld in cfg.loads], axis=2)

        n_offsets, n_loads = len(cfg.offsets), len(cfg.loads)

        def calibrate(i):  # routing and each routed pair's ||f_j(x)|| of one (seed, offset, load)
            s, o, ld = i // (n_offsets * n_loads), i // n_loads % n_offsets, i % n_loads
            routing, f_TKD, _ = toy_layer.routed_pass(weights(s), x_cal_ZOTD[s, o], cfg.top_k,
                                                      bias_ZOWE[s, o, ld], backend=cfg.backend,
                                                      router=cfg.router)
            return routing.expert_idx_TK, routing.gate_TK, jnp.linalg.norm(f_TKD, axis=-1)

        # loops over conditions, not vmap: XLA:CPU runs the grouped matmuls of one condition at a
        # time about 1.5x faster than batched over all of them (likewise the table below)
        cal = [a.reshape(*bias_ZOWE.shape[:3], *a.shape[1:])
               for a in jax.lax.map(calibrate, jnp.arange(bias_ZOWE.shape[0] * n_offsets * n_loads))]
        logits_held = jax.vmap(jax.vmap(toy_layer.router_logits, in_axes=(None, 0)))(router_Z, x_held_ZOTD)

        def held_table(i):  # f_j(x) of every held-out token and expert of one (seed, offset)
            s, o = i // n_offsets, i % n_offsets
            return toy_layer.expert_output_table(weights(s), x_held_ZOTD[s, o])

        n_held = x_held_ZOTD.shape[0] * x_held_ZOTD.shape[1]
        f_held_ZOETD = jax.lax.map(held_table, jnp.arange(n_held)).reshape(
            *x_held_ZOTD.shape[:2], cfg.n_experts, *x_held_ZOTD.shape[2:])
        return dict(cal_idx=cal[0], cal_gate=cal[1], cal_norm=cal[2], x_cal_mean=x_cal_ZOTD.mean(axis=2),
                    bias=bias_ZOWE, f_held=f_held_ZOETD, logits_held=logits_held)

    return run


@functools.lru_cache(maxsize=8)
def _stage_two(cfg: Toy3Config):
    """Route the held-out tokens under every kept set and measure the error of each variant.
    Returns a function (f_held, logits_held, bias, masks) -> (all-token relative error [..., A],
    per-token relative errors [..., A, T]); the median is taken on the host (numpy's partition-based
    median is far cheaper than a sort per variant on the device).

    Routing is `route`'s choice computed without `lax.top_k` (moejax/moe/topk.py, tested equal):
    one jitted call finds each token's K-th largest biased score under every mask, a second reads
    off the chosen experts and combines their outputs from the held-out table. (Two calls, so the
    K-th values are materialised; fused into their consumer XLA recomputes them per expert.)
    The unpruned layer is routed the same way, as variant 0, so a variant that routes every token
    as the full layer does has an error of exactly zero.

    Softmax router: a pruned layer's softmax runs over its kept experts only (what `route` computes
    under a mask, and a physically pruned checkpoint computes). With `norm_topk_prob` neither the
    choice (the top K kept logits, softmax being increasing) nor the gates
    (exp(l_j) / sum over the K chosen of exp(l_i)) depends on that normaliser, so both are read off
    the full layer's softmax over all E; equal to `route` under the mask up to float rounding
    (tests/test_toy3.py checks against numpy's softmax over the kept experts).
    """
    import jax
    import jax.numpy as jnp

    from moejax.models import toy_layer
    from moejax.moe.dispatch import combine_from_table
    from moejax.moe.routing import gates
    from moejax.moe.topk import kth_largest, topk_indices_at_threshold

    router_cfg = toy_layer.router_config(cfg.top_k, cfg.router)

    def scores(logits):  # s of the unpruned layer: sigmoid, or softmax over all E
        return toy_layer.router_scores(logits, cfg.router)

    def with_unpruned(masks_AE):  # variant 0 keeps every expert
        return jnp.concatenate([jnp.ones_like(masks_AE[..., :1, :]), masks_AE], axis=-2)

    # [Z, O, T, E] logits, [Z, O, W, E] biases, [Z, O, W, A, E] masks: map over seeds and offsets
    per_load = functools.partial(jax.vmap, in_axes=(None, None, 0, 0, 0))

    @jax.jit
    def kth_values(logits, bias, masks):
        sel_ZOWET = jnp.swapaxes(scores(logits)[:, :, None] + bias[:, :, :, None], -1, -2)
        # the masks go into the network (one expert at a time), not onto a copy of the scores per variant
        return kth_largest(sel_ZOWET[:, :, :, None], cfg.top_k, keep_E=with_unpruned(masks))

    @jax.jit
    def errors(f, logits, bias, masks, kth):
        @per_load
        def condition(f_ETD, logits_TE, bias_E, masks_AE, kth_AT):
            s_TE = scores(logits_TE)
            idx_ATK = topk_indices_at_threshold((s_TE + bias_E).T, kth_AT, cfg.top_k, keep_E=with_unpruned(masks_AE))
            gate_ATK = gates(s_TE, idx_ATK, router_cfg)
            # the unpruned output in its own call: sliced off the variants' outputs, XLA
            # recomputed it for every variant (4x slower)
            y_TD = combine_from_table(gate_ATK[0], idx_ATK[0], f_ETD)
            err_sq_AT = jnp.sum((combine_from_table(gate_ATK[1:], idx_ATK[1:], f_ETD) - y_TD) ** 2, axis=-1)
            y_sq_T = jnp.sum(y_TD ** 2, axis=-1)
            return err_sq_AT.sum(axis=-1) / y_sq_T.sum(), err_sq_AT / y_sq_T

        def seed_offset(args):
            return condition(*args)

        lead = f.shape[:2]  # one (seed, offset) at a time bounds memory: [W, A, T, D] outputs
        flat = [a.reshape(-1, *a.shape[2:]) for a in (f, logits, bias, masks, kth)]
        rel, per_token = jax.lax.map(seed_offset, flat)
        return rel.reshape(*lead, *rel.shape[1:]), per_token.reshape(*lead, *per_token.shape[1:])

    def run(f, logits, bias, masks):
        return errors(f, logits, bias, masks, kth_values(logits, bias, masks))

    return run


def run(cfg: Toy3Config, progress=None, job_dir=None):
    """Run toy3; returns (tidy pandas DataFrame, timings dict)."""
    cfg.validate()
    with mesh_context(MeshConfig(cfg.mesh_data, cfg.mesh_expert)):
        return _run(cfg, progress)


def _run(cfg: Toy3Config, progress=None):
    import jax
    import pandas as pd

    from moejax.scoring.scores import compute_scores, stats_from_pairs
    from moejax.scoring.select import select_kept

    keeps = cfg.keep_counts()
    variants = [(name, keep) for name in cfg.scores for keep in keeps]  # stage two's variant axis
    all_seeds = np.arange(cfg.seed, cfg.seed + cfg.seeds)
    batches = [all_seeds[i:i + cfg.seed_batch] for i in range(0, len(all_seeds), cfg.seed_batch)]
    rows, timings = [], {"stage_one_s": 0.0, "host_s": 0.0, "stage_two_s": 0.0}
    for batch in batches:
        conditions = list(itertools.product(enumerate(batch), enumerate(cfg.offsets), enumerate(cfg.loads)))
        t0 = time.perf_counter()
        drawn = draw_inputs(cfg, batch)
        stacked = {k: np.stack([d[k] for d in drawn]) for k in ("router", "w1", "w2", "x_cal", "x_held")}
        one = jax.block_until_ready(_stage_one(cfg)(*stacked.values()))
        host = jax.device_get({k: v for k, v in one.items() if k not in ("f_held", "logits_held")})
        host["router"] = stacked["router"]
        t1 = time.perf_counter()
        masks = np.zeros((len(batch), len(cfg.offsets), len(cfg.loads), len(variants), cfg.n_experts), bool)
        for (s, seed), (o, offset), (l_, load) in conditions:
            base = dict(offset=offset, load=load, seed=int(seed))
            stats = stats_from_pairs(host["cal_idx"][s, o, l_], host["cal_gate"][s, o, l_],
                                     host["cal_norm"][s, o, l_], host["x_cal_mean"][s, o],
                                     host["router"][s], host["bias"][s, o, l_] if cfg.has_balance_bias else None,
                                     seed=int(seed), layer=0)
            scores = compute_scores(stats, cfg.scores)
            frequency_kept = {keep: select_kept(stats.counts_E, keep) for keep in keeps}
            usage = np.sort(stats.counts_E)[::-1]
            rows.append({**base, "score": None, "keep": None, "metric": "top16_share",
                         "value": float(usage[:16].sum() / usage.sum())})
            for v, (name, keep) in enumerate(variants):
                masks[s, o, l_, v] = kept = select_kept(scores[name], keep)
                rows.append({**base, "score": name, "keep": keep, "metric": "overlap_frequency",
                             "value": float(np.sum(kept & frequency_kept[keep]))})
        t2 = time.perf_counter()
        rel_all, rel_per_token = jax.device_get(jax.block_until_ready(_stage_two(cfg)(
            one["f_held"], one["logits_held"], one["bias"], masks)))
        rel_median = np.median(rel_per_token, axis=-1)
        t3 = time.perf_counter()
        for (s, seed), (o, offset), (l_, load) in conditions:
            for v, (name, keep) in enumerate(variants):
                base = dict(offset=offset, load=load, seed=int(seed), score=name, keep=keep)
                rows.append({**base, "metric": "rel_error", "value": float(rel_all[s, o, l_, v])})
                rows.append({**base, "metric": "rel_error_median", "value": float(rel_median[s, o, l_, v])})
        timings["stage_one_s"] += t1 - t0
        timings["host_s"] += t2 - t1
        timings["stage_two_s"] += t3 - t2
        if progress is not None:
            progress(len(batch))
    df = pd.DataFrame(rows, columns=["offset", "load", "seed", "score", "keep", "metric", "value"])
    df["keep"] = df["keep"].astype("Int64")
    return df, timings


def summary_table(df):
    """Mean +- std over seeds of rel_error, rows (offset, load, score), one column per keep."""
    err = df[df.metric == "rel_error"]
    agg = err.groupby(["offset", "load", "score", "keep"])["value"].agg(["mean", "std"]).reset_index()
    agg["cell"] = [f"{m:.3f} ± {0.0 if np.isnan(s) else s:.3f}" for m, s in zip(agg["mean"], agg["std"])]
    table = agg.pivot(index=["offset", "load", "score"], columns="keep", values="cell")
    table.columns = [f"keep={k}" for k in table.columns]
    return table

