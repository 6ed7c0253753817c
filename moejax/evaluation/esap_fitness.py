"""EvoESAP's fitness (`moejax.allocation.evo_esap`): the ESAP of candidate allocations against the
unpruned model, teacher forced on calibration tokens held apart from the scoring ones, many
candidates in one walk over the layers.

A candidate is kept counts per MoE layer; at layer l it keeps the count_l best experts of the
variant's ranking (`select_kept`, ties to the lower index) and routes over them, as a pruned
checkpoint does (EvoESAP masks the router logits of the others to -inf). Every candidate is a
held-out stream of the carried pass's machinery (`carry_heldout`, stream 0 the unpruned model),
so each decoder layer is read once per generation for all of them; the head then gives each
stream's ESAP against stream 0 at every position that predicts a next token
(`moejax.inference.agreement`), and a candidate's fitness is its mean over those positions:

    fitness(c) = (1 / N) sum_{sequences, t} sum_v min(p_t[v], q_t^c[v])

the token-weighted mean EvoESAP's `esp-dataset` takes (it also scores a sequence's last position,
which predicts nothing here and is left out).
"""

from __future__ import annotations

import time

import jax.numpy as jnp
import numpy as np
from flax import nnx

from moejax.evaluation.carried_heldout import TableGroup, carry_heldout
from moejax.hf.model_io import OpenCheckpoint
from moejax.inference.stream import batch_geometry, embed, head_pass
from moejax.scoring.select import select_kept
from moejax.variants import Kept
from moejax.variants.plan import stacked_expert_map

STREAM_TOKENS = 2048   # tokens of all streams one call computes (as the carried pass)


class EsapFitness:
    """fitness(kept counts [P, L], the `layers` in order) -> ESAP [P]; `evaluated` candidates and
    `seconds` spent so far (for the rate)."""

    def __init__(self, ckpt: OpenCheckpoint, ids_NS: np.ndarray, rankings: dict, layers: list, *,
                 batch_size: int = 8, dtype=jnp.float32):
        self.ckpt, self.dtype = ckpt, dtype
        self.rankings, self.layers = {l: np.asarray(rankings[l], np.float64) for l in layers}, list(layers)
        ids_NS = np.asarray(ids_NS)
        self.batches = [ids_NS[i:i + batch_size] for i in range(0, len(ids_NS), batch_size)]
        self.geometry = [batch_geometry(ckpt, b, None, dtype) for b in self.batches]
        self.embedded = embed(ckpt, self.batches, dtype)
        self.tokens = max(b.size for b in self.batches)
        self.evaluated, self.seconds = 0, 0.0

    def kept(self, counts_PL) -> list[dict]:
        """Each candidate's {layer: bool [E]} of kept experts."""
        return [{l: select_kept(self.rankings[l], int(c), f"layer {l}") for l, c in zip(self.layers, row)}
                for row in np.asarray(counts_PL)]

    def __call__(self, counts_PL) -> np.ndarray:
        t0 = time.perf_counter()
        kept = self.kept(counts_PL)
        esap = self.esap(kept)
        self.evaluated += len(kept)
        self.seconds += time.perf_counter() - t0
        return esap

    def esap(self, kept: list[dict]) -> np.ndarray:
        """The mean ESAP of each kept-set candidate ({layer: bool [E]}) against the unpruned model."""
        ckpt, cfg = self.ckpt, self.ckpt.config
        n = len(kept) + 1
        held = {"fitness": [x[None] for x in self.embedded]}
        carries = {"fitness": [None] * len(self.batches)}
        geo = {"fitness": self.geometry}
        chunk = max(1, STREAM_TOKENS // self.tokens)
        for layer_idx in range(cfg.num_hidden_layers):
            layer = ckpt.decoder_layer(layer_idx, self.dtype, expert_dtype=ckpt.stored_expert_dtype(self.dtype))
            graphdef, state = nnx.split(layer)
            groups = None
            if layer.is_moe:
                own = layer.mlp.expert_weights()
                plans = [None] + [Kept(k[layer_idx]) if layer_idx in k else None for k in kept]
                groups = [TableGroup(list(range(n)), lambda: stacked_expert_map(plans, own, cfg.n_experts))]
            carry_heldout(graphdef, state, held, carries, geo, groups, chunk, n, None)
            del layer, graphdef, state, groups
        out = head_pass(ckpt, held, {"fitness": self.batches}, self.dtype, agreement=True)
        per_batch = out.esap["fitness"]   # [A, B, S - 1] each
        total = sum(b.sum(axis=(1, 2), dtype=np.float64) for b in per_batch)
        count = sum(b[0].size for b in per_batch)
        return np.asarray(total[1:] / count, np.float64)
