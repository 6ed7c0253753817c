"""Where the experts went: for each text (a skill's held-out documents, held-out code), the share
of its routing decisions that each expert of each MoE layer takes in the unpruned model, and how
many experts carry 90% of them. This is what explains which skills a pruning keeps: a skill whose
routing mass sits on experts that a score ranks low loses them first.

    share[text, l, e] = #{(t, k): expert_idx[t, k] == e at layer l, t in text} / (T_text * K)
    experts_for_mass[text, l] = the fewest experts whose shares add to >= mass (0.9)
"""

from __future__ import annotations

import numpy as np


def routing_shares(model, texts: dict, seq_len: int, batch: int = 16) -> dict:
    """{text name: float64 [n_moe_layers, E] shares (each row sums to one)}, with the MoE layers
    in model order. Each text's UTF-8 bytes (byte-level ids) are cut into rows of seq_len; the last
    row is padded, and the padding is not counted."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from moejax.moe.routing import routing_counts

    E = model.config.n_experts

    def counts_of(model, ids_BS, mask_BS):
        routing = model(ids_BS, mask_BS, return_routing=True, forward_only=True).routing
        valid = mask_BS.reshape(-1).astype(bool)
        return jnp.stack([routing_counts(r.expert_idx_TK, E, valid) for _, r in sorted(routing.items())])

    if isinstance(model, nnx.Module):   # one compiled forward (run op by op, it took 24 s of an eval_skills job)
        graphdef, state = nnx.split(model)
        compiled = jax.jit(lambda state, ids, mask: counts_of(nnx.merge(graphdef, state), ids, mask))

        def layer_counts(ids_BS, mask_BS):
            return compiled(state, ids_BS, mask_BS)
    else:                               # any callable with the model's signature, as it is
        def layer_counts(ids_BS, mask_BS):
            return counts_of(model, ids_BS, mask_BS)

    out = {}
    for name, text in texts.items():
        ids = np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)
        n_rows = -(-len(ids) // seq_len)
        rows = np.zeros((n_rows, seq_len), np.int32)
        mask = np.zeros((n_rows, seq_len), np.int32)
        rows.reshape(-1)[:len(ids)], mask.reshape(-1)[:len(ids)] = ids, 1
        counts = None
        for i in range(0, n_rows, batch):
            c = np.asarray(layer_counts(jnp.asarray(rows[i:i + batch]), jnp.asarray(mask[i:i + batch])),
                           np.float64)
            counts = c if counts is None else counts + c
        out[name] = counts / counts.sum(axis=1, keepdims=True)
    return out


def experts_for_mass(shares_E: np.ndarray, mass: float = 0.9) -> int:
    """The fewest experts whose shares add up to at least `mass` of the total."""
    cum = np.cumsum(np.sort(shares_E)[::-1]) / shares_E.sum()
    return int(np.searchsorted(cum, mass - 1e-12) + 1)


def routing_rows(shares: dict, moe_layers: list, mass: float = 0.9) -> list[dict]:
    """Tidy rows for a results table: metric routing_share (layer, expert) and experts_for_90
    (layer), task = the text's name."""
    rows = []
    for name, s_LE in shares.items():
        for i, layer in enumerate(moe_layers):
            rows += [dict(task=name, metric="routing_share", layer=layer, expert=e, value=float(v))
                     for e, v in enumerate(s_LE[i])]
            rows.append(dict(task=name, metric=f"experts_for_{round(mass * 100)}", layer=layer, expert=None,
                             value=float(experts_for_mass(s_LE[i], mass))))
    return rows
