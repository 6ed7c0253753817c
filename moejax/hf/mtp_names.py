"""MTP layers under one set of names, whichever way a family stores them.

A multi-token-prediction (MTP) layer is a decoder block (attention and a MoE layer) with a small
predictor around it: `enorm` (the next token's embedding), `hnorm` (the trunk's last hidden state),
`eh_proj` (the two concatenated, [H, 2H]) and a final norm (`moejax.models.mtp`). DeepSeek-V3 (and
Kimi, GLM-4.5, DeepSeek-V3.2, GLM-5) store it as decoder layer `num_hidden_layers + j`:

    model.layers.{L+j}.{self_attn,mlp,input_layernorm,...}.*   the block
    model.layers.{L+j}.enorm.weight, hnorm.weight, eh_proj.weight, shared_head.norm.weight

Qwen3.5-MoE stores it apart (`mtp.*`, vLLM's `Qwen3_5MoeMTP`): `mtp.layers.{j}.*` the block,
`mtp.fc.weight` eh_proj, `mtp.pre_fc_norm_embedding.weight` enorm, `mtp.pre_fc_norm_hidden.weight`
hnorm, `mtp.norm.weight` the final norm. `mtp_renames` presents those under the first spelling
(the family's own layer stem, `model.language_model.layers.{L+j}.`) in the checkpoint's per-expert
view (`moejax.hf.fused_experts.FusedExpertsReader`), so that every command sees an MTP layer as
layer L + j of its family, as transformers' MTP model does (its weight conversion maps both
spellings to one); writers put the stored names back (`FusedExpertsReader.stored_name`).
"""

from __future__ import annotations

import re

from moejax.errors import CheckpointError, ConfigError


MTP_POLICIES = ("prune", "keep", "drop")
MTP_DEFAULT = "prune"


def check_mtp_policy(mtp) -> str:
    """--mtp: what every command does with a checkpoint's MTP layers. prune (the default): its
    experts are pruned or merged with the trunk's keep, ranked by its own scores (the calibration
    pass runs it as inference does), so config.json's one expert count holds for it and every
    runtime that reads that count loads it; keep: left full width (per-layer counts); drop: removed
    (num_nextn_predict_layers 0)."""
    if mtp not in MTP_POLICIES:
        raise ConfigError(f"--mtp {mtp!r}; expected one of {', '.join(MTP_POLICIES)}")
    return mtp


def carried_mtp_block(cfg, mtp: str, names) -> tuple[str, ...]:
    """A family whose MTP block moejax carries and never runs (the config's `MTP_CARRIED` prefix:
    DeepSeek-V4's `mtp.*`, which transformers 5.24 does not instantiate, so there is no reference to
    run, score or prune it against): the stored-name prefixes --mtp drop removes; () for --mtp keep
    (the source's bytes, full width) or when no tensor of `names` is under the prefix. --mtp prune
    is refused by name there, since moejax cannot score the block's experts."""
    prefix = getattr(cfg, "MTP_CARRIED", None)
    if not prefix or not any(n.startswith(prefix) for n in names):
        return ()
    if check_mtp_policy(mtp) == "prune":
        raise ConfigError(f"--mtp prune: {cfg.TITLE}'s MTP block (`{prefix}*`) is not run by moejax (transformers "
                          "does not instantiate it, so there is no reference to score it against), so its experts "
                          f"cannot be scored, pruned or merged; give --mtp keep (the block carried byte for byte, "
                          f"full width: {cfg.TITLE}'s pruned and merged checkpoints keep config.json's expert "
                          "count, so it loads wherever the source's does) or --mtp drop (removed, "
                          "num_nextn_predict_layers 0)")
    return (prefix,) if mtp == "drop" else ()


def mtp_renames(cfg, family, names) -> dict[str, str]:
    """{presented name: stored name} of the tensors of an MTP block stored apart (the family
    config's `MTP_STORED`: its prefix and its predictor tensors' names), for the names on disk;
    {} for a family that stores MTP layers as decoder layers. One stored MTP block is presented
    (Qwen3.5 ships one; its predictor tensors belong to every depth, so a second block under one
    `mtp.fc` is refused by name)."""
    stored = getattr(cfg, "MTP_STORED", None)
    if not stored:
        return {}
    prefix, predictor = stored
    names = [n for n in names if n.startswith(prefix)]
    if not names:
        return {}
    block = re.compile(re.escape(prefix) + r"layers\.(\d+)\.(.+)$")
    depths = sorted({int(m.group(1)) for n in names if (m := block.match(n))})
    if depths and depths != [0]:
        raise CheckpointError(f"MTP blocks {[f'{prefix}layers.{j}.' for j in depths]} share one predictor "
                              f"({prefix}{next(iter(predictor))}); moejax reads one MTP block (`{prefix}layers.0.`, "
                              "as Qwen3.5 ships it)")
    stem = family.rule("input_layernorm").hf.split("{l}")[0]   # "model.language_model.layers."
    layer = cfg.num_hidden_layers
    out = {}
    for name in names:
        if m := block.match(name):
            out[f"{stem}{layer}.{m.group(2)}"] = name
        elif name[len(prefix):] in predictor:
            out[f"{stem}{layer}.{predictor[name[len(prefix):]]}"] = name
    return out
