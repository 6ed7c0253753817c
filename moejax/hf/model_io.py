"""Any registered family's model from and to Hugging Face checkpoint folders: the loader. It
imports the model, never the reverse (the model classes know nothing of files):

    from moejax import from_pretrained, save_pretrained   # this module's load_pretrained, save_pretrained
    model = from_pretrained("path/to/checkpoint", dtype=jnp.bfloat16)   # the family config.json names
    save_pretrained(model, "out_dir")

Loading reads one tensor at a time through `CheckpointReader`, checks every name, shape and dtype
against what the config implies (all mismatches reported together, before any tensor data is
read), and places each tensor into its parameter through the mapping table.

Quantised weights (FP8 with 128x128 block scales, compressed-tensors INT4 pack-quantized and
MXFP4) are decoded to the model dtype for compute.

Saving writes HF names, per-expert tensors and the source's dtypes, and carries byte for byte from
the source every tensor the model has no parameter for (MTP layers, stray `rotary_emb.inv_freq`)
and every quantised weight with its companions, so load-then-save gives back the same tensors.
(Quantised weights are not re-quantised: a model loaded from a quantised checkpoint and then
modified in those weights would be saved with the source's quantised values.)
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moejax.errors import CheckpointError, ConfigError
from moejax.hf.check import check_checkpoint, mtp_layers, stored_as
from moejax.hf.fused_experts import FusedExpertsReader
from moejax.hf.io.checkpoint_reader import CheckpointReader
from moejax.hf.io.checkpoint_writer import write_checkpoint
from moejax.hf.io.safetensors_format import RawTensor, numpy_dtype
from moejax.hf.io.storage import require_local
from moejax.hf.mapping import TensorSpec, get_path, tensor_specs
from moejax.hf.quant.decode import read_decoded
from moejax.host_memory import aligned_empty
from moejax.models.family import Family
from moejax.models.registry import family_of
from moejax.parallel.sharding import spec_for

log = logging.getLogger(__name__)

_ALWAYS_F32 = ("mlp.router", "mlp.bias", "mlp.router_bias")  # router weight and balance bias stay float32


@dataclasses.dataclass(frozen=True)
class HFSource:
    """Where a model was loaded from: what saving needs to give the same tensors back."""

    path: Path
    dtypes: dict      # hf name -> safetensors dtype string
    carried: tuple    # hf names with no parameter (written back from the source as bytes)
    quantized: dict   # hf name of a quantised weight -> the stored tensors holding it (gpt-oss's MXFP4: its
                      # layer's fused *_blocks and *_scales, which hold every expert's)


def check_finite(value: np.ndarray, where: str) -> None:
    """Raise naming `where` and the first bad position when `value` holds a NaN or an infinity."""
    finite = np.isfinite(value)
    if not finite.all():
        bad = np.argwhere(~finite)
        raise CheckpointError(f"{where}: {len(bad)} non-finite value(s) (NaN or inf), first at index "
                              f"{tuple(int(i) for i in bad[0])}: {value[tuple(bad[0])]}")


def check_ids(value: np.ndarray, n: int, where: str) -> None:
    """Raise naming `where` and the first bad position when an id table (DeepSeek-V4's tid2eid:
    the expert each token id is sent to) holds an id outside [0, n): JAX's indexing would clamp it
    to the last expert without a word."""
    bad = np.argwhere((value < 0) | (value >= n))
    if len(bad):
        raise CheckpointError(f"{where}: {len(bad)} id(s) outside [0, {n}) (the layer's experts), first at index "
                              f"{tuple(int(i) for i in bad[0])}: {value[tuple(bad[0])]}")


@dataclasses.dataclass
class OpenCheckpoint:
    """A checkpoint folder checked against its config.json (headers only), ready to fill modules
    one at a time: the whole model (`load_pretrained`) or one decoder layer (the streamed executor)."""

    path: Path
    config: object        # the family's config
    family: Family
    reader: FusedExpertsReader
    fmt: str | None
    specs: list           # every HF tensor the config implies, in file order
    stored: dict          # hf name -> the on-disk tensors holding it
    carried: list         # tensors with no parameter (MTP layer, stray buffers)

    def specs_under(self, prefix: str) -> list[TensorSpec]:
        return [s for s in self.specs if s.param.startswith(prefix)]

    def read_param_tensor(self, s: TensorSpec, dtype) -> np.ndarray:
        """One HF tensor decoded, transposed to the parameter's layout and cast; a NaN or infinity
        (in the stored values or from the cast) is refused naming the tensor, so no score, kept set
        or metric is ever computed from one."""
        value = read_decoded(self.reader, s.hf_name, self.stored[s.hf_name], self.fmt, self.config.quantization_config)
        where = f"{s.hf_name} in {self.reader.shard_of(self.stored[s.hf_name][0]).name}"
        if s.index:   # before the cast to int32, which would wrap a large id
            check_ids(value, self.config.n_experts, where)
        value = (value.T if s.transpose else value).astype(dtype)
        check_finite(value, where)
        return value

    def read_rows(self, s: TensorSpec, start: int, stop: int, dtype) -> np.ndarray:
        """Rows [start, stop) of a [V, H] vocabulary tensor (embedding table, output head) in its
        Hugging Face layout, cast to dtype and checked finite like `read_param_tensor`; only those
        rows are read (a quantised tensor is decoded whole first)."""
        if self.stored[s.hf_name] == (s.hf_name,):
            value = self.reader.read_rows(s.hf_name, start, stop)
        else:
            value = read_decoded(self.reader, s.hf_name, self.stored[s.hf_name], self.fmt,
                                 self.config.quantization_config)[start:stop]
        value = value.astype(dtype)
        check_finite(value, f"{s.hf_name} rows [{start}, {stop}) in {self.reader.shard_of(self.stored[s.hf_name][0]).name}")
        return value

    def stored_expert_dtype(self, dtype):
        """The dtype routed experts can be held in for a float32 computation without changing a
        value: their stored dtype when it is bfloat16 or float16 (converted exactly to float32 one
        expert at a time as they are used; half the memory of a float32 stack), else `dtype`."""
        on_disk = [self.stored[s.hf_name] for s in self.specs if s.expert is not None]
        if jnp.dtype(dtype) != jnp.float32 or not on_disk or any(len(d) != 1 for d in on_disk):
            return dtype  # (quantised experts are decoded to float32 anyway)
        stored = {self.reader.info(d[0]).dtype for d in on_disk}
        narrow = {"BF16": jnp.bfloat16, "F16": jnp.float16}
        return narrow[min(stored)] if len(stored) == 1 and stored <= set(narrow) else dtype

    def decoder_layer(self, layer: int, dtype, backend: str = "sorted", mesh=None, expert_dtype=None):
        """Decoder layer `layer` of this checkpoint's family, filled from its tensors (the streamed
        executors hold one at a time); an MTP layer's decoder block for layer >= num_hidden_layers.
        mesh: routed experts split over its expert axis. expert_dtype: hold the routed experts in
        this dtype instead (`stored_expert_dtype`)."""
        cls = self.family.causal_lm()
        prefix = f"model.layers.{layer}."
        specs = [s for s in self.layer_specs(layer) if s.param.startswith(prefix)]
        abstract = nnx.eval_shape(lambda: cls.decoder_layer(self.config, layer, dtype, nnx.Rngs(0), backend))
        return self.fill(abstract, specs, dtype, prefix=prefix, mesh=mesh, expert_dtype=expert_dtype)

    def exit_block(self, dtype):
        """The family's module collapsing the last layer's residual before the final norm
        (`CausalLM.exit_block`, DeepSeek-V4's hc_head), filled from its tensors; None for a family
        without one."""
        cls = self.family.causal_lm()
        if cls.EXIT_NAME is None:
            return None
        prefix = f"model.{cls.EXIT_NAME}."
        abstract = nnx.eval_shape(lambda: cls.exit_block(self.config, nnx.Rngs(0)))
        return self.fill(abstract, self.specs_under(prefix), dtype, prefix=prefix)

    def layer_specs(self, layer: int) -> list[TensorSpec]:
        """The tensors of decoder layer `layer`, or of MTP layer `layer` (its block and predictor)."""
        if layer < self.config.num_hidden_layers:
            return self.specs_under(f"model.layers.{layer}.")
        return self.mtp_specs(layer)

    def mtp_layers(self) -> list[int]:
        """The MTP layers on disk (num_hidden_layers + j, `moejax.hf.mtp_names`), ascending."""
        return [l for l in mtp_layers(self.config) if any(s.hf_name in self.reader for s in self.mtp_specs(l, check=False))]

    def mtp_specs(self, layer: int, check: bool = True) -> list[TensorSpec]:
        """MTP layer `layer`'s tensors (its decoder block and predictor, `moejax.models.names.mtp_rules`),
        their on-disk tensors added to `stored`; check: refuse one that is missing, naming them all
        (a checkpoint may carry an MTP block without its predictor, which no pass can run)."""
        specs = self.family.layer_specs(self.config, layer)
        if not check:
            return specs
        missing = []
        for s in specs:
            on_disk = self.stored.get(s.hf_name) or stored_as(self.reader, s.hf_name, self.fmt)
            if on_disk is None:
                missing.append(s.hf_name)
            else:
                self.stored[s.hf_name] = on_disk
        if missing:
            raise CheckpointError(f"{self.path}: MTP layer {layer} lacks {len(missing)} tensor(s) the MTP pass runs "
                                  f"(its block and predictor: enorm, hnorm, eh_proj, shared_head.norm), e.g. "
                                  f"{[self.reader.stored_name(n) for n in missing[:5]]}")
        return specs

    def mtp_predictor(self, layer: int, dtype):
        """MTP layer `layer`'s predictor (`moejax.models.mtp.MtpPredictor`), filled from its tensors."""
        from moejax.models.mtp import MtpPredictor

        prefix = f"mtp.{layer}."
        abstract = nnx.eval_shape(lambda: MtpPredictor(self.config, dtype, nnx.Rngs(0)))
        return self.fill(abstract, [s for s in self.mtp_specs(layer) if s.param.startswith(prefix)], dtype, prefix=prefix)

    def fill(self, abstract, specs: list[TensorSpec], dtype, prefix: str = "", mesh=None, expert_dtype=None):
        """Materialise `abstract` (an nnx.eval_shape'd module) with the tensors of `specs`, whose
        parameter paths are relative to the module once `prefix` is removed. Reads one tensor at a
        time; quantised tensors are decoded.

        mesh: place parameters by moejax.parallel's rule table; expert-split parameters are built
        shard by shard from only the experts each shard holds, so a process of a multi-host run
        reads only the expert tensors of its own devices."""
        sharded = {}
        if mesh is not None:
            for s in specs:
                spec = spec_for(s.param[len(prefix):])
                if s.expert is not None and spec != jax.sharding.PartitionSpec():
                    sharded.setdefault(s.param[len(prefix):], {})[s.expert] = s
        remaining = {}
        for s in specs:
            remaining[s.param] = remaining.get(s.param, 0) + 1
        buffers, arrays = {}, {}
        for path, by_expert in sharded.items():
            arrays[path] = self._expert_sharded(abstract, path, by_expert, dtype, mesh)
        for s in specs:
            path = s.param[len(prefix):]
            if path in sharded:
                continue
            target = np.int32 if s.index else np.float32 if s.param.endswith(_ALWAYS_F32) else (
                expert_dtype if s.expert is not None and expert_dtype is not None else dtype)
            buf = buffers.get(path)
            if buf is None:   # aligned: JAX uses it in place (no second copy of a layer's experts in memory)
                buf = buffers[path] = aligned_empty(get_path(abstract, path).shape, jnp.dtype(target))
            value = self.read_param_tensor(s, buf.dtype)
            if s.expert is None:
                buf[...] = value
            else:
                buf[s.expert] = value
            remaining[s.param] -= 1
            if not remaining[s.param]:  # complete: hand it to JAX and free the host copy now
                host = buffers.pop(path)
                arrays[path] = jax.device_put(host, None if mesh is None else jax.sharding.NamedSharding(
                    mesh, jax.sharding.PartitionSpec()))
        graphdef, state = nnx.split(abstract)
        flat = [(p, v.replace(arrays[".".join(str(x) for x in p)])) for p, v in nnx.to_flat_state(state)]
        return nnx.merge(graphdef, nnx.from_flat_state(flat))


    def _expert_sharded(self, abstract, path: str, by_expert: dict, dtype, mesh):
        """A stacked [E, ...] expert parameter split over the mesh's expert axis, each device's
        block read from its own experts' tensors only (replicas over other axes share one read)."""
        shape = get_path(abstract, path).shape
        target = np.float32 if path.endswith(_ALWAYS_F32) else dtype
        blocks = {}

        def block(index):
            experts = range(*index[0].indices(shape[0]))
            key = (experts.start, experts.stop)
            if key not in blocks:
                blocks[key] = np.stack([self.read_param_tensor(by_expert[e], jnp.dtype(target)) for e in experts])
            return blocks[key]

        sharding = jax.sharding.NamedSharding(mesh, spec_for(path))
        return jax.make_array_from_callback(shape, sharding, block)


def open_checkpoint(path) -> OpenCheckpoint:
    """Read config.json and every safetensors header (`moejax.hf.check.check_checkpoint`, the
    check every command runs); raise every mismatch at once. A local folder only: loading reads
    every weight, and saving copies the source's other files. A checkpoint pruned to different
    expert counts per layer (`moe_sparsity_config.num_experts`) is read with each layer's count."""
    require_local(path, "loading a model")
    return opened(check_checkpoint(path, uniform_experts=False))


def opened(checked) -> OpenCheckpoint:
    """The OpenCheckpoint of a `check_checkpoint` result (for commands that also need its layout)."""
    if checked.carried:
        log.info("%s: %d tensor(s) not used by the forward (MTP layer, rotary_emb.inv_freq), kept for saving: %s",
                 checked.path, len(checked.carried), checked.carried[:3])
    return OpenCheckpoint(checked.path, checked.config, checked.family, checked.reader, checked.fmt, checked.specs,
                          checked.stored, checked.carried)



COMPUTE_DTYPES = ("float32", "bfloat16", "float16")  # what a model computes in (and save_pretrained writes)


def check_compute_dtype(dtype) -> None:
    """Refuse, before anything is read, a dtype no model computes in (an integer dtype would load,
    then fail in the first forward): float32, bfloat16 or float16."""
    try:
        name = jnp.dtype(dtype).name if dtype is not None else None
    except (TypeError, ValueError):
        name = None
    if name not in COMPUTE_DTYPES:
        raise ConfigError(f"dtype={name or repr(dtype)}; expected a floating dtype the model computes in: "
                          f"{', '.join(COMPUTE_DTYPES)}")


def load_pretrained(path, dtype=jnp.float32, backend: str | None = None, mesh=None, model_class=None):
    """Build the model of a checkpoint folder (config.json + safetensors), of the family its
    config.json names (`moejax.models.registry`); model_class (a family's model class, e.g.
    `moejax.MixtralForCausalLM`): refuse any other family's checkpoint. `moejax.from_pretrained`.

    mesh: a `moejax.parallel.make_mesh` mesh; routed experts are loaded split over its expert axis
    (each device's experts read for it alone) and the MoE layers use the "ep" dispatch backend
    (run the model under `jax.set_mesh(mesh)`). backend: default "ep" with a mesh, else "sorted"."""
    check_compute_dtype(dtype)
    return load_opened(open_checkpoint(path), dtype, backend, mesh, model_class)


def load_opened(ckpt: OpenCheckpoint, dtype=jnp.float32, backend: str | None = None, mesh=None, model_class=None):
    """`load_pretrained` of a checkpoint already opened (`opened`: a substituted checkpoint's
    complete view, `moejax.surgery.substitute.load_substituted`)."""
    backend = backend or ("ep" if mesh is not None else "sorted")
    quantized = {n: tuple(ckpt.reader.holder(d) for d in on_disk) for n, on_disk in ckpt.stored.items()
                 if on_disk != (n,)}
    source = HFSource(path=ckpt.path, dtypes={n: ckpt.reader.info(on_disk[0]).dtype for n, on_disk in ckpt.stored.items()},
                      carried=tuple(ckpt.reader.stored_name(n) for n in ckpt.carried), quantized=quantized)
    cls = ckpt.family.causal_lm()
    if model_class is not None and not issubclass(cls, model_class):
        raise ConfigError(f"{ckpt.path}: a {ckpt.family.title} checkpoint ({cls.__name__}); "
                          f"from_pretrained(model_class={model_class.__name__}) cannot load it (leave model_class "
                          "out to load the family its config.json names)")
    abstract = nnx.eval_shape(lambda: cls(ckpt.config, dtype, backend=backend, hf_source=source))
    return ckpt.fill(abstract, ckpt.specs, dtype, mesh=mesh)


class _HostParams:
    """Parameters as host numpy arrays, one at a time: the specs of a stacked expert parameter are
    consecutive, so each parameter is fetched from the device once, not once per expert."""

    def __init__(self, model):
        self.model, self.path, self.value = model, None, None

    def hf_tensor(self, spec: TensorSpec, dtype_str: str) -> np.ndarray:
        if spec.param != self.path:
            self.path, self.value = spec.param, np.asarray(jax.device_get(get_path(self.model, spec.param)[...]))
        value = self.value if spec.expert is None else self.value[spec.expert]
        value = value.T if spec.transpose else value
        return np.ascontiguousarray(value.astype(numpy_dtype(dtype_str, spec.hf_name)))


def _fused_specs(family: Family, specs: list[TensorSpec]) -> dict:
    """For a family whose experts exist only fused (gpt-oss): {per-expert HF name: (the fused
    tensor's name, per expert the specs its slab concatenates) on the layer's first such spec, (the
    name, None) on the others}; {} for the other families, which save per expert."""
    if not family.stores_fused:
        return {}
    part_of = {rule: (stored, i) for stored, rules in family.fused.items() for i, rule in enumerate(rules)}
    groups: dict[str, dict] = {}  # fused tensor name -> {expert: [spec of each part]}
    for s in specs:
        if s.rule in part_of:
            stored, i = part_of[s.rule]
            fused = f"{s.hf_name.split('.experts.', 1)[0]}.experts.{stored}"  # the layer's tensor, its own prefix
            slab = groups.setdefault(fused, {}).setdefault(s.expert, [None] * len(family.fused[stored]))
            slab[i] = s
    out = {}
    for name, experts in groups.items():
        parts = [experts[e] for e in sorted(experts)]
        for spec in (p for expert in parts for p in expert):
            out[spec.hf_name] = (name, parts if spec is parts[0][0] else None)
    return out


def save_pretrained(model, out_dir, *, max_shard_bytes: int = 5 * 2**30,
                    overwrite: bool = False) -> Path:
    """Write the model as a Hugging Face checkpoint folder (atomically: temporary folder, then
    rename); `moejax.save_pretrained`. Returns out_dir.

    Tensors get the dtype they had in the source checkpoint (or the model's dtype); tensors the
    model has no parameter for are copied from the source byte for byte; other files of the source
    folder (tokenizer, generation_config.json) are copied too."""
    out_dir = Path(out_dir)
    cfg = model.config
    source: HFSource | None = model.hf_source
    specs = tensor_specs(cfg)
    default = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16"}.get(np.dtype(model.dtype), "BF16")
    reader = CheckpointReader(source.path) if source else None
    host = _HostParams(model)

    def from_source(name):
        info = reader.info(name)
        return name, RawTensor(info.dtype, tuple(info.shape), reader.read_bytes(name))

    def dtype_of(s):
        if source:
            return source.dtypes.get(s.hf_name, "I64" if s.index else default)
        return "I64" if s.index else "F32" if s.param.endswith(_ALWAYS_F32) else default

    fused = _fused_specs(family_of(cfg), specs)
    written = set()   # stored tensors holding several experts' quantised weights are written once

    def tensors():
        for s in specs:
            if source and s.hf_name in source.quantized:
                names = [n for n in source.quantized[s.hf_name] if n not in written]
                written.update(names)
                yield from (from_source(name) for name in names)
                continue
            if s.hf_name in fused:  # a family stored only fused: expert 0's spec writes the layer's whole tensor
                name, parts = fused[s.hf_name]
                if parts is not None:
                    yield name, np.stack([np.concatenate([host.hf_tensor(p, dtype_of(p)) for p in expert])
                                          for expert in parts])
                continue
            yield s.hf_name, host.hf_tensor(s, dtype_of(s))
        yield from (from_source(name) for name in (source.carried if source else ()))

    extra = {}
    if source:
        for f in sorted(source.path.iterdir()):
            if f.is_file() and f.name != "config.json" and not f.name.endswith(".safetensors") \
                    and f.name != "model.safetensors.index.json":
                extra[f.name] = f.read_bytes()
    write_checkpoint(out_dir, tensors(), cfg.to_dict(), max_shard_bytes=max_shard_bytes, overwrite=overwrite,
                     extra_files=extra, protect=source.path if source else None)
    return out_dir
