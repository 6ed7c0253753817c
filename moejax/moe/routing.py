"""The router every family uses (SPEC section 1), as one pure, jit-able function: DeepSeek-V3 and
GLM-4.5 route by sigmoid with a balance bias and groups; Qwen3-MoE, Mixtral and OLMoE by softmax;
DeepSeek-V4 by sqrt(softplus) with a balance bias, and in its `hash_moe` layers by a fixed table.

    logits = x @ W_router.T                       # float32
    s      = sigmoid(logits)                      # or softmax, or sqrt(softplus(logits)) (DeepSeek-V4)
    sel    = s + bias                             # bias chooses, never weighs
    sel    = -inf where the expert is pruned      # expert mask
    group  = sum of the top-2 `sel` in each group; keep the `topk_group` best groups
    idx    = top_k(sel, K)                        # ties: lower expert index first
           = chosen_TK where given                # DeepSeek-V4's hash layers: tid2eid[input_ids]
    g      = s[idx]; g /= sum(g) + 1e-20 if norm_topk_prob; g *= routed_scaling_factor

Pruning is an *array* mask (`expert_mask_E`, True = kept), so a sweep over masks does not recompile.
Masked experts and dropped groups get `-inf`, never 0.0: with negative biases a 0.0 fill lets a
pruned expert win (transformers < 5.24 used 0.0 for dropped groups; DeepSeek's own code uses -inf).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from moejax.errors import ConfigError

SCORING_FUNCS = ("sigmoid", "softmax", "sqrtsoftplus")


@dataclasses.dataclass(frozen=True)
class RouterConfig:
    """Static routing settings (hashable, so it can be a `jit` static argument)."""

    top_k: int
    scoring_func: str = "sigmoid"
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0

    def __post_init__(self):
        if self.scoring_func not in SCORING_FUNCS:
            raise ConfigError(f"scoring_func must be one of {SCORING_FUNCS}, got {self.scoring_func!r}")
        if self.top_k < 1:
            raise ConfigError(f"top_k must be >= 1, got {self.top_k}")
        if self.n_group < 1 or not 1 <= self.topk_group <= self.n_group:
            raise ConfigError(
                f"need 1 <= topk_group <= n_group, got topk_group={self.topk_group}, n_group={self.n_group}")

    def check_experts(self, n_experts: int) -> None:
        """Shape checks that need E: raise before any compute."""
        if n_experts % self.n_group:
            raise ConfigError(f"n_routed_experts={n_experts} is not divisible by n_group={self.n_group}")
        if self.top_k > n_experts:
            raise ConfigError(f"top_k={self.top_k} exceeds the number of experts {n_experts}")
        if self.n_group > 1 and self.top_k > self.topk_group * (n_experts // self.n_group):
            raise ConfigError(
                f"top_k={self.top_k} exceeds the experts in the chosen groups "
                f"({self.topk_group} groups x {n_experts // self.n_group} experts)")

    def fewest_routable(self, mask_E) -> int:
        """The fewest kept experts (mask_E True, a concrete bool [E]) that `route` can let a token
        choose among: every kept one without groups; with group-limited routing, those in the
        `topk_group` groups it gives the token. A group keeping at least 2 (its score sums its two
        best) scores finitely and is preferred; one keeping fewer scores -inf and is chosen only when
        too few groups score finitely, the lower group index first (top-k's ties)."""
        keep = np.asarray(mask_E, bool)
        if self.n_group == 1:
            return int(keep.sum())
        counts = keep.reshape(self.n_group, -1).sum(axis=1)
        need = min(2, keep.size // self.n_group)
        scored = sorted(int(c) for c in counts if c >= need)
        if len(scored) >= self.topk_group:
            return sum(scored[:self.topk_group])  # the groups a token can be given that keep the fewest
        return sum(scored) + sum(int(c) for c in counts[counts < need][:self.topk_group - len(scored)])

    def check_mask(self, mask_E, where: str) -> None:
        """Refuse (before any compute) a pruning mask [E] under which some token would be routed to
        fewer than top_k kept experts: `route` would then fill its top-k with pruned experts
        (with a sigmoid router, at their full gate), a model no checkpoint represents."""
        fewest = self.fewest_routable(mask_E)
        if fewest >= self.top_k:
            return
        kept = int(np.sum(mask_E))
        if self.n_group == 1 or kept < self.top_k:
            raise ConfigError(f"{where}: keeps {kept} experts, below num_experts_per_tok={self.top_k} (every "
                              f"token is routed to {self.top_k} experts)")
        per_group = np.asarray(mask_E, bool).reshape(self.n_group, -1).sum(axis=1).tolist()
        raise ConfigError(
            f"{where}: keeps {per_group} experts per routing group; group-limited routing (n_group={self.n_group}, "
            f"topk_group={self.topk_group}) can give a token groups holding only {fewest} kept experts, below "
            f"num_experts_per_tok={self.top_k} (a group keeping fewer than 2 is chosen last); keep more experts "
            f"per group, e.g. an equal number (group-aware selection)")


class Routing(NamedTuple):
    expert_idx_TK: jax.Array  # int32, the chosen experts of each token (order: best `sel` first)
    gate_TK: jax.Array        # float32, the weights applied to those experts' outputs
    scores_TE: jax.Array      # float32, unbiased sigmoid/softmax/sqrtsoftplus affinities of every expert


def sqrtsoftplus(logits):
    """DeepSeek-V4's affinity sqrt(softplus(x)) (transformers' `SqrtSoftplusActivation`; softplus =
    log(1 + e^x), which torch returns as x itself above x = 20, equal in float32)."""
    return jnp.sqrt(jax.nn.softplus(logits))


def route(logits_TE: jax.Array, cfg: RouterConfig, bias_E: jax.Array | None = None,
          expert_mask_E: jax.Array | None = None, chosen_TK: jax.Array | None = None) -> Routing:
    """Choose `cfg.top_k` experts per token and their gates (SPEC section 1).

    logits_TE: router logits, computed in float32 (`x @ W_router.T`).
    bias_E: `e_score_correction_bias`, added for the choice only. None = zeros.
    expert_mask_E: bool, True = expert kept. None = all kept. Any leading batch axes are
      broadcast against `logits_TE`'s token axis, so one call can route under several masks.
    chosen_TK: the experts each token is given instead of choosing (DeepSeek-V4's `hash_moe` layers:
      `tid2eid[input_ids]`, paper section 2.1); only the gates are computed, from the unbiased scores
      as for a choice (transformers' `DeepseekV4HashRouter`). A mask cannot prune such a layer: its
      table would hand tokens pruned experts, so one given with `chosen_TK` is refused.
    """
    logits_TE = logits_TE.astype(jnp.float32)
    n_experts = logits_TE.shape[-1]
    cfg.check_experts(n_experts)
    if chosen_TK is not None and expert_mask_E is not None:
        raise ConfigError("a hash-routed MoE layer (DeepSeek-V4 hash_moe) takes its experts from its tid2eid table; "
                          "pruning, merging or masking its experts is not implemented")
    keep_E = jnp.ones((n_experts,), bool) if expert_mask_E is None else expert_mask_E.astype(bool)

    if cfg.scoring_func == "sigmoid":
        scores_TE = jax.nn.sigmoid(logits_TE)
    elif cfg.scoring_func == "sqrtsoftplus":
        scores_TE = sqrtsoftplus(logits_TE)
    else:
        # Softmax over the kept experts only, so a mask computes what a physically pruned
        # checkpoint computes (its router has no rows for the pruned experts).
        scores_TE = jax.nn.softmax(jnp.where(keep_E, logits_TE, -jnp.inf), axis=-1)

    if chosen_TK is not None:
        idx_TK = jnp.asarray(chosen_TK).astype(jnp.int32)
        return Routing(idx_TK, gates(scores_TE, idx_TK, cfg), scores_TE)

    sel_TE = scores_TE if bias_E is None else scores_TE + bias_E.astype(jnp.float32)
    sel_TE = jnp.where(keep_E, sel_TE, -jnp.inf)
    if cfg.n_group > 1:
        sel_TE = _mask_to_best_groups(sel_TE, cfg.n_group, cfg.topk_group)

    _, idx_TK = jax.lax.top_k(sel_TE, cfg.top_k)  # stable: equal values -> lower index first
    return Routing(idx_TK.astype(jnp.int32), gates(scores_TE, idx_TK, cfg), scores_TE)


def gates(scores_TE: jax.Array, expert_idx_TK: jax.Array, cfg: RouterConfig) -> jax.Array:
    """The chosen experts' weights: their unbiased scores, renormalised (`norm_topk_prob`) and scaled.
    Leading axes of `expert_idx_TK` beyond the scores' (e.g. pruning variants) are broadcast."""
    scores_TE = jnp.broadcast_to(scores_TE, expert_idx_TK.shape[:-1] + scores_TE.shape[-1:])
    gate_TK = jnp.take_along_axis(scores_TE, expert_idx_TK, axis=-1)
    if cfg.norm_topk_prob:
        gate_TK = gate_TK / (jnp.sum(gate_TK, axis=-1, keepdims=True) + 1e-20)
    return gate_TK * cfg.routed_scaling_factor


def _mask_to_best_groups(sel_TE: jax.Array, n_group: int, topk_group: int) -> jax.Array:
    """Group-limited choice: a group's score is the sum of its two best `sel`; experts outside
    the `topk_group` best groups get -inf. (A group with fewer than two kept experts scores -inf.)"""
    *lead, n_experts = sel_TE.shape
    sel_by_group = sel_TE.reshape(*lead, n_group, n_experts // n_group)  # [T, G, E // G]
    top2 = jax.lax.top_k(sel_by_group, min(2, sel_by_group.shape[-1]))[0]
    group_score_TG = jnp.sum(top2, axis=-1)
    _, best_groups = jax.lax.top_k(group_score_TG, topk_group)
    chosen_TG = jnp.any(jax.nn.one_hot(best_groups, n_group, dtype=bool), axis=-2)
    return jnp.where(chosen_TG[..., None], sel_by_group, -jnp.inf).reshape(sel_TE.shape)


def routing_counts(expert_idx_TK: jax.Array, n_experts: int, token_mask_T: jax.Array | None = None) -> jax.Array:
    """How many tokens chose each expert (int32 [E]); padding tokens (mask False) excluded."""
    onehot = jax.nn.one_hot(expert_idx_TK, n_experts, dtype=jnp.int32).sum(axis=-2)  # [T, E]
    if token_mask_T is not None:
        onehot = onehot * token_mask_T[:, None].astype(jnp.int32)
    return onehot.sum(axis=0)
