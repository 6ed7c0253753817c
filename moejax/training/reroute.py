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

Never worse than the input. The last max(1, floor(holdout * N)) of the N calibration sequences
(`RerouteSettings.holdout`, default 10%; deterministic, the tail of the last batches) are held out
of training. The student's KL on them is measured before the first step, every `eval_every` steps
and after the last, and the routers returned are the best seen, the input's included; a later
candidate must beat the best by more than `ROUNDING_KL`, so rounding noise never replaces them.
The result's held-out KL is therefore never above the input's. With a single sequence, or
holdout=0, nothing can be held out: the routers are selected on the training tokens themselves
(`RerouteResult.selection` "training"), never worse on those, with no claim for unseen text.

Training stops early when a step's KL is at rounding level (below `ROUNDING_KL`, float32's
epsilon: what rounding alone of log-probs of order 1 gives). The student then already equals the
teacher on that batch, and the step's update is discarded: Adam would scale gradients of rounding
noise up to full learning-rate steps and flip top-k choices. A student equal to its teacher (a
prune keeping every expert) thus comes back unchanged, bitwise. A teacher log-prob that is not
finite is refused (ConfigError naming the batch); a step whose KL is not finite (diverged) stops
training with the best finite routers kept; the routers returned are checked finite.

    RerouteSettings          steps, learning rate, warmup, final fraction, weight decay, batch,
                             held-out fraction, evaluation interval (`moejax.training.reroute_settings`,
                             JAX-free: the one declaration of its defaults)
    ROUNDING_KL              the KL below which the student equals the teacher to float32 rounding
    router_filter            the nnx filter of every MoE layer's router weights (`MoE.router`)
    trained_filter(config)   the trained ones: router_filter less the layers the family keeps whole
    kl_loss(t_logp, s_logits, valid)   the loss above, float32
    teacher_log_probs(model, batches)  each batch's teacher log-softmax, computed once
    held_out_rows(batches, holdout)    the sequences held out (the last ones)
    improves(kl, best_kl)              whether a measured candidate replaces the routers kept
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
from moejax.training.reroute_settings import RerouteSettings  # noqa: F401 (train_routers' settings)


ROUNDING_KL = float(np.finfo(np.float32).eps)   # 1.19e-7: a KL (nats) float32 rounding of the log-probs alone gives


def router_filter(path, value) -> bool:
    """Every MoE layer's router weights (`MoE.router`, float32 [E, H])."""
    return isinstance(value, nnx.Param) and len(path) > 0 and path[-1] == "router"


def trained_filter(config):
    """The nnx filter of the trained parameters of a model of `config`: every MoE layer's router
    weights but those of the layers the family keeps whole (`MoeConfig.is_kept_whole`: DeepSeek-V4's
    hash layers, whose experts are tid2eid's; their router gives only the chosen experts' gates, and
    those layers stay the source's bytes under every pass, this one included)."""
    return lambda path, value: router_filter(path, value) and not config.is_kept_whole(int(path[2]))


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
    losses: list            # the training KL of every step run, before its update
    seconds: float
    trained: list           # the trained parameters' paths ("model.layers.1.mlp.router", ...)
    heldout_kl_before: float = float("nan")   # the input routers' KL on the selection tokens
    heldout_kl_after: float = float("nan")    # the returned routers' (never above the one before)
    kept_step: int = 0      # the updates in the routers returned (0: the input, unchanged)
    stopped: str | None = None   # "rounding" (KL at rounding level), "diverged" (KL not finite), None (ran all steps)
    selection: str = "heldout"   # "heldout" (sequences never trained on) or "training" (nothing could be held out)
    heldout_sequences: int = 0
    evaluations: list = dataclasses.field(default_factory=list)   # [(updates applied, KL on the selection tokens)]

    @property
    def layers(self) -> list[int]:
        """The MoE layers whose routers were trained (`trained_filter`: those the family does not
        keep whole), from the paths in `trained`."""
        return [int(path.split(".")[2]) for path in self.trained]

    def record(self) -> dict:
        """What a run's record (reroute.json) keeps of the selection (a KL that is not finite as null)."""
        return {"selection": self.selection, "sequences": self.heldout_sequences, "kl_before": self.heldout_kl_before,
                "kl_after": self.heldout_kl_after, "kept_step": self.kept_step, "stopped": self.stopped,
                "evaluations": [[u, kl if np.isfinite(kl) else None] for u, kl in self.evaluations],
                "rounding_kl": ROUNDING_KL}


def improves(kl: float, best_kl: float) -> bool:
    """Whether a candidate's held-out KL replaces the best one: lower by more than ROUNDING_KL, so
    rounding noise never replaces the routers kept (a NaN never does)."""
    return bool(kl < best_kl - ROUNDING_KL)


