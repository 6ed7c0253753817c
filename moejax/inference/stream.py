"""The layer-streamed executor: run tokens through a checkpoint one decoder layer at a time,
reading that layer's weights, carrying every batch's hidden states to the next layer, then
dropping the weights. The whole model is never in memory: at most the embedding table (first)
or one decoder layer, plus the hidden states.

    for layer, moe, router_inputs in stream_layers(checkpoint_path, batches): ...
"""

from __future__ import annotations

import functools
import sys
from typing import Iterator, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm
from flax import nnx

from moejax.errors import CheckpointError
from moejax.hf.model_io import OpenCheckpoint, open_checkpoint
from moejax.inference.agreement import agreement_init, agreement_update
from moejax.inference.nll import chunked_logsumexp, chunked_nll, chunked_nll_init, chunked_nll_update
from moejax.models.layers import causal_allowed, linear, rms_norm


@functools.partial(jax.jit, static_argnums=0)
def _layer_forward(graphdef, state, x, cos, sin, allowed_BSS, carry, ids_BS):
    out = nnx.merge(graphdef, state)(x, cos, sin, allowed_BSS, carry=carry, ids_BS=ids_BS)
    return out.out_BSH, out.z_BSH, out.carry


@functools.partial(jax.jit, static_argnums=0)
def _layer_attend(graphdef, state, x_BSH, cos, sin, allowed_BSS, carry):
    return nnx.merge(graphdef, state).attend(x_BSH, cos, sin, allowed_BSS, carry)


@functools.partial(jax.jit, static_argnums=0)
def _layer_feed(graphdef, state, attended, variant, ids_BS):
    return nnx.merge(graphdef, state).feed(attended, variant, forward_only=True, ids_BS=ids_BS).out_BSH


def batch_geometry(ckpt: OpenCheckpoint, ids_BS, mask_BS, dtype, shift: int = 0):
    """(cos, sin, allowed [B, S', S']) of one batch: the family's rope tables and the causal (and
    padding) mask. shift: of the tokens shift .. S - 1 only, at their positions (S' = S - shift: an
    MTP depth, whose position ids transformers' MTP model shifts so)."""
    B, S = np.asarray(ids_BS).shape
    cos, sin = ckpt.family.causal_lm().rope_tables(ckpt.config, jnp.arange(shift, S), jnp.dtype(dtype))
    return cos, sin, causal_allowed(None if mask_BS is None else np.asarray(mask_BS)[:, shift:], B, S - shift)


VOCAB_CHUNK = 8192  # rows of the embedding table or output head read at a time (64 MB of float32 at H=2048)


def vocab_chunks(vocab_size: int, chunk: int | None = None):
    """[start, stop) row ranges covering a vocabulary, `VOCAB_CHUNK` rows each by default."""
    chunk = chunk or VOCAB_CHUNK
    return [(v0, min(v0 + chunk, vocab_size)) for v0 in range(0, vocab_size, chunk)]


@jax.jit
def _nll_chunk(x_ABSH, head_VH, ids_BS, start, state):
    """Fold vocabulary rows [start, start + C) of the output head into each stream's running
    next-token log-sum-exp (`moejax.inference.nll.chunked_nll_update`); x is already final-normed."""
    def one(args):
        x, st = args
        return chunked_nll_update(st, linear(x[:, :-1], head_VH.T), ids_BS[:, 1:], start)
    return jax.lax.map(one, (x_ABSH, state))


@functools.partial(jax.jit, static_argnums=(3, 4))
def _final_norm(x_ABSH, norm_H, eps, scale_in_float32: bool, plus_one: bool):
    """The model's final RMSNorm in the family's order of operations (`RMSNorm.of`)."""
    return rms_norm(x_ABSH, norm_H, eps, scale_in_float32, plus_one)


@functools.partial(jax.jit, static_argnums=(0, 3))
def _exit(graphdef, state, x, lead: int):
    """The family's exit block (`CausalLM.exit_block`) on residuals [*lead axes, B, S, ...]: the
    leading axes (the carried pass's streams) folded into the batch."""
    shape = x.shape
    y = nnx.merge(graphdef, state)(x.reshape((-1,) + shape[lead + 1:]))
    return y.reshape(shape[:lead + 2] + y.shape[2:])


