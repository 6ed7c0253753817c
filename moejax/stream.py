"""The layer-streamed executor: run tokens through a checkpoint one decoder layer at a time,
reading that layer's weights, carrying every batch's hidden states to the next layer, then
dropping the weights. The whole model is never in memory: at most the embedding table (first)
or one decoder layer, plus the hidden states.

    for layer, moe, router_inputs in stream_layers(checkpoint_path, batches): ...
"""

from __future__ import annotations

import functools
import sys
from typing import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm
from flax import nnx

from moejax.errors import CheckpointError
from moejax.hf.model_io import OpenCheckpoint, open_checkpoint
from moejax.models.layers import causal_allowed


@functools.partial(jax.jit, static_argnums=0)
def _layer_forward(graphdef, state, x_BSH, cos, sin, allowed_BSS):
    out, _, z = nnx.merge(graphdef, state)(x_BSH, cos, sin, allowed_BSS)
    return out, z


def batch_geometry(ckpt: OpenCheckpoint, ids_BS, mask_BS, dtype):
    """(cos, sin, allowed [B, S, S]) of one batch: the family's rope tables and the causal (and
    padding) mask."""
    B, S = np.asarray(ids_BS).shape
    cos, sin = ckpt.family.causal_lm().rope_tables(ckpt.config, jnp.arange(S), jnp.dtype(dtype))
    return cos, sin, causal_allowed(mask_BS, B, S)


def embed(ckpt: OpenCheckpoint, batches_of_ids, dtype) -> list:
    """The embedding rows of each batch of token ids, [B, S, H] in `dtype`, reading the table once
    (then dropping it); a NaN or infinity in a row the data uses is refused naming the token ids."""
    (spec,) = [s for s in ckpt.specs if s.param == "model.embed_tokens"]
    table = ckpt.reader.read(spec.hf_name)  # [V, H], one tensor; dropped after the lookup
    used = np.unique(np.concatenate([np.asarray(ids).ravel() for ids in batches_of_ids]))
    bad = used[~np.isfinite(table[used].astype(np.float32)).all(axis=1)]
    if bad.size:
        raise CheckpointError(f"{spec.hf_name} in {ckpt.reader.shard_of(spec.hf_name).name}: non-finite values "
                              f"(NaN or inf) in the rows of token id(s) {bad[:16].tolist()}, which the data uses")
    return [jnp.asarray(table[np.asarray(ids)].astype(jnp.dtype(dtype))) for ids in batches_of_ids]


def stream_layers(ckpt: OpenCheckpoint | str, batches, dtype=jnp.float32, progress: bool | None = None,
                  mesh=None) -> Iterator[tuple[int, object, list]]:
    """Yield (HF layer index, the layer's MoE module, [router inputs [B*S, H] per batch]) for every
    MoE layer, after running all batches through the layers before it.

    batches: list of (input_ids [B, S], attention_mask [B, S] or None). The MoE module is only
    valid until the next item is requested (its weights are dropped then).
    mesh: each layer's routed experts are loaded split over the mesh's expert axis and run with
    the "ep" backend; call this under `jax.set_mesh(mesh)`."""
    ckpt = ckpt if isinstance(ckpt, OpenCheckpoint) else open_checkpoint(ckpt)
    cfg = ckpt.config
    show = sys.stderr.isatty() if progress is None else progress
    n_tokens = sum(int(np.asarray(ids).size) for ids, _ in batches)
    hidden = embed(ckpt, [ids for ids, _ in batches], dtype)
    geometry = [batch_geometry(ckpt, ids, mask, dtype) for ids, mask in batches]
    backend = "ep" if mesh is not None else "sorted"
    for layer_idx in tqdm(range(cfg.num_hidden_layers), desc=f"layers ({n_tokens} tokens)", unit="layer",
                          disable=not show):
        layer = ckpt.decoder_layer(layer_idx, dtype, backend, mesh)
        graphdef, state = nnx.split(layer)
        router_inputs = []
        for b, (cos, sin, allowed) in enumerate(geometry):
            hidden[b], z = _layer_forward(graphdef, state, hidden[b], cos, sin, allowed)
            router_inputs.append(z.reshape(-1, z.shape[-1]))
        if layer.is_moe:
            yield layer_idx, layer.mlp, router_inputs
        del layer, state
