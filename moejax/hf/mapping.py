"""Hugging Face tensor names <-> moejax parameters for a checkpoint's config, whatever its family:
the family's name table (`moejax.models.<family>.names`, rules from `moejax.models.names`)
expanded into one `TensorSpec` per HF tensor, which loading, saving, shape checks and parameter
counting all walk. Needs no model (so checkpoint tools stay free of JAX); a test checks the shapes
against each family's NNX model."""

from __future__ import annotations

from moejax.models.names import TensorSpec
from moejax.models.registry import family_of


def tensor_specs(cfg) -> list[TensorSpec]:
    """Every HF tensor of a checkpoint of `cfg`, in file order (layers ascending), with the shape
    the config implies. A per-layer expert count (a checkpoint pruned per layer,
    `cfg.experts_in_layer`) gives that layer's router, bias and expert tensors."""
    return family_of(cfg).tensor_specs(cfg)


def layer_specs(cfg, layer: int) -> list[TensorSpec]:
    """The decoder-layer tensors of layer `layer` (an MTP layer's decoder block included)."""
    return family_of(cfg).layer_specs(cfg, layer)


def param_shapes(module) -> dict[str, tuple]:
    """Dotted path -> shape of every nnx.Param / Variable array in the module tree."""
    from flax import nnx

    out = {}
    for path, var in nnx.to_flat_state(nnx.state(module)):
        out[".".join(str(p) for p in path)] = tuple(var.shape if hasattr(var, "shape") else var.value.shape)
    return out


def get_path(module, path: str):
    """The Variable at a dotted path (integers index lists)."""
    obj = module
    for part in path.split("."):
        obj = obj[int(part)] if part.isdigit() else getattr(obj, part)
    return obj
