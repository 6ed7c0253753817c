"""toy3's stage one, a jitted program per batch of seeds: balance the router, route the calibration
tokens and bring to the host what the statistics, scores and merges read; and `held_table`, the
held-out expert outputs tabulated once when the later programs read the whole table
(`merges_read_table`)."""

from __future__ import annotations

import functools

from moejax.experiments.toy3.config import Toy3Config


@functools.lru_cache(maxsize=8)
def stage_one(cfg: Toy3Config):
    """Per seed: balancing and the calibration pass, from the drawn inputs
    (`draw_inputs`, stacked over seeds); for the merges, each expert's mean output over the
    calibration tokens (hc_smoe) and the calibration tokens' router logits (m_smoe). Returns a
    jitted function (cached per config, so repeated runs reuse it) of the stacked draw, router
    [Z, E, D], w1 [Z, E, D, F], w2 [Z, E, F, D], x_cal and x_held [Z, O, T, D], to a dict:

      cal_idx, cal_gate, cal_norm  [Z, O, W, T, K]  the calibration tokens' routing, ||f_j(x)|| per pair
      x_cal_mean                   [Z, O, D]
      bias                         [Z, O, W, E]     each load's balance bias (skewed: zeros)
      logits_held                  [Z, O, T, E]     the held-out tokens' router logits
      cal_out                      [Z, O, W, T, K, D]  the routed pairs' outputs (`needs_outputs`)
      cal_mean_output              [Z, O, E, D]     hc_smoe's mean outputs
      logits_cal                   [Z, O, T, E]     the calibration tokens' logits (m_smoe, ream)
      cal_gated_output             [Z, O, E, D]     ream's router-weighted output sums"""
    import jax
    import jax.numpy as jnp

    from moejax.models import toy_layer
    from moejax.moe.balancing import balance_bias

    @jax.jit
    def run(router_ZED, w1_ZEDF, w2_ZEFD, x_cal_ZOTD, x_held_ZOTD):
        def weights(s):
            return {"router": router_ZED[s], "w1": w1_ZEDF[s], "w2": w2_ZEFD[s]}

        logits_cal_ZOTE = jax.vmap(jax.vmap(toy_layer.router_logits, in_axes=(None, 0)))(router_ZED, x_cal_ZOTD)
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
            out = routing.expert_idx_TK, routing.gate_TK, jnp.linalg.norm(f_TKD, axis=-1)
            return (*out, f_TKD) if cfg.needs_outputs else out

        # loops over conditions, not vmap: XLA:CPU runs the grouped matmuls of one condition at a
        # time about 1.5x faster than batched over all of them (likewise the table below)
        cal = [a.reshape(*bias_ZOWE.shape[:3], *a.shape[1:])
               for a in jax.lax.map(calibrate, jnp.arange(bias_ZOWE.shape[0] * n_offsets * n_loads))]
        logits_held = jax.vmap(jax.vmap(toy_layer.router_logits, in_axes=(None, 0)))(router_ZED, x_held_ZOTD)

        n_held = x_held_ZOTD.shape[0] * x_held_ZOTD.shape[1]
        out = dict(cal_idx=cal[0], cal_gate=cal[1], cal_norm=cal[2], x_cal_mean=x_cal_ZOTD.mean(axis=2),
                   bias=bias_ZOWE, logits_held=logits_held)
        if cfg.needs_outputs:  # the routed pairs' outputs [Z, O, W, T, K, D]
            out["cal_out"] = cal[3]
        if cfg.merges_read("mean_output_EH"):
            def mean_outputs(i):  # c_j = mean over the calibration tokens of f_j(x), one (seed, offset)
                return toy_layer.mean_expert_outputs(weights(i // n_offsets), x_cal_ZOTD[i // n_offsets, i % n_offsets])

            out["cal_mean_output"] = jax.lax.map(mean_outputs, jnp.arange(n_held)).reshape(
                *x_cal_ZOTD.shape[:2], cfg.n_experts, x_cal_ZOTD.shape[-1])
        if cfg.merges_read("logit_gram_EE"):
            out["logits_cal"] = logits_cal_ZOTE
        if cfg.merges_read("gated_output_sum_EH"):
            def gated_outputs(i):  # m_j = sum_t softmax(l(x_t))_j f_j(x_t), one (seed, offset)
                s, o = i // n_offsets, i % n_offsets
                p_TE = jax.nn.softmax(logits_cal_ZOTE[s, o], axis=-1)
                return toy_layer.gated_expert_output_sums(weights(s), x_cal_ZOTD[s, o], p_TE)

            out["cal_gated_output"] = jax.lax.map(gated_outputs, jnp.arange(n_held)).reshape(
                *x_cal_ZOTD.shape[:2], cfg.n_experts, x_cal_ZOTD.shape[-1])
        return out

    return run


@functools.lru_cache(maxsize=8)
def held_table(cfg: Toy3Config):
    """The held-out table f_j(x) of every held-out token and expert, [Z, O, E, T, D] (when
    `merges_read_table`): a jitted function of w1 [Z, E, D, F], w2 [Z, E, F, D], x_held [Z, O, T, D].
    A program of its own, apart from `stage_one`, because nothing on the host waits for it: the job
    starts it and decides the variants while it runs (JAX dispatches it without waiting), and only
    stage two reads it. Loops over (seed, offset), as stage one does."""
    import jax
    import jax.numpy as jnp

    from moejax.models import toy_layer

    @jax.jit
    def tabulate(w1_ZEDF, w2_ZEFD, x_held_ZOTD):
        n_offsets = x_held_ZOTD.shape[1]

        def one(i):  # one (seed, offset)
            s, o = i // n_offsets, i % n_offsets
            return toy_layer.expert_output_table({"w1": w1_ZEDF[s], "w2": w2_ZEFD[s]}, x_held_ZOTD[s, o])

        lead = x_held_ZOTD.shape[:2]
        return jax.lax.map(one, jnp.arange(lead[0] * lead[1])).reshape(*lead, cfg.n_experts, *x_held_ZOTD.shape[2:])

    def compile_for(n_seeds: int) -> None:
        """Compile for a batch of n_seeds seeds from the shapes alone."""
        O, T, E, D, F = len(cfg.offsets), cfg.n_heldout, cfg.n_experts, cfg.d_model, cfg.d_hidden
        tabulate.lower(*(jax.ShapeDtypeStruct((n_seeds, *shape), jnp.float32)
                         for shape in ((E, D, F), (E, F, D), (O, T, D)))).compile()

    tabulate.compile_for = compile_for
    return tabulate


def merges_read_table(cfg: Toy3Config) -> bool:
    """Whether the merges' variants or Eq. 6 need the whole held-out table [Z, O, E, T, D] (786 MB
    at the full settings): then `held_table` tabulates it once for them and stage two; without merges
    stage two tabulates each (seed, offset) in its loop, and the table is never whole."""
    return bool(cfg.merges) or cfg.eq6_pairs > 0 or bool(cfg.substitutes)
