"""Expert-table rows made when they are read: each row a weighted average of other rows, every
member's intermediate neurons permuted first (SPEC section 8's merged expert):

    row r = sum_{i < counts[r]} shares[j_i] * P_{j_i}(source[j_i]),   j_i = members[r, i]

in the compute dtype (float32; float64 for a float64 source), members in ascending order, then
rounded into `dtype`; a row with counts[r] = 0 is zero. P_j permutes the neuron axis of each matrix
by perms[j] (the identity row for an expert not aligned; a matrix with no neuron axis, gpt-oss's
down bias, is averaged as it is). The sum runs term by term, each product
rounded before it is added (no fused multiply-add), so a row equals the host merge of
`moejax.merging.average.merge_weights` bit for bit (tested).

The carried pass gives a merge's table as two parts (`moejax.moe.grouped`): the layer's own experts
and an `AveragedRows` over them, so a merge holds a few small index arrays instead of its merged
experts (a Moonlight-sized merged expert is 17 MB, a merge to 32 experts 20-odd of them). The exact
forward-only loop makes each row it needs as it reaches it; every other path makes them all first
(`materialize`).

    members   int32 [n_rows, E]   each row's source rows, ascending, zero-padded past counts[r]
    counts    int32 [n_rows]      how many members each row has
    shares    [E] compute dtype   each source row's weight within its row (they sum to 1 per row)
    perms     int32 [E, F]        each source row's neuron permutation
    axes      ((name, NeuronAxis or None), ...)   static: where each matrix's F axis is and how many
              entries a neuron owns on it (`moejax.moe.neurons.NEURON_LAYOUTS`)
    dtype     static: the rows' dtype (the source's)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from moejax.moe.neurons import entry_index


@jax.tree_util.register_pytree_node_class
class AveragedRows:
    def __init__(self, members, counts, shares, perms, axes: tuple, dtype):
        self.members, self.counts, self.shares, self.perms = members, counts, shares, perms
        self.axes, self.dtype = tuple(axes), np.dtype(dtype)

    def tree_flatten(self):
        return (self.members, self.counts, self.shares, self.perms), (self.axes, self.dtype)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children, *aux)

    @property
    def n_rows(self) -> int:
        return self.members.shape[0]

    def row(self, source: dict, r) -> dict:
        """Row r (a traced index) of the table, from the source table {name: [E, ...]}."""
        compute = jnp.float64 if any(np.dtype(w.dtype) == np.float64 for w in source.values()) else jnp.float32

        def permuted(m, perm, ax):
            return m if ax is None else jnp.take(m, entry_index(perm, ax.width, jnp), axis=ax.axis, mode="clip")

        def term(i, source):   # member i's share times its permuted matrices (index clipped: past the last, unused)
            j = self.members[r, jnp.minimum(i, self.members.shape[1] - 1)]
            return {k: permuted(jax.lax.dynamic_index_in_dim(source[k], j, keepdims=False).astype(compute),
                                self.perms[j], ax) * self.shares[j].astype(compute)
                    for k, ax in self.axes}

        # Each product is rounded before it is added, as numpy does: XLA:CPU fuses a multiply into
        # the add that reads it as one fused multiply-add (one rounding), and an optimisation barrier
        # does not stop it. So the loop adds the product the iteration before made (a loop carry, a
        # buffer) while it makes the next. The source rides in the carry through a barrier: as a
        # loop invariant XLA would convert the whole stack to the compute dtype before the loop
        # (a float32 copy of a bfloat16 layer's experts: 2.2 GB at Moonlight's shape).
        def add(i, carry):
            acc, term_i, source = carry
            source = jax.lax.optimization_barrier(source)
            return {k: acc[k] + term_i[k] for k in acc}, term(i + 1, source), source

        acc = jax.lax.fori_loop(1, self.counts[r], add, (term(0, source), term(1, source), source))[0]
        return {k: jnp.where(self.counts[r] > 0, v, 0).astype(self.dtype) for k, v in acc.items()}

    def materialize(self, source: dict) -> dict:
        """Every row: {name: [n_rows, ...]} (a loop over rows, one row's temporaries at a time)."""
        return jax.lax.map(lambda r: self.row(source, r), jnp.arange(self.n_rows))
