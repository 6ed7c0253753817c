"""Training the model: the next-token loss, DeepSeek-V3's sequence-wise balance loss, the AdamW
optimizer and its schedule, the compiled training step (with the balance bias update) and
held-out evaluation, and `Trainer`, which holds the model and optimizer state they step."""

from __future__ import annotations

import functools

import numpy as np

from moejax.hf.auto import AutoModelForCausalLM
from moejax.training.config import TrainTinyConfig


def next_token_loss(logits_BSV, ids_BS):
    """Mean next-token cross-entropy in float32 over positions 0..S-2 (predicting 1..S-1)."""
    from moejax.inference.nll import next_token_nll

    return next_token_nll(logits_BSV, ids_BS).mean()


def sequence_balance_loss(routing, n_experts: int, top_k: int, batch: int):
    """DeepSeek-V3's sequence-wise balance loss sum_e f_e P_e, averaged over sequences:
    f_e = E / (K S) * #{t: e chosen}, P_e = mean_t s_te / sum_e' s_te' (unbiased affinities)."""
    import jax
    import jax.numpy as jnp

    idx = routing.expert_idx_TK.reshape(batch, -1, top_k)
    s = routing.scores_TE.reshape(batch, -1, n_experts)
    counts = jax.nn.one_hot(idx, n_experts, dtype=jnp.float32).sum(axis=(1, 2))          # [B, E]
    f = counts * n_experts / (top_k * idx.shape[1])
    p = (s / (s.sum(-1, keepdims=True) + 1e-20)).mean(axis=1)
    return (f * p).sum(-1).mean()


def make_optimizer(cfg: TrainTinyConfig):
    """(optax transformation, learning-rate schedule): linear warmup to `lr`, cosine decay to
    `lr * min_lr_ratio` at `decay_steps` (default: `steps`), AdamW (decay on matrices only), clipping.
    One object per distinct setting, so equal settings give equal graph definitions and the
    compiled step is reused (`_compiled`)."""
    t = cfg.train
    decay = t.decay_steps if t.decay_steps is not None else t.steps
    return _optimizer(t.lr, t.min_lr_ratio, t.warmup_steps, max(decay, t.warmup_steps + 1), t.weight_decay,
                      t.b1, t.b2, t.clip_norm)


@functools.lru_cache(maxsize=16)
def _optimizer(lr, min_lr_ratio, warmup_steps, decay_steps, weight_decay, b1, b2, clip_norm):
    import jax
    import optax

    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, warmup_steps, decay_steps, lr * min_lr_ratio)
    matrices = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)  # noqa: E731  no decay on norms
    tx = optax.chain(optax.clip_by_global_norm(clip_norm),
                     optax.adamw(schedule, b1=b1, b2=b2, weight_decay=weight_decay, mask=matrices))
    return tx, schedule


def training_losses(E: int, K: int, alpha: float):
    """losses(model, ids_bS) -> (loss, (ce, loads)): the loss training minimises (next-token
    cross-entropy, plus alpha times the balance loss of every MoE layer when alpha > 0), the
    cross-entropy alone, and each MoE layer's expert loads {layer: [E]} of the batch."""
    from moejax.moe.routing import routing_counts

    def losses(model, ids_bS):
        logits, routing, _ = model(ids_bS, return_routing=True)
        ce = next_token_loss(logits, ids_bS)
        loss = ce
        if alpha > 0:
            loss = loss + alpha * sum(sequence_balance_loss(r, E, K, ids_bS.shape[0]) for r in routing.values())
        loads = {l: routing_counts(r.expert_idx_TK, E) for l, r in routing.items()}
        return loss, (ce, loads)

    return losses


