"""transformers-5 fused expert tensors, presented under the per-expert names moejax reads.

`save_pretrained(..., save_original_format=False)` writes each MoE layer's routed experts as two
3-D tensors instead of 3 x E per-expert ones:

    model.layers.{l}.mlp.experts.gate_up_proj  [E, 2 * F, H]   rows [0:F] gate, [F:2F] up
    model.layers.{l}.mlp.experts.down_proj     [E, H, F]

`FusedExpertsReader` wraps a CheckpointReader and answers for the per-expert names
(`...experts.{e}.gate_proj.weight` etc.) by slicing those. It is the one per-expert view of every
checkpoint: the checks, the layout (`moejax.hf.layout`), inspect, plan, data-free scores, diff and
the loader read through it and need no second path. Each per-expert tensor is a contiguous byte
range of its fused tensor (expert-major, rows of one expert adjacent), so `info` gives its exact
bytes. `moejax prune` and `moejax merge` write the source's spelling back (`expert_slabs`: a fused
tensor is rebuilt from the kept experts' slabs); `save_pretrained` writes the per-expert names.
"""

from __future__ import annotations

import dataclasses
import re

from moejax.hf.io.checkpoint_reader import CheckpointReader
from moejax.hf.io.safetensors_format import TensorInfo, check_complete_read, tensor_nbytes

_FUSED = re.compile(r"^model\.(?:language_model\.)?layers\.(\d+)\.mlp\.experts\.([a-z_]+)$")  # a wrapper's too
# transformers 5 writes its own module names (`mlp.experts`) whatever the family's hub names are
CANONICAL = ("model.layers.{l}.mlp.experts.{e}.gate_proj.weight", "model.layers.{l}.mlp.experts.{e}.up_proj.weight",
             "model.layers.{l}.mlp.experts.{e}.down_proj.weight")
CANONICAL_ROUTER = "model.layers.{l}.mlp.gate.weight"
# transformers 5's fused SwiGLU experts: stored name after `mlp.experts.` -> (the per-expert names its
# slab of expert e is cut into, in row order (equal shares: gate_up_proj's first half gate, then up),
# the fused tensor's rank)
SWIGLU_FUSED = {"gate_up_proj": (CANONICAL[:2], 3), "down_proj": (CANONICAL[2:], 3)}


@dataclasses.dataclass(frozen=True)
class _Slice:
    fused: str        # the fused tensor's name
    expert: int | None  # None: the whole tensor under another name (a router beside fused experts)
    rows: slice | None  # rows of that expert's matrix (gate or up half of gate_up_proj)


