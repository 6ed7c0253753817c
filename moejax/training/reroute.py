"""Router distillation (arXiv 2603.02217): after pruning, merging or substitution, retrain only each
MoE layer's router so that the compressed model's next-token distribution matches the original's.

    loss(theta) = (1 / N) sum_{t valid} KL(p_t || q_t(theta))
                = (1 / N) sum_t sum_v p_t[v] (log p_t[v] - log q_t[v](theta))

p_t the teacher's (the original checkpoint's) next-token distribution at position t, q_t the
student's (the compressed checkpoint's) under its router weights theta, N the valid (non-padding)
positions of the batch; both log-softmaxes in float32. Only the router weights W_router [E, H] of
every MoE layer are trained (AdamW, linear warmup then cosine decay, `optax`); every other weight,
the balance bias included, stays as it is: the bias enters only the top-k choice, a piecewise
constant function of it, so its gradient is exactly zero, and the paper trains the router
weights only.

    RerouteSettings          steps, learning rate, warmup, final fraction, weight decay, batch
    router_filter            the nnx filter of the trained parameters (`MoE.router`)
    kl_loss(t_logp, s_logits, valid)   the loss above, float32
    teacher_log_probs(model, batches)  each batch's teacher log-softmax, computed once
    train_routers(model, teacher_logp, batches, settings, variant) -> ({layer: router [E, H]}, RerouteResult)
    reroute(student, ...)    the same, the student's routers replaced in place
    rerouted_maps(maps, trained)   a variant's expert maps routing by trained routers (ExpertMap.router_EH)

Pure JAX and optax; `moejax.surgery.reroute` is the command around it (checkpoints in and out).
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from moejax.errors import ConfigError
from moejax.models.causal_lm import _checked
from moejax.moe.expert_map import ExpertMap


@dataclasses.dataclass(frozen=True)
class RerouteSettings:
    steps: int = 200
    lr: float = 1e-3
    warmup: int = 10               # linear warmup steps (0: none)
    final_lr_fraction: float = 0.1  # the cosine decays to lr * this at the last step
    weight_decay: float = 0.0      # AdamW's decoupled decay (0: plain Adam), on the router weights
    batch_size: int = 8            # sequences per step

    def check(self) -> "RerouteSettings":
        """Refused before any work, naming the setting."""
        def integer(name, low):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < low:
                raise ConfigError(f"reroute: {name}={v!r}; expected an integer >= {low}")

        integer("steps", 1)
        integer("warmup", 0)
        integer("batch_size", 1)
        if self.warmup >= self.steps and self.warmup:
            raise ConfigError(f"reroute: warmup={self.warmup} must be below steps={self.steps}")
        for name, low, high in (("lr", 0.0, 1.0), ("final_lr_fraction", 0.0, 1.0), ("weight_decay", 0.0, 1.0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not np.isfinite(v) or not low <= v <= high \
                    or (name == "lr" and v == 0):
                raise ConfigError(f"reroute: {name}={v!r}; expected a number in {'(' if name == 'lr' else '['}"
                                  f"{low}, {high}]")
        return self

    def schedule(self):
        """Linear warmup from 0 to lr over `warmup` steps, then a cosine to lr * final_lr_fraction."""
        return optax.warmup_cosine_decay_schedule(0.0, self.lr, self.warmup, self.steps,
                                                  self.lr * self.final_lr_fraction)

    def optimizer(self) -> optax.GradientTransformation:
        return optax.adamw(self.schedule(), weight_decay=self.weight_decay)


def router_filter(path, value) -> bool:
    """The trained parameters: every MoE layer's router weights (`MoE.router`, float32 [E, H])."""
    return isinstance(value, nnx.Param) and len(path) > 0 and path[-1] == "router"


def kl_loss(teacher_logp_BSV, student_logits_BSV, valid_BS) -> jax.Array:
    """(1/N) sum over valid positions of KL(p || q), p = exp(teacher log-probs), q = softmax of the
    student's logits, float32; N = the number of valid positions."""
    t = teacher_logp_BSV.astype(jnp.float32)
    s = jax.nn.log_softmax(student_logits_BSV.astype(jnp.float32), axis=-1)
    kl_BS = jnp.sum(jnp.exp(t) * (t - s), axis=-1)
    valid = valid_BS.astype(jnp.float32)
    return jnp.sum(kl_BS * valid) / jnp.maximum(jnp.sum(valid), 1.0)