def final_norm(ckpt: OpenCheckpoint, dtype, lead: int = 0):
    """The model's final norm as a function of the last layer's residuals [*lead axes, B, S, ...]
    (its weights read once): the family's exit block first where it has one (DeepSeek-V4's
    hyper-connection head, `CausalLM.exit_block`), giving [..., B, S, H]."""
    cfg = ckpt.config
    norm_H = jnp.asarray(ckpt.read_param_tensor(head_specs(ckpt)[0], jnp.dtype(dtype)))
    block = ckpt.exit_block(dtype)
    graphdef, state = (None, None) if block is None else nnx.split(block)

    def normed(x):
        x = x if block is None else _exit(graphdef, state, x, lead)
        return _final_norm(x, norm_H, cfg.rms_norm_eps, cfg.NORM_SCALES_IN_FLOAT32, cfg.NORM_PLUS_ONE)
    return normed


def head_specs(ckpt: OpenCheckpoint):
    """(the final norm's spec, the output head's: lm_head, or the embedding table when tied; both
    [V, H] on disk)."""
    by_param = {s.param: s for s in ckpt.specs}
    return by_param["model.norm.weight"], by_param.get("lm_head", by_param["model.embed_tokens"])


class HeadOutputs(NamedTuple):
    """What the output head gives on A streams of the same held-out ids, per text and batch, each
    [A, B, S - 1] over the positions that predict a next token: the NLL (float64); with agreement,
    each stream against stream 0 (the unpruned one, `moejax.inference.agreement`): ESAP, KL(stream
    0 || stream) and whether the two argmaxes agree."""
    nll: dict
    esap: dict | None = None
    kl: dict | None = None
    top1: dict | None = None


@jax.jit
def _agreement_chunk(x_ABSH, head_VH, lse_ABT, start, state):
    """Fold vocabulary rows [start, start + C) into each stream's agreement sums against stream 0."""
    ref_logp = linear(x_ABSH[0, :, :-1], head_VH.T).astype(jnp.float32) - lse_ABT[0][..., None]

    def one(args):
        x, lse, st = args
        return agreement_update(st, linear(x[:, :-1], head_VH.T), lse, ref_logp, start)
    return jax.lax.map(one, (x_ABSH, lse_ABT, state))


def head_pass(ckpt: OpenCheckpoint, xs: dict, ids: dict, dtype, agreement: bool = False) -> HeadOutputs:
    """The final norm and the output head on hidden states after the last decoder layer (xs: text
    -> per batch [A, B, S, H], A streams of the same ids; ids: text -> per batch [B, S]): the norm
    (xs are replaced by their normed states, in place: the carried streams are not needed after
    it), then the head read a vocabulary chunk at a time (`vocab_chunks`) and folded into each
    token's running log-sum-exp, never held whole (Moonlight's is 1.3 GB in float32) and never
    turned into a [tokens, V] logits array: the model's output end, as `embed` is its input end.
    agreement: a second pass over the chunks gives each stream's agreement with stream 0
    (`HeadOutputs`)."""
    cfg = ckpt.config
    _, head_spec = head_specs(ckpt)
    normed = final_norm(ckpt, dtype, lead=1)
    state = {}
    for text, batches in xs.items():
        for b, x in enumerate(batches):
            batches[b] = normed(x)
        state[text] = [chunked_nll_init((x.shape[0], i.shape[0], i.shape[1] - 1)) for x, i in zip(batches, ids[text])]
    for v0, v1 in vocab_chunks(cfg.vocab_size):
        head_VH = jnp.asarray(ckpt.read_rows(head_spec, v0, v1, jnp.dtype(dtype)))
        for text, batches in xs.items():
            state[text] = [_nll_chunk(x, head_VH, jnp.asarray(i), v0, st)
                           for x, i, st in zip(batches, ids[text], state[text])]
        jax.block_until_ready(state)  # one head chunk in memory at a time
    nll = {text: [np.asarray(chunked_nll(st), np.float64) for st in states] for text, states in state.items()}
    if not agreement:
        return HeadOutputs(nll)
    lse = {text: [chunked_logsumexp(st) for st in states] for text, states in state.items()}
    sums = {text: [agreement_init(l.shape) for l in ls] for text, ls in lse.items()}
    for v0, v1 in vocab_chunks(cfg.vocab_size):
        head_VH = jnp.asarray(ckpt.read_rows(head_spec, v0, v1, jnp.dtype(dtype)))
        for text, batches in xs.items():
            sums[text] = [_agreement_chunk(x, head_VH, l, v0, st) for x, l, st in zip(batches, lse[text], sums[text])]
        jax.block_until_ready(sums)

    def each(k, as_type):
        return {text: [np.asarray(st[k]).astype(as_type) for st in states] for text, states in sums.items()}

    args = each(3, np.int64)
    top1 = {text: [a == a[:1] for a in per_batch] for text, per_batch in args.items()}
    return HeadOutputs(nll, each(0, np.float64), each(1, np.float64), top1)