def held_out_rows(batches: list, holdout: float) -> tuple[list[np.ndarray], int]:
    """([bool [B] per batch: True = the sequence is held out], k): the last k = max(1, floor(holdout *
    N)) of the N sequences (the tail of the last batches), deterministic. k = 0 when holdout is 0
    or N < 2 (a single sequence is trained on: nothing is held out). The batches keep their shapes:
    a held-out row is excluded from the training loss by its validity mask (so it adds exactly 0 to
    the gradient: the forward has no interaction between rows), and a batch whose rows are all held
    out is never trained on."""
    n = sum(len(ids) for ids, _ in batches)
    k = 0 if holdout == 0 or n < 2 else min(n - 1, max(1, int(holdout * n)))
    rows, left = [], k
    for ids, _ in reversed(batches):
        b = len(ids)
        take = min(left, b)
        left -= take
        rows.insert(0, np.arange(b) >= b - take)
    return rows, k


def _valid(ids, mask, rows) -> np.ndarray:
    """bool [B, S]: the positions a loss counts: the batch's mask (every position when None) on `rows`."""
    valid = np.ones(np.shape(ids), bool) if mask is None else np.asarray(mask, bool)
    return valid & np.asarray(rows, bool)[:, None]


def _step_fn(graphdef, optimizer):
    """One AdamW step on the KL over `valid_BS`: (new routers, optimizer state, the KL before the
    update, whether the teacher batch is finite). The routers passed in are not donated: the caller
    keeps them (a step whose KL is at rounding level or not finite has its update discarded)."""
    @functools.partial(jax.jit, donate_argnums=(2,))
    def step(routers, rest, opt_state, ids_BS, mask_BS, valid_BS, teacher_BSV, variant):
        def loss_fn(r):
            logits = nnx.merge(graphdef, r, rest)(ids_BS, mask_BS, variant).logits_BSV
            return kl_loss(teacher_BSV, logits, valid_BS)

        loss, grads = jax.value_and_grad(loss_fn)(routers)
        updates, opt_state = optimizer.update(grads, opt_state, routers)
        return optax.apply_updates(routers, updates), opt_state, loss, jnp.isfinite(teacher_BSV).all()

    return step


def _kl_sum_fn(graphdef):
    """(sum of the KL over `valid_BS`, its count, whether the teacher's valid rows are finite) of the
    student under `routers` on one batch: the held-out measurement (forward only)."""
    @jax.jit
    def kl_sum(routers, rest, ids_BS, mask_BS, valid_BS, teacher_BSV, variant):
        logits = nnx.merge(graphdef, routers, rest)(ids_BS, mask_BS, variant, forward_only=True).logits_BSV
        n = jnp.sum(valid_BS.astype(jnp.float32))
        finite = jnp.all(jnp.isfinite(teacher_BSV) | ~valid_BS[..., None])
        return kl_loss(teacher_BSV, logits, valid_BS) * jnp.maximum(n, 1.0), n, finite

    return kl_sum


def train_routers(model, teacher_logp: list, batches: list, settings: RerouteSettings, variant=None,
                  progress=None) -> tuple[dict, RerouteResult]:
    """({MoE layer: its router weights float32 [E, H]}, the run) for `model` under `variant` (its
    expert maps: a pruned, merged or substituted variant of it, or None). batches: (ids [B, S], mask
    [B, S] or None); teacher_logp: their teacher log-probs [B, S, V]. The last sequences are held
    out (`held_out_rows`); the others train for up to `settings.steps` steps: step i trains the
    i % T-th of the T batches with a sequence to train on, against that batch's own teacher
    log-probs. The routers returned are the best on the held-out tokens of those measured, the
    input's included (the module's docstring: never worse; early stop at rounding level). The model
    itself is left as it was."""
    _check_inputs(teacher_logp, batches, settings)
    graphdef, routers, rest = nnx.split(model, trained_filter(model.config), ...)
    routers = jax.tree.map(jnp.copy, routers)   # trained apart from the model's own
    paths = [path for path, _ in nnx.to_flat_state(routers)]
    if not paths:
        raise ConfigError("reroute: the model has no MoE router to train")
    data = _RerouteData.split(batches, teacher_logp, settings.holdout, _checked(variant, model.config))
    kl_sum = _kl_sum_fn(graphdef)
    optimizer = settings.optimizer()
    opt_state = optimizer.init(routers)
    step = _step_fn(graphdef, optimizer)
    t0 = time.perf_counter()
    best = _BestRouters(functools.partial(_selection_kl, kl_sum, rest, data), routers, data.selection)
    losses, stopped = _train(step, routers, opt_state, rest, data, settings, best, progress)
    trained = _finite_routers(best.routers)
    return trained, RerouteResult(losses, time.perf_counter() - t0, [".".join(map(str, p)) for p in paths],
                                  best.before, best.kl, best.step, stopped, data.selection, data.n_held,
                                  best.evaluations)


def _check_inputs(teacher_logp: list, batches: list, settings: RerouteSettings) -> None:
    """The settings, and one teacher log-prob array [B, S, V] per batch of ids [B, S]."""
    settings.check()
    if len(teacher_logp) != len(batches) or not batches:
        raise ConfigError(f"reroute: {len(batches)} batches and {len(teacher_logp)} teacher log-prob arrays")
    for i, ((ids, _), t) in enumerate(zip(batches, teacher_logp)):
        if np.ndim(t) != 3 or tuple(np.shape(t)[:2]) != tuple(np.shape(ids)):
            raise ConfigError(f"reroute: batch {i}: teacher log-probs {list(np.shape(t))} for ids "
                              f"{list(np.shape(ids))}; "
                              "expected [B, S, V] of the batch's [B, S]")