def teacher_log_probs(model, batches, variant=None) -> list[np.ndarray]:
    """Each batch's next-token log-softmax [B, S, V] under `model` (float32 on the host), computed
    once: the teacher does not change while the student trains."""
    forward = model.jitted()
    out = []
    for ids, mask in batches:
        logits = forward(jnp.asarray(ids), None if mask is None else jnp.asarray(mask), variant).logits_BSV
        out.append(np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)))
    return out


@dataclasses.dataclass
class RerouteResult:
    losses: list            # the loss of every step, before its update
    seconds: float
    trained: list           # the trained parameters' paths ("model.layers.1.mlp.router", ...)


def _step_fn(graphdef, optimizer):
    @functools.partial(jax.jit, donate_argnums=(0, 2))
    def step(routers, rest, opt_state, ids_BS, mask_BS, teacher_BSV, variant):
        def loss_fn(r):
            model = nnx.merge(graphdef, r, rest)
            logits = model(ids_BS, mask_BS, variant).logits_BSV
            return kl_loss(teacher_BSV, logits, jnp.ones(ids_BS.shape, bool) if mask_BS is None else mask_BS)

        loss, grads = jax.value_and_grad(loss_fn)(routers)
        updates, opt_state = optimizer.update(grads, opt_state, routers)
        return optax.apply_updates(routers, updates), opt_state, loss

    return step


def train_routers(model, teacher_logp: list, batches: list, settings: RerouteSettings, variant=None,
                  progress=None) -> tuple[dict, RerouteResult]:
    """({MoE layer: its trained router weights float32 [E, H]}, the run) for `model` under `variant`
    (its expert maps: a pruned, merged or substituted variant of it, or None), trained for
    `settings.steps` steps, batch i % len(batches) at step i (batches: (ids [B, S], mask [B, S] or
    None); teacher_logp: their teacher log-probs). The model itself is left as it was."""
    settings.check()
    if len(teacher_logp) != len(batches) or not batches:
        raise ConfigError(f"reroute: {len(batches)} batches and {len(teacher_logp)} teacher log-prob arrays")
    graphdef, routers, rest = nnx.split(model, router_filter, ...)
    routers = jax.tree.map(jnp.copy, routers)   # trained (and donated) apart from the model's own
    paths = [path for path, _ in nnx.to_flat_state(routers)]
    if not paths:
        raise ConfigError("reroute: the model has no MoE router to train")
    variant = _checked(variant, model.config)
    optimizer = settings.optimizer()
    opt_state = optimizer.init(routers)
    step = _step_fn(graphdef, optimizer)
    losses, t0 = [], time.perf_counter()
    for i in range(settings.steps):
        ids, mask = batches[i % len(batches)]
        routers, opt_state, loss = step(routers, rest, opt_state, jnp.asarray(ids),
                                        None if mask is None else jnp.asarray(mask, bool),
                                        jnp.asarray(teacher_logp[i % len(batches)]), variant)
        losses.append(float(loss))
        if progress is not None:
            progress(i, losses[-1])
    trained = {int(path[2]): np.asarray(v[...], np.float32) for path, v in nnx.to_flat_state(routers)}
    return trained, RerouteResult(losses, time.perf_counter() - t0, [".".join(map(str, p)) for p in paths])


def reroute(student, teacher_logp: list, batches: list, settings: RerouteSettings, variant=None,
            progress=None) -> RerouteResult:
    """`train_routers`, then the student's routers replaced by the trained ones (in place); every
    other parameter is left bitwise as it was."""
    trained, result = train_routers(student, teacher_logp, batches, settings, variant, progress)
    for layer, router in trained.items():
        student.model.layers[layer].mlp.router[...] = jnp.asarray(router)
    return result


def rerouted_maps(maps: dict | None, trained: dict) -> dict:
    """A variant's expert maps with each MoE layer routing by its trained router weights
    (`ExpertMap.router_EH`); a layer the variant leaves whole gets a map of every slot."""
    maps = dict(maps or {})
    return {layer: (maps[layer] if layer in maps else ExpertMap(jnp.ones(router.shape[0], bool)))._replace(
        router_EH=jnp.asarray(router, jnp.float32)) for layer, router in trained.items()}