class FusedExpertsReader:
    """A CheckpointReader whose fused expert tensors also appear under per-expert names."""

    def __init__(self, reader: CheckpointReader, layout: dict | None = None, router_name: str = CANONICAL_ROUTER,
                 renamed: dict | None = None):
        """layout: {fused tensor name after `model.layers.{l}.mlp.experts.`: (the per-expert name
        templates (`{l}` layer, `{e}` expert) its slab of each expert is cut into, in row order, in
        equal shares; the fused tensor's rank)}; default transformers 5's SwiGLU (`SWIGLU_FUSED`). A
        tensor of another rank is not presented (the check names it, and the experts it lacks). The family's name table gives
        them (Mixtral: `...block_sparse_moe.experts.{e}.w1.weight`, w3, w2; gpt-oss, which stores only
        fused tensors: one name per fused tensor, the whole slab). router_name: the family's router
        name (Mixtral: `...block_sparse_moe.gate.weight`; transformers 5 writes `mlp.gate.weight`
        beside fused experts). renamed: {presented name: stored name} of whole tensors stored under
        another name (an MTP block stored apart, `moejax.hf.mtp_names`)."""
        self.reader = reader
        self.layout = SWIGLU_FUSED if layout is None else layout
        self._virtual: dict[str, _Slice] = {}
        self._cache: tuple[str, object] | None = None  # one fused tensor at a time
        self._by_stored: tuple[dict, dict] | None = None  # see _index
        for name in reader.keys():
            match = _FUSED.match(name)
            if match and match.group(2) in self.layout:
                self._add(int(match.group(1)), self.layout[match.group(2)], reader.info(name))
                router, canonical = router_name.format(l=match.group(1)), CANONICAL_ROUTER.format(l=match.group(1))
                if router != canonical and canonical in reader and router not in reader:
                    self._virtual[router] = _Slice(canonical, None, None)
        renamed = renamed or {}
        for view, stored in renamed.items():
            self._virtual[view] = _Slice(stored, None, None)
        # (presented prefix, stored prefix) of renamed experts' `experts.` stems: a pruned index maps back too
        self._stems = sorted({(v.split(".experts.")[0] + ".experts.", s.split(".experts.")[0] + ".experts.")
                              for v, s in renamed.items() if ".experts." in v and ".experts." in s})
        self._hidden = frozenset(s.fused for s in self._virtual.values())  # stored names presented as others
        self._fused_names = self._hidden - set(renamed.values())

    def _add(self, layer: int, parts: tuple, info: TensorInfo) -> None:
        parts, rank = parts
        if len(info.shape) != rank or info.shape[1] % len(parts):
            return  # not presented: the check then names the missing experts and this tensor
        n_experts, share = info.shape[0], info.shape[1] // len(parts)
        for e in range(n_experts):
            for i, template in enumerate(parts):
                self._virtual[template.format(l=layer, e=e)] = _Slice(info.name, e, slice(i * share, (i + 1) * share))

    @property
    def fused_names(self) -> frozenset[str]:
        """The stored tensors presented under other names (fused experts, a router beside them)."""
        return self._fused_names

    @property
    def directory(self):
        return self.reader.directory

    @property
    def storage(self):
        return self.reader.storage

    def view_name(self, stored: str) -> str:
        """The name a stored tensor that is not a fused expert tensor goes by in this view: a
        router beside fused experts under the family's router name, anything else its own."""
        return self._index()[1].get(stored, stored)

    def stored_name(self, view: str) -> str:
        """The name a tensor presented as `view` is written under: the stored spelling of a renamed
        tensor (an MTP block's, its expert index as in `view`) or of a router alias; else `view`."""
        part = self._virtual.get(view)
        if part is not None and part.expert is None:
            return part.fused
        for stem_view, stem_stored in self._stems:
            if view.startswith(stem_view):
                return stem_stored + view[len(stem_view):]
        return view

    def holder(self, view: str) -> str:
        """The stored tensor that holds a presented name: its fused tensor for an expert's slab (all
        experts', gpt-oss's MXFP4 blocks too), else `stored_name`."""
        part = self._virtual.get(view)
        return part.fused if part is not None and part.expert is not None else self.stored_name(view)

    def expert_slabs(self, stored: str) -> list[list[str]] | None:
        """For a stored fused expert tensor [E, ...], per expert the presented names whose rows
        tile that expert's slab, in row order (gate, up; or down alone); None for any other tensor."""
        return self._index()[0].get(stored)

    def _index(self) -> tuple[dict, dict]:
        """({fused tensor: per-expert presented names in row order}, {stored router: its alias}), built once."""
        if self._by_stored is None:
            slabs, aliases = {}, {}
            for name, part in sorted(self._virtual.items(), key=lambda item: (item[1].expert or 0,
                                                                               item[1].rows.start if item[1].rows else 0)):
                if part.expert is None:
                    aliases[part.fused] = name
                    continue
                experts = slabs.setdefault(part.fused, [])
                experts += [[] for _ in range(part.expert + 1 - len(experts))]
                experts[part.expert].append(name)
            self._by_stored = slabs, aliases
        return self._by_stored

    def keys(self) -> list[str]:
        return sorted((set(self.reader.keys()) - self._hidden) | set(self._virtual))

    def __contains__(self, name: str) -> bool:
        return name in self._virtual or (name in self.reader and name not in self._hidden)

    def info(self, name: str) -> TensorInfo:
        if name not in self._virtual:
            return self.reader.info(name)
        part = self._virtual[name]
        fused = self.reader.info(part.fused)
        if part.expert is None:
            return dataclasses.replace(fused, name=name)
        shape = (part.rows.stop - part.rows.start, *fused.shape[2:])
        row = tensor_nbytes(fused.dtype, fused.shape[2:], f"{fused.file}: tensor {part.fused!r}")
        begin = fused.begin + (part.expert * fused.shape[1] + part.rows.start) * row
        return dataclasses.replace(fused, name=name, shape=shape, begin=begin, end=begin + shape[0] * row)

    def read(self, name: str):
        if name not in self._virtual:
            return self.reader.read(name)
        part = self._virtual[name]
        if part.expert is None:
            return self.reader.read(part.fused)
        if self._cache is None or self._cache[0] != part.fused:
            self._cache = (part.fused, self.reader.read(part.fused))
        return self._cache[1][part.expert, part.rows]

    def read_rows(self, name: str, start: int, stop: int):
        """Rows of an unfused tensor (the embedding table, the output head)."""
        if name in self._virtual:
            return self.read(name)[start:stop]
        return self.reader.read_rows(name, start, stop)

    def shard_of(self, name: str):
        return self.reader.shard_of(self._virtual[name].fused if name in self._virtual else name)

    def read_bytes(self, name: str) -> bytes:
        """Exactly the tensor's bytes (a presented expert tensor: its byte range of the fused one)."""
        if name not in self._virtual:
            return self.reader.read_bytes(name)
        info = self.info(name)
        data = self.reader.storage.read_range(info.file, info.begin, info.nbytes)
        check_complete_read(info, len(data))
        return data