def embed(ckpt: OpenCheckpoint, batches_of_ids, dtype, entry: bool = True) -> list:
    """The decoder's input residual of each batch of token ids in `dtype`: the embedding rows
    [B, S, H] as the family's `CausalLM.entry` makes them the residual (DeepSeek-V4: its
    hyper-connection streams [B, S, W, H]; entry=False: the rows themselves). The table is read a
    vocabulary chunk at a time (`VOCAB_CHUNK` rows), keeping only the rows the data uses, so it is
    never held whole (Moonlight's 163,840 x 2,048 table is 0.7 GB in bfloat16); a NaN or infinity
    in a row the data uses is refused naming the token ids."""
    (spec,) = [s for s in ckpt.specs if s.param == "model.embed_tokens"]
    ids = [np.asarray(b) for b in batches_of_ids]
    used = np.unique(np.concatenate([b.ravel() for b in ids])) if ids else np.zeros((0,), np.int64)
    info = ckpt.reader.info(spec.hf_name)
    if used.size and (used[0] < 0 or used[-1] >= info.shape[0]):
        raise CheckpointError(f"token id(s) {used[(used < 0) | (used >= info.shape[0])][:16].tolist()} outside "
                              f"{spec.hf_name}'s {info.shape[0]} rows")
    rows = None
    for v0, v1 in vocab_chunks(info.shape[0]):
        lo, hi = np.searchsorted(used, [v0, v1])
        if lo == hi:
            continue
        block = ckpt.reader.read_rows(spec.hf_name, v0, v1)
        rows = np.empty((len(used),) + block.shape[1:], block.dtype) if rows is None else rows
        rows[lo:hi] = block[used[lo:hi] - v0]
    bad = used[~np.isfinite(rows.astype(np.float32)).all(axis=1)] if rows is not None else used[:0]
    if bad.size:
        raise CheckpointError(f"{spec.hf_name} in {ckpt.reader.shard_of(spec.hf_name).name}: non-finite values "
                              f"(NaN or inf) in the rows of token id(s) {bad[:16].tolist()}, which the data uses")
    enter = ckpt.family.causal_lm().entry if entry else (lambda cfg, x: x)
    return [enter(ckpt.config, jnp.asarray(rows[np.searchsorted(used, b)].astype(jnp.dtype(dtype)))) for b in ids]


