"""One calibration pass over a model of any registered family: per-MoE-layer statistics for every score
of SPEC section 2 (moejax.scoring.scores), accumulated over batches in float64.

For each MoE layer and batch, on the router input x (the post-attention RMSNorm output):
  - the model's real routing (bias, groups) and each routed pair's expert output norm ||f_j(x)||;
  - the public REAP code's routing (top-K of the raw logits, softmax gates over all E renormalised
    over the K) and its pairs' output norms, for `reap_code`;
  - the router-input sum, for `w_mean`;
  - the real routing's gate sums and its pairs' outputs f_j(x) [T, K, H] themselves (already
    computed for the norms), whose per-expert sums and sums of squares the host adds in float64,
    for `mone` (and its novice constants, `LayerStats.mean_output_EH`);
  - with `interventions`, each chosen expert's removal, rerouted (its output error and cosine per
    (token, slot)), and each token's preference order over the experts, for `loo_reroute`,
    `loo_reroute_cos` and `ranked_vote` (`moejax.scoring.interventions`);
and, once per layer, the sums of |w| and w^2 of each routed expert's weight matrices, for `aimer`.
Padding tokens are excluded. `calibrate` runs the whole model in memory; `calibrate_streamed` (what
`moejax score` runs) holds one layer's weights at a time (`moejax.inference.stream`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moejax.moe import dispatch as dispatch_lib
from moejax.moe.routing import route
from moejax.parallel.distributed import to_host
from moejax.scoring.interventions import leave_one_out, preference_order
from moejax.scoring.scores import LayerStats, StatsAccumulator


def reap_code_routing(logits_TE: jax.Array, top_k: int):
    """REAP code's routing: top-K of the raw logits (ties to the lower index), gate = softmax over
    all E, renormalised over the chosen K, no scaling factor."""
    _, idx_TK = jax.lax.top_k(logits_TE, top_k)
    gate_TK = jnp.take_along_axis(jax.nn.softmax(logits_TE, axis=-1), idx_TK, axis=-1)
    return idx_TK, gate_TK / jnp.sum(gate_TK, axis=-1, keepdims=True)


def moe_layer_pairs(moe, x_TH: jax.Array, outputs: bool = True, interventions: bool = True) -> dict:
    """Per-pair quantities of one MoE layer on router inputs x (both routings); outputs: also the
    real routing's pair outputs f [T, K, H] (`out`), for the output sums; interventions: also each
    chosen expert's removal rerouted (`loo_sq`, `loo_cos` [T, K]) and each token's preference order
    (`order` [T, E])."""
    logits = moe.router_logits(x_TH)
    r = route(logits, moe.router_cfg, moe.balance_bias())
    experts = moe.expert_weights()

    def norms(f_TKD):
        return jnp.linalg.norm(f_TKD.astype(jnp.float32), axis=-1)

    def pairs(idx_TK):  # statistics need no gradients: only the blocks in use are computed
        return dispatch_lib.pair_outputs(x_TH, idx_TK, experts, moe.expert_fn, moe.backend, forward_only=True)

    real = pairs(r.expert_idx_TK)
    real_norm = norms(real)
    code_idx, code_gate = reap_code_routing(logits, moe.router_cfg.top_k)
    # REAP code's routing mostly picks the pairs the model picked: reuse those, compute only the rest
    # (absent pairs get expert index E and cost nothing in the forward-only grouped matmul).
    same_TKK = code_idx[:, :, None] == r.expert_idx_TK[:, None, :]
    reused = jnp.any(same_TKK, axis=-1)
    n_experts = moe.router.shape[0]
    extra_idx = jnp.where(reused, n_experts, code_idx)
    extra = pairs(extra_idx)
    code_norm = jnp.where(reused, jnp.sum(jnp.where(same_TKK, real_norm[:, None, :], 0), axis=-1), norms(extra))
    out = dict(idx=r.expert_idx_TK, gate=r.gate_TK, norm=real_norm,
               code_idx=code_idx, code_gate=code_gate, code_norm=code_norm, **({"out": real} if outputs else {}))
    if interventions:
        out["loo_sq"], out["loo_cos"] = leave_one_out(x_TH, logits, moe.router_cfg, moe.balance_bias(), r.expert_idx_TK,
                                                      experts, moe.expert_fn)
        out["order"] = preference_order(logits)
    return out


def calibrate(model, batches) -> dict[int, LayerStats]:
    """{HF layer index: LayerStats} from batches of (input_ids [B, S], attention_mask [B, S] or None),
    with the whole model in memory: every score's statistics."""
    cfg = model.config
    forward = model.jitted()
    per_layer = {l: [] for l in cfg.scored_layers}   # a layer kept whole (DeepSeek-V4's hash layers) is not scored
    masks = []
    for input_ids, attention_mask in batches:
        input_ids = jnp.asarray(input_ids)
        mask = np.ones(input_ids.shape, bool) if attention_mask is None else np.asarray(attention_mask, bool)
        masks.append(mask.reshape(-1))
        moe_inputs = forward(input_ids, jnp.asarray(mask), return_moe_inputs=True).moe_inputs
        for l in per_layer:
            per_layer[l].append(moe_inputs[l])
    stats = {}
    for l, router_inputs in per_layer.items():
        moe = model.model.layers[l].mlp
        acc = StatsAccumulator(moe.router.shape[0], cfg.hidden_size)  # the layer's own count (pruned per layer)
        accumulate_layer(moe, router_inputs, masks, acc, interventions=True)
        stats[l] = acc.stats(jax.device_get(moe.router[...]), jax.device_get(moe.balance_bias()), layer=l)
    return stats