@dataclasses.dataclass(frozen=True)
class _RerouteData:
    """The batches as training and selection read them: (batch index, validity [B, S]) of the
    training rotation (batches with a sequence to train on, the held-out rows masked out) and of
    the selection measurement (the held-out rows; every row when nothing is held out)."""

    batches: list
    teacher_logp: list
    variant: object
    train: list
    measured: list
    selection: str   # "heldout" | "training"
    n_held: int

    @classmethod
    def split(cls, batches: list, teacher_logp: list, holdout: float, variant) -> _RerouteData:
        held, n_held = held_out_rows(batches, holdout)
        train = [(b, _valid(ids, mask, ~rows)) for b, ((ids, mask), rows) in enumerate(zip(batches, held))
                 if not rows.all()]
        measured = [(b, _valid(ids, mask, rows if n_held else np.ones(len(ids), bool)))
                    for b, ((ids, mask), rows) in enumerate(zip(batches, held)) if rows.any() or not n_held]
        return cls(batches, teacher_logp, variant, train, measured, "heldout" if n_held else "training", n_held)

    def on_device(self, b: int, valid) -> tuple:
        """(ids, mask or None, valid, teacher log-probs) of batch b on the device."""
        ids, mask = self.batches[b]
        return (jnp.asarray(ids), None if mask is None else jnp.asarray(mask, bool), jnp.asarray(valid),
                jnp.asarray(self.teacher_logp[b]))


def _selection_kl(kl_sum, rest, data: _RerouteData, routers) -> float:
    """The student's mean KL under `routers` on the selection tokens; a teacher batch that is not
    finite is refused by name."""
    total, count = 0.0, 0.0
    for b, valid in data.measured:
        s, n, finite = kl_sum(routers, rest, *data.on_device(b, valid), data.variant)
        if not bool(finite):
            raise ConfigError(f"reroute: the teacher log-probs of batch {b} are not finite; expected finite "
                              "log-softmaxes")
        total, count = total + float(s), count + float(n)
    return total / max(count, 1.0)


class _BestRouters:
    """The routers kept: the input's (measured first, refused when not finite), replaced by a
    candidate only when it `improves` on them; every measurement is recorded."""

    def __init__(self, measure, routers, selection: str):
        self.measure = measure
        self.routers, self.kl, self.step = routers, measure(routers), 0
        self.before, self.evaluations = self.kl, [(0, self.kl)]
        if not np.isfinite(self.before):
            raise ConfigError(f"reroute: the input student's KL on the {selection} tokens is {self.before}; "
                              "expected a finite number (a non-finite weight in the student?)")

    def consider(self, routers, updates: int) -> None:
        kl = self.measure(routers)
        self.evaluations.append((updates, kl))
        if improves(kl, self.kl):
            self.routers, self.kl, self.step = routers, kl, updates


def _train(step, routers, opt_state, rest, data: _RerouteData, settings: RerouteSettings, best: _BestRouters,
           progress) -> tuple[list, str | None]:
    """Up to settings.steps steps over the training rotation, a candidate measured every
    eval_every steps and after the last; (the training KL of every step run, why it stopped early:
    "rounding", "diverged" or None), the stopped step's update discarded."""
    losses, stopped = [], None
    for i in range(settings.steps):
        b, valid = data.train[i % len(data.train)]
        previous = routers
        routers, opt_state, loss, finite = step(previous, rest, opt_state, *data.on_device(b, valid), data.variant)
        if not bool(finite):
            raise ConfigError(f"reroute: the teacher log-probs of batch {b} are not finite; expected finite "
                              "log-softmaxes")
        losses.append(float(loss))
        if progress is not None:
            progress(i, losses[-1])
        if not np.isfinite(losses[-1]) or losses[-1] < ROUNDING_KL:
            # this step's update is rounding noise or garbage (diverged): the routers before it are the candidate
            stopped = "rounding" if np.isfinite(losses[-1]) else "diverged"
            if best.evaluations[-1][0] != i:
                best.consider(previous, i)
            break
        if (i + 1) % settings.eval_every == 0 or i + 1 == settings.steps:
            best.consider(routers, i + 1)
    return losses, stopped


def _finite_routers(routers) -> dict:
    """{MoE layer: router float32 [E, H]} of the routers kept, refused when one is not finite."""
    trained = {int(path[2]): np.asarray(v[...], np.float32) for path, v in nnx.to_flat_state(routers)}
    for layer, router in trained.items():
        if not np.isfinite(router).all():
            raise ConfigError(f"reroute: layer {layer}'s router is not finite after training; nothing kept")
    return trained


def reroute(student, teacher_logp: list, batches: list, settings: RerouteSettings, variant=None,
            progress=None) -> RerouteResult:
    """`train_routers`, then the student's routers replaced by the ones it returns (in place; the
    input's own when none was better on the held-out tokens); every other parameter is left
    bitwise as it was."""
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