def batch_gradients(losses, model, ids_BS, micro_batches: int = 1):
    """((ce, loads), grads) of `losses` (training_losses) on the batch, the gradients with respect
    to the model's Params.

    micro_batches M > 1: the batch as M slices of B / M sequences, one after another (`lax.scan`),
    the gradient and cross-entropy their mean and the loads their sum. The loss is a mean over
    sequences (the balance loss too), so this is the whole batch's gradient summed in another
    order, with a working set M times smaller: faster on a CPU whose caches the whole batch's
    activations overflow (docs/benchmarks.md)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    gdef, params, rest = nnx.split(model, nnx.Param, ...)
    grad_fn = jax.value_and_grad(lambda p, ids: losses(nnx.merge(gdef, p, rest), ids), has_aux=True)
    M = micro_batches
    if M == 1:
        (_, aux), grads = grad_fn(params, ids_BS)
        return aux, grads
    slices = ids_BS.reshape(M, ids_BS.shape[0] // M, *ids_BS.shape[1:])

    def add_slice(total, ids_bS):
        (_, aux), grads = grad_fn(params, ids_bS)
        return jax.tree.map(jnp.add, total, (aux, grads)), None

    (_, aux), grads = jax.eval_shape(grad_fn, params, slices[0])
    zero = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), (aux, grads))
    ((ce, loads), grads), _ = jax.lax.scan(add_slice, zero, slices)
    return (ce / M, loads), jax.tree.map(lambda g: g / M, grads)


@functools.lru_cache(maxsize=8)
def _compiled(graphdef, E: int, K: int, rate: float, alpha: float, has_bias: bool, micro_batches: int):
    """The jitted training step and held-out evaluation for one graph definition (cached: a second
    run with the same settings in the same process compiles nothing)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from moejax.moe.balancing import bias_step
    from moejax.moe.routing import routing_counts
    from moejax.inference.nll import next_token_nll

    losses = training_losses(E, K, alpha)

    def step(state, ids_BS):
        model, optimizer = nnx.merge(graphdef, state)
        (ce, loads), grads = batch_gradients(losses, model, ids_BS, micro_batches)
        optimizer.update(model, grads)
        shares = []
        for l, load in loads.items():
            load = load.astype(jnp.float32)
            if has_bias:  # auxiliary-loss-free balancing (DeepSeek-V3 section 2.1.2)
                bias = model.model.layers[l].mlp.bias
                bias[...] = bias_step(bias[...], load, rate)
            shares.append(load.max() / load.sum())
        return nnx.state((model, optimizer)), {"loss": ce, "max_load_share": jnp.mean(jnp.stack(shares))}

    def evaluate(state, ids_BS):
        model, _ = nnx.merge(graphdef, state)
        logits, routing, _ = model(ids_BS, return_routing=True)
        nll = next_token_nll(logits, ids_BS).sum()
        return nll, {l: routing_counts(r.expert_idx_TK, E) for l, r in routing.items()}

    return jax.jit(step, donate_argnums=0), jax.jit(evaluate)


class Trainer:
    """The model, its optimizer and the jitted step, as one split (graphdef, state) pair."""

    def __init__(self, cfg: TrainTinyConfig):
        import jax
        import jax.numpy as jnp
        from flax import nnx

        self.cfg = cfg
        self.model_cfg = cfg.model_config()
        key = jax.random.key(cfg.seed, impl=cfg.train.rng_impl)
        model = AutoModelForCausalLM.from_config(self.model_cfg, jnp.float32, rngs=nnx.Rngs(key))
        tx, self.schedule = make_optimizer(cfg)
        optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)   # BalanceBias is not a Param: untouched
        self.graphdef, state = nnx.split((model, optimizer))
        # committed to one device, as restored and stepped states are: one compiled step serves all
        self.state = jax.device_put(state, jax.devices()[0])
        self.step, self._evaluate = _compiled(self.graphdef, self.model_cfg.n_experts,
                                              self.model_cfg.num_experts_per_tok, cfg.train.bias_update_rate,
                                              cfg.balance_loss_alpha, self.model_cfg.HAS_BALANCE_BIAS,
                                              cfg.train.micro_batches)

    @property
    def model(self):
        from flax import nnx

        return nnx.merge(self.graphdef, self.state)[0]

    def heldout(self, ids_BS: np.ndarray) -> tuple[float, dict]:
        """(mean next-token loss over every held-out prediction, {layer: expert loads})."""
        bs = self.cfg.train.eval_batch_size
        total, loads = 0.0, {}
        for i in range(0, len(ids_BS), bs):
            chunk = ids_BS[i:i + bs]
            nll, counts = self._evaluate(self.state, chunk)
            total += float(nll)
            for l, c in counts.items():
                loads[l] = loads.get(l, 0) + np.asarray(c, np.int64)
        return total / (ids_BS.shape[0] * (ids_BS.shape[1] - 1)), loads

    # --- the state as a pure dict, which moejax.training.checkpoints saves and restores -------
    def pure_state(self):
        from flax import nnx

        return nnx.to_pure_dict(self.state)

    def load_pure_state(self, pure) -> None:
        from flax import nnx

        nnx.replace_by_pure_dict(self.state, pure)