@functools.partial(jax.jit, static_argnums=(0, 3, 4))
def _pairs(graphdef, state, x_TH, outputs: bool = True, interventions: bool = True):
    return moe_layer_pairs(nnx.merge(graphdef, state), x_TH, outputs, interventions)


def _run_length(n: int, most: int = 256) -> int:
    """The largest divisor of n that is at most `most`: the run of entries summed in float32."""
    return max(d for d in range(1, min(n, most) + 1) if n % d == 0)


@jax.jit
def _weight_partial_sums(weights: dict) -> dict:
    """Per stacked expert matrix [E, a, b]: sums of |w| and w^2 in float32 over runs of at most 256
    consecutive entries of the last axis ([E, a, b / run] each), so the host sums the rest in
    float64 and the result does not depend on one long float32 sum. Both sums are one variadic
    reduction, so the cast and the elementwise work fuse into it: two separate sums made XLA hold
    a float32 copy of the whole layer's experts (2.1 GB for a bfloat16 Moonlight layer) and took
    8x longer."""
    out = {}
    zero = np.float32(0)
    for name, w in weights.items():
        run = _run_length(w.shape[-1])
        w = w.reshape(*w.shape[:-1], w.shape[-1] // run, run).astype(jnp.float32)
        out[name] = jax.lax.reduce((jnp.abs(w), jnp.square(w)), (zero, zero),
                                   lambda a, b: (a[0] + b[0], a[1] + b[1]), (w.ndim - 1,))
    return out


def expert_weight_sums(moe) -> tuple[np.ndarray, np.ndarray, int]:
    """(sum |w| [E], sum w^2 [E], entries per expert) of the layer's routed experts' weight matrices
    as held (`moe.expert_weights()`: every matrix `expert_fn` reads; gpt-oss's biases, one vector
    per expert, are not matrices and are left out, as the checkpoint path leaves them), partial sums
    on the device (split over an expert mesh like the weights) finished in float64 on the host."""
    weights = {k: w for k, w in moe.expert_weights().items() if w.ndim >= 3}
    partial = to_host(_weight_partial_sums(weights))
    E = next(iter(weights.values())).shape[0]
    abs_sum, sq_sum = np.zeros(E), np.zeros(E)
    for a, q in partial.values():
        abs_sum += np.asarray(a, np.float64).reshape(E, -1).sum(axis=1)
        sq_sum += np.asarray(q, np.float64).reshape(E, -1).sum(axis=1)
    return abs_sum, sq_sum, sum(int(np.prod(w.shape[1:])) for w in weights.values())


def accumulate_layer(moe, router_inputs, masks, acc: StatsAccumulator, weight_sums=None,
                     outputs: bool = True, interventions: bool = False) -> None:
    """Add one MoE layer's statistics over batches (router inputs [B*S, H], masks [B*S] or None),
    and its experts' weight sums (`weight_sums`, when the caller already has this layer's
    `expert_weight_sums`: they do not depend on the tokens). outputs: also the sums of the routed
    pairs' outputs and their squares (`mone`; the pairs' outputs [T, K, H] come to the host,
    which sums them in float64); False leaves `output_sum_EH` None. interventions: also the
    leave-one-out sums and the preference orders (`INTERVENTION_SCORES`); False leaves them None."""
    acc.add_weight_sums(*(weight_sums or expert_weight_sums(moe)))
    graphdef, state = nnx.split(moe)
    for x_TH, mask in zip(router_inputs, masks):
        # gathered from every process's devices
        out, x_TH = to_host((_pairs(graphdef, state, x_TH, outputs, interventions), x_TH))
        acc.add(out["idx"], out["gate"], out["norm"], x_TH, mask,
                out["code_idx"], out["code_gate"], out["code_norm"], out.get("out"))
        if interventions:
            acc.add_interventions(out["idx"], out["loo_sq"], out["loo_cos"], out["order"], mask)


def calibrate_streamed(checkpoint, batches, dtype=jnp.float32, progress=None, mesh=None,
                       outputs: bool = True, mtp: bool = True, interventions: bool = False) -> dict[int, LayerStats]:
    """Like `calibrate`, from a checkpoint folder one decoder layer at a time (moejax.inference.stream);
    with a mesh (under `jax.set_mesh(mesh)`), each layer's experts split over its expert axis and
    every pair computed on the device holding its expert, the statistics summed across shards.
    outputs: also the routed outputs' sums (`accumulate_layer`; `mone` and substitution need them,
    no other score does). mtp: the checkpoint's MTP layers too, run as inference runs them
    (`moejax.inference.stream.stream_layers`). interventions: the leave-one-out sums and preference
    orders (`INTERVENTION_SCORES` need them, no other score does)."""
    from moejax.inference.stream import mtp_rows, stream_layers  # at call time: tests patch it to refuse a pass

    from moejax.hf.model_io import OpenCheckpoint, open_checkpoint

    ckpt = checkpoint if isinstance(checkpoint, OpenCheckpoint) else open_checkpoint(checkpoint)
    stats = {}
    for layer, moe, router_inputs in stream_layers(ckpt, batches, dtype, progress, mesh=mesh, mtp=mtp):
        masks = [None if m is None else np.asarray(mtp_rows(ckpt.config, layer, m), bool).reshape(-1) for _, m in batches]
        acc = StatsAccumulator(moe.router.shape[0], moe.router.shape[1])
        accumulate_layer(moe, router_inputs, masks, acc, outputs=outputs, interventions=interventions)
        stats[layer] = acc.stats(jax.device_get(moe.router[...]), jax.device_get(moe.balance_bias()), layer=layer)
        del moe, router_inputs  # before the next layer's weights are read: one layer in memory at a time
    return stats
