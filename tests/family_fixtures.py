"""Tiny random checkpoints of the GQA families (every registered family but DeepSeek-V3, whose
fixtures are in hf_fixtures.py), made by transformers 5 itself (the reference we did not write),
hardened like the DeepSeek-V3 fixtures: norms randomised, router rows wide so routing is decisive,
attention biases and balance biases random and partly negative.

FAMILIES[name] = (transformers class name, config kwargs), from the registry: each family's
`test_config` (TEST in its presets.py), which exercises the family's particular settings (explicit
head_dim, dense layers, q/k norms over heads or whole projections, partial rope, groups, shared
experts, no renormalisation). A family registered with a test config is tested by tests/test_families.py."""

from __future__ import annotations

from hf_fixtures import decoder_layers, harden

from moejax.models.registry import FAMILIES as REGISTRY

FAMILIES = {name: (family.architecture, family.test_config)
            for name, family in REGISTRY.items() if family.test_config is not None}


# transformers' class where the Hub's architecture names it otherwise
TRANSFORMERS_ARCHITECTURE = {"kimi_k25": "Kimi_K25ForConditionalGeneration"}
# transformers' save -> the Hub's names, where they differ (Kimi-K2.5: its save_pretrained writes the
# language model's layers as `language_model.model.blocks.*` and leaves `model.mm_projector.pre_norm`;
# the Hub's are `language_model.model.layers.*` and `mm_projector.*`, which transformers loads)
HUB_RENAMES = {"kimi_k25": ((r"^language_model\.model\.blocks\.", "language_model.model.layers."),
                            (r"^model\.mm_projector\.", "mm_projector.")),
               # DeepSeek-V4: transformers' save keeps `model.` and `embed_tokens` / `hc_head.hc_*`; the Hub's
               # names (DeepSeek's, which transformers' conversion mapping reads) have neither
               "deepseek_v4": ((r"^model\.embed_tokens\.", "embed."), (r"^model\.hc_head\.hc_", "hc_head_"),
                               (r"^model\.", ""))}


def hf_classes(family: str):
    """(transformers' config class, its model class) of a family: `<Prefix>ForCausalLM` or a
    multimodal wrapper's `<Prefix>ForConditionalGeneration`, configured by `<Prefix>Config`."""
    import transformers

    architecture = TRANSFORMERS_ARCHITECTURE.get(family, FAMILIES[family][0])
    prefix = architecture.removesuffix("ForCausalLM").removesuffix("ForConditionalGeneration")
    return getattr(transformers, prefix + "Config"), getattr(transformers, architecture)


def as_hub_checkpoint(family: str, path) -> None:
    """transformers' save of `family` at `path` rewritten as the Hub ships it (`HUB_RENAMES`; config.json's
    architectures the Hub's), where the two differ."""
    import json
    import re
    from pathlib import Path

    from safetensors.numpy import load_file, save_file

    if family not in HUB_RENAMES:
        return
    for shard in Path(path).glob("*.safetensors"):
        tensors = load_file(shard)
        renamed = {}
        for name, value in tensors.items():
            for pattern, new in HUB_RENAMES[family]:
                name = re.sub(pattern, new, name)
            renamed[name] = value
        save_file(renamed, shard, metadata={"format": "pt"})
    index = Path(path) / "model.safetensors.index.json"
    assert not index.exists(), "one shard expected"
    config = json.loads((Path(path) / "config.json").read_text())
    config["architectures"] = [FAMILIES[family][0]]
    (Path(path) / "config.json").write_text(json.dumps(config, indent=2))


def make_family_checkpoint(family: str, path, seed=0, dtype="float32", save_original_format=True, **overrides):
    """Save a random transformers model of `family` to `path` (save_original_format=False:
    transformers 5's fused expert tensors, `mlp.experts.gate_up_proj` / `down_proj`); returns the
    torch model (eval)."""
    import torch

    config_cls, model_cls = hf_classes(family)
    torch.manual_seed(seed)
    kw = {**FAMILIES[family][1], "initializer_range": 0.15, **overrides}
    if "text_config" in kw:  # a wrapper: its language model initialises from its own config
        kw["text_config"] = {**kw["text_config"], "initializer_range": kw["initializer_range"]}
    cfg = config_cls(**kw, attn_implementation="eager", experts_implementation="eager")
    model = harden(model_cls(cfg).eval())
    if dtype == "bfloat16":
        model = model.to(torch.bfloat16)
    model.save_pretrained(path, save_original_format=save_original_format)
    if save_original_format:
        as_hub_checkpoint(family, path)
    return model


def moe_blocks(hf) -> dict:
    """{layer: the transformers MoE block} of every MoE layer (the block has a router `gate`)."""
    return {l: layer.mlp for l, layer in enumerate(decoder_layers(hf)) if hasattr(layer.mlp, "gate")}
