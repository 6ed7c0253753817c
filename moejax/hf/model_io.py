"""DeepseekV3ForCausalLM from and to Hugging Face checkpoint folders.

Loading reads one tensor at a time through `CheckpointReader`, checks every name, shape and dtype
against what the config implies (all mismatches reported together, before any tensor data is
read), and places each tensor into its parameter through the mapping table.

Saving writes HF names, per-expert tensors, the source's dtypes, and carries every tensor the
model has no parameter for (MTP layers, stray `rotary_emb.inv_freq`, quantisation companions) byte
for byte from the source checkpoint, so load-then-save gives back the same tensors.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moejax.errors import CheckpointError
from moejax.hf.mapping import TensorSpec, get_path, param_shapes, tensor_specs
from moejax.hf.safetensors_io import CheckpointReader, RawTensor, write_checkpoint
from moejax.models.deepseek_v3.config import DeepseekV3Config
from moejax.models.deepseek_v3.model import DeepseekV3ForCausalLM

log = logging.getLogger(__name__)

COMPUTE_DTYPES = {"F32": np.float32, "BF16": None, "F16": np.float16}  # None: ml_dtypes bfloat16
_STRAY = re.compile(r"\.rotary_emb\.inv_freq$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_ALWAYS_F32 = ("mlp.router", "mlp.bias")  # router weight and balance bias stay float32


@dataclasses.dataclass(frozen=True)
class HFSource:
    """Where a model was loaded from: what saving needs to give the same tensors back."""

    path: Path
    dtypes: dict      # hf name -> safetensors dtype string
    carried: tuple    # hf names with no parameter (written back from the source as bytes)


def _extra_tensors(cfg: DeepseekV3Config, names, expected: set) -> tuple[list, list]:
    """Split the checkpoint's names the model has no parameter for into (carried, unexpected)."""
    carried, unexpected = [], []
    for name in names:
        if name in expected:
            continue
        layer = _LAYER.match(name)
        if _STRAY.search(name) or (layer and int(layer.group(1)) >= cfg.num_hidden_layers):
            carried.append(name)  # MTP layer or a stray buffer: not part of the forward
        else:
            unexpected.append(name)
    return carried, unexpected


def check_checkpoint(cfg: DeepseekV3Config, reader: CheckpointReader, specs: list[TensorSpec]) -> list[str]:
    """Every mismatch between the checkpoint and the config, as messages (empty = fine)."""
    names = set(reader.keys())
    expected = {s.hf_name for s in specs}
    problems = []
    missing = [s.hf_name for s in specs if s.hf_name not in names]
    if missing:
        quant = cfg.quantization_config
        hint = f" (quantization_config {quant.get('quant_method')!r} is not supported for loading yet)" if quant else ""
        problems.append(f"{len(missing)} tensor(s) missing{hint}, e.g. {missing[:5]}")
    for s in specs:
        if s.hf_name not in names:
            continue
        info = reader.info(s.hf_name)
        if tuple(info.shape) != tuple(s.hf_shape):
            problems.append(f"{s.hf_name} in {reader.shard_of(s.hf_name).name}: shape {list(info.shape)}, "
                            f"expected {list(s.hf_shape)} from config.json")
        if info.dtype not in COMPUTE_DTYPES:
            problems.append(f"{s.hf_name} in {reader.shard_of(s.hf_name).name}: dtype {info.dtype}, "
                            f"expected one of {sorted(COMPUTE_DTYPES)}")
    carried, unexpected = _extra_tensors(cfg, names, expected)
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected tensor(s), e.g. {sorted(unexpected)[:5]}")
    return problems