def stream_layers(ckpt: OpenCheckpoint | str, batches, dtype=jnp.float32, progress: bool | None = None,
                  mesh=None, variant_of=None, mtp: bool = False) -> Iterator[tuple[int, object, list]]:
    """Yield (HF layer index, the layer's MoE module, [router inputs [B*S, H] per batch]) for every
    MoE layer, after running all batches through the layers before it.

    batches: list of (input_ids [B, S], attention_mask [B, S] or None). The MoE module is only
    valid until the next item is requested (its weights are dropped then).
    mesh: each layer's routed experts are loaded split over the mesh's expert axis and run with
    the "ep" backend; call this under `jax.set_mesh(mesh)`.
    variant_of: a sequential pass. When the consumer asks for the next item, `variant_of(layer)`
    gives what the MoE layer just yielded computes under on its way to the next layer (an
    ExpertMap, a mask [E] or None: unchanged), so each layer's router inputs come from the model
    as the consumer has changed it up to the layer before.
    mtp: then also the checkpoint's MTP layers (`moejax.models.mtp`: layer num_hidden_layers + j),
    run as inference runs them on the trunk's final-normed last state (through the trunk as the
    consumer changed it, for a sequential pass); MTP depth j's router inputs cover the positions
    1 + j .. S - 1 of each batch ([B * (S - 1 - j), H]: `mtp_rows`)."""
    ckpt = ckpt if isinstance(ckpt, OpenCheckpoint) else open_checkpoint(ckpt)
    cfg = ckpt.config
    show = sys.stderr.isatty() if progress is None else progress
    n_tokens = sum(int(np.asarray(ids).size) for ids, _ in batches)
    hidden = embed(ckpt, [ids for ids, _ in batches], dtype)
    token_ids = [jnp.asarray(ids) for ids, _ in batches]   # a hash-routed layer's (DeepSeek-V4) choice
    geometry = [batch_geometry(ckpt, ids, mask, dtype) for ids, mask in batches]
    backend = "ep" if mesh is not None else "sorted"
    carries = [None] * len(batches)   # what each batch's attention hands on (`DecoderLayer.attend`)
    for layer_idx in tqdm(range(cfg.num_hidden_layers), desc=f"layers ({n_tokens} tokens)", unit="layer",
                          disable=not show):
        layer = ckpt.decoder_layer(layer_idx, dtype, backend, mesh)
        hidden, carries = yield from _through_layer(layer_idx, layer, hidden, carries, geometry, variant_of, token_ids,
                                                    not cfg.is_kept_whole(layer_idx))
        del layer  # before the next layer's weights are read
    mtp_layers = ckpt.mtp_layers() if mtp else []
    if not mtp_layers:
        return
    state = [final_norm(ckpt, dtype)(h) for h in hidden]
    del hidden
    for depth, layer_idx in enumerate(mtp_layers):
        shift = depth + 1  # depth j sees the tokens t + 1 + j at positions 1 + j .. S - 1
        predictor = nnx.split(ckpt.mtp_predictor(layer_idx, dtype))
        embedded = embed(ckpt, [np.asarray(ids)[:, shift:] for ids, _ in batches], dtype, entry=False)
        hidden = [_mtp_input(*predictor, e, h[:, :-1]) for e, h in zip(embedded, state)]
        del embedded
        geometry = [batch_geometry(ckpt, ids, mask, dtype, shift) for ids, mask in batches]
        layer = ckpt.decoder_layer(layer_idx, dtype, backend, mesh)
        hidden, _ = yield from _through_layer(layer_idx, layer, hidden, [None] * len(batches), geometry, variant_of,
                                              [t[:, shift:] for t in token_ids])
        state = [_mtp_state(*predictor, h) for h in hidden]


def _through_layer(layer_idx: int, layer, hidden: list, carries: list, geometry: list, variant_of, token_ids: list,
                   scored: bool = True):
    """Every batch's residual (and what the attentions before handed on, `carries`) through one
    decoder layer, yielding its MoE layer's router inputs on the way (`stream_layers`); returns
    both after it. token_ids: each batch's [B, S], which a hash-routed layer chooses by. scored:
    False for a MoE layer kept whole (`MoeConfig.is_kept_whole`), which is run, not yielded."""
    graphdef, state = nnx.split(layer)
    router_inputs, carries = [], list(carries)
    yields = layer.is_moe and scored
    if variant_of is None or not yields:
        for b, (cos, sin, allowed) in enumerate(geometry):
            hidden[b], z, carries[b] = _layer_forward(graphdef, state, hidden[b], cos, sin, allowed, carries[b],
                                                      token_ids[b])
            router_inputs.append(z.reshape(-1, z.shape[-1]))
        if yields:
            yield layer_idx, layer.mlp, router_inputs
        return hidden, carries
    # the MLP half after the consumer has decided the layer
    attended = [_layer_attend(graphdef, state, x, *geo, c) for x, geo, c in zip(hidden, geometry, carries)]
    yield layer_idx, layer.mlp, [a.z_BSH.reshape(-1, a.z_BSH.shape[-1]) for a in attended]
    variant = variant_of(layer_idx)
    return ([_layer_feed(graphdef, state, a, variant, t) for a, t in zip(attended, token_ids)],
            [a.carry for a in attended])


def mtp_shift(cfg, layer: int) -> int:
    """How many leading positions of each sequence layer `layer`'s router inputs leave out: 0 for a
    decoder layer, 1 + j for MTP depth j (`stream_layers`)."""
    return max(0, layer - cfg.num_hidden_layers + 1)


def mtp_rows(cfg, layer: int, mask_BS):
    """A batch's attention mask [B, S] (or None) as the rows of layer `layer`'s router inputs."""
    return None if mask_BS is None else np.asarray(mask_BS)[:, mtp_shift(cfg, layer):]


@functools.partial(jax.jit, static_argnums=0)
def _mtp_input(graphdef, state, embedded_BSH, state_BSH):
    return nnx.merge(graphdef, state).block_input(embedded_BSH, state_BSH)


@functools.partial(jax.jit, static_argnums=0)
def _mtp_state(graphdef, state, out_BSH):
    return nnx.merge(graphdef, state).state(out_BSH)