def load_pretrained(path, dtype=jnp.float32, backend: str = "sorted") -> DeepseekV3ForCausalLM:
    """Build the model from a checkpoint folder (config.json + safetensors)."""
    path = Path(path)
    cfg = DeepseekV3Config.from_json_file(path / "config.json")
    reader = CheckpointReader(path)
    abstract = nnx.eval_shape(lambda: DeepseekV3ForCausalLM(cfg, dtype))
    specs = tensor_specs(cfg, param_shapes(abstract))
    problems = check_checkpoint(cfg, reader, specs)
    if problems:
        raise CheckpointError(f"{path}: checkpoint does not match its config.json:\n  - " + "\n  - ".join(problems))
    carried, _ = _extra_tensors(cfg, reader.keys(), {s.hf_name for s in specs})
    if carried:
        log.info("%s: %d tensor(s) not used by the forward (MTP layer, rotary_emb.inv_freq), kept for saving: %s",
                 path, len(carried), carried[:3])

    buffers = {}
    for s in specs:
        target = np.float32 if s.param.endswith(_ALWAYS_F32) else dtype
        buf = buffers.get(s.param)
        if buf is None:
            buf = buffers[s.param] = np.empty(get_path(abstract, s.param).shape, jnp.dtype(target))
        value = reader.read(s.hf_name)
        value = value.T if s.transpose else value
        if s.expert is None:
            buf[...] = value.astype(buf.dtype)
        else:
            buf[s.expert] = value.astype(buf.dtype)
    graphdef, state = nnx.split(abstract)
    flat = [(p, v.replace(jnp.asarray(buffers[".".join(str(x) for x in p)]))) for p, v in nnx.to_flat_state(state)]
    model = nnx.merge(graphdef, nnx.from_flat_state(flat))
    for layer in model.model.layers:
        if layer.is_moe:
            layer.mlp.backend = backend
    model.hf_source = HFSource(path=path.resolve(), dtypes={s.hf_name: reader.info(s.hf_name).dtype for s in specs},
                               carried=tuple(carried))
    return model


def _hf_tensor(model, spec: TensorSpec, dtype_str: str) -> np.ndarray:
    from moejax.hf.safetensors_io import numpy_dtype

    value = np.asarray(jax.device_get(get_path(model, spec.param)[...]))
    if spec.expert is not None:
        value = value[spec.expert]
    if spec.transpose:
        value = value.T
    return np.ascontiguousarray(value.astype(numpy_dtype(dtype_str, spec.hf_name)))


def save_pretrained(model: DeepseekV3ForCausalLM, out_dir, *, max_shard_bytes: int = 5 * 2**30,
                    overwrite: bool = False) -> Path:
    """Write the model as a Hugging Face checkpoint folder (atomically: temporary folder, then rename).

    Tensors get the dtype they had in the source checkpoint (or the model's dtype); tensors the
    model has no parameter for are copied from the source byte for byte; other files of the source
    folder (tokenizer, generation_config.json) are copied too."""
    out_dir = Path(out_dir)
    cfg = model.config
    source: HFSource | None = getattr(model, "hf_source", None)
    specs = tensor_specs(cfg, param_shapes(model))
    default = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16"}.get(np.dtype(model.dtype), "BF16")
    reader = CheckpointReader(source.path) if source else None

    def tensors():
        for s in specs:
            dtype_str = source.dtypes.get(s.hf_name, default) if source else default
            if not source and s.param.endswith(_ALWAYS_F32):
                dtype_str = "F32"
            yield s.hf_name, _hf_tensor(model, s, dtype_str)
        for name in (source.carried if source else ()):
            info = reader.info(name)
            yield name, RawTensor(info.dtype, tuple(info.shape), reader.read_bytes(name))

    extra = {}
    if source:
        for f in sorted(source.path.iterdir()):
            if f.is_file() and f.name != "config.json" and not f.name.endswith(".safetensors") \
                    and f.name != "model.safetensors.index.json":
                extra[f.name] = f.read_bytes()
    write_checkpoint(out_dir, tensors(), cfg.to_dict(), max_shard_bytes=max_shard_bytes, overwrite=overwrite,
                     extra_files=extra, protect=source.path if source else None)
    return out_dir
