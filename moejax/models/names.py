"""The one table between Hugging Face tensor names and moejax parameters, used in both directions.

Each family's `names.py` lists its `Rule`s, each named: this HF tensor (a name template) is that
parameter (an attribute path in the NNX module tree), stored transposed or not, one slice of a
stacked [E, ...] parameter or whole, with the shape the config implies, in the layers where
`when` holds. `expand(rules, cfg)` turns a table into one `TensorSpec` per HF tensor, which
loading, saving, shape checks and parameter counting all walk. JAX-free: the checkpoint tools read
it without building a model.

Roles the checkpoint tools rely on are rule names, the same in every family: `router` (one row
per routed expert), `balance_bias` (one entry per routed expert, where the family has one) and the
per-expert rules (`per_expert=True`).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

PLACES = ("head", "layer", "tail")  # before the decoder layers, in each layer, after them


@dataclasses.dataclass(frozen=True)
class Rule:
    name: str                     # "router", "expert_gate", "q_proj", ...: unique in its table
    hf: str                       # "model.layers.{l}.mlp.experts.{e}.gate_proj.weight"
    param: str                    # "model.layers.{l}.mlp.experts_gate"
    transpose: bool               # HF stores torch Linear weights [out, in]; moejax [in, out]
    shape: Callable               # cfg -> the HF tensor's shape ([out, in] for a Linear weight); None = E
    when: Callable = lambda cfg, layer: True
    per_expert: bool = False      # HF has one tensor per expert; the parameter stacks them on axis 0
    place: str = "layer"
    index: bool = False           # integer ids, not weights (DeepSeek-V4's tid2eid): stored I64 / I32, held int32


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    hf_name: str
    param: str                    # dotted attribute path
    transpose: bool
    expert: int | None            # index into the stacked parameter, or None
    hf_shape: tuple               # the shape the HF tensor must have
    rule: str = ""                # the rule's name
    index: bool = False           # the rule's `index`: integer ids, stored I64 / I32, held int32


def prefixed(rules: tuple, prefix: str, head: str = "lm_head.weight") -> tuple:
    """A table whose `model.` names live under `prefix` instead (a multimodal wrapper's language model:
    Qwen3.5's `model.language_model.`, Kimi-K2.5's `language_model.model.`), its output head named
    `head` (Qwen3.5's `lm_head.weight` at the top, Kimi-K2.5's `language_model.lm_head.weight`); the
    parameters stay as they are."""
    def renamed(r: Rule) -> Rule:
        if r.hf.startswith("model."):
            return dataclasses.replace(r, hf=prefix + r.hf[len("model."):])
        return dataclasses.replace(r, hf=head) if r.hf == "lm_head.weight" else r
    return tuple(renamed(r) for r in rules)


def check_table(rules: tuple) -> tuple:
    """A family's table, checked once at import: unique names, known places."""
    names = [r.name for r in rules]
    assert len(names) == len(set(names)), f"rule names repeat: {names}"
    assert all(r.place in PLACES for r in rules), [r.place for r in rules]
    return rules


def expand(rules, cfg) -> list[TensorSpec]:
    """Every HF tensor of a checkpoint of `cfg`, in file order (head, layers ascending, tail)."""
    specs = [_global(r, cfg) for r in rules if r.place == "head" and r.when(cfg, None)]
    for layer in range(cfg.num_hidden_layers):
        specs += expand_layer(rules, cfg, layer)
    return specs + [_global(r, cfg) for r in rules if r.place == "tail" and r.when(cfg, None)]


def expand_layer(rules, cfg, layer: int) -> list[TensorSpec]:
    """The decoder-layer tensors of layer `layer` (an MTP layer's decoder block included). A
    per-layer expert count (`cfg.experts_in_layer`) gives that layer's router, bias and experts."""
    specs = []
    E = cfg.experts_in_layer(layer)
    for rule in rules:
        if rule.place != "layer" or not rule.when(cfg, layer):
            continue
        shape = tuple(E if dim is None else dim for dim in rule.shape(cfg))
        for expert in (range(E) if rule.per_expert else [None]):
            fmt = {"l": layer, "e": expert}
            specs.append(TensorSpec(rule.hf.format(**fmt), rule.param.format(**fmt), rule.transpose, expert, shape,
                                    rule.name, rule.index))
    return specs


def _global(rule: Rule, cfg) -> TensorSpec:
    return TensorSpec(rule.hf, rule.param, rule.transpose, None, tuple(rule.shape(cfg)), rule.name, rule.index)


# --- pieces every table uses ----------------------------------------------------------------

L = "model.layers.{l}."


def hidden(cfg):
    return cfg.hidden_size


def dense_layer(cfg, layer):
    return not cfg.is_moe_layer(layer)


def moe_layer(cfg, layer):
    return cfg.is_moe_layer(layer)


def embedding_rules() -> tuple:
    """Embedding, final norm and (untied) output head: the same names in every family."""
    return (
        Rule("embed_tokens", "model.embed_tokens.weight", "model.embed_tokens", False,
             lambda cfg: (cfg.vocab_size, cfg.hidden_size), place="head"),
        Rule("final_norm", "model.norm.weight", "model.norm.weight", False, lambda cfg: (cfg.hidden_size,),
             place="head"),
        Rule("lm_head", "lm_head.weight", "lm_head", True, lambda cfg: (cfg.vocab_size, cfg.hidden_size),
             when=lambda cfg, layer: not cfg.tie_word_embeddings, place="tail"),
    )


def norm_rules() -> tuple:
    return (
        Rule("input_layernorm", L + "input_layernorm.weight", L + "input_layernorm.weight", False,
             lambda cfg: (cfg.hidden_size,)),
        Rule("post_attention_layernorm", L + "post_attention_layernorm.weight",
             L + "post_attention_layernorm.weight", False, lambda cfg: (cfg.hidden_size,)),
    )


def swiglu_rules(prefix: str, hf: str, param: str, inner: Callable, when: Callable, names=("gate_proj", "up_proj",
                 "down_proj"), per_expert: bool = False) -> tuple:
    """The three matrices of a SwiGLU MLP: gate and up [inner, H], down [H, inner] (HF layout).
    prefix: rule-name prefix; hf: the HF stem ("model.layers.{l}.mlp." or "...experts.{e}."); param:
    the parameter stem; names: the HF names of gate, up, down (Mixtral's experts: w1, w3, w2)."""
    gate, up, down = names

    def pname(part, hf_part):  # stacked experts: experts_gate, ...; a plain MLP: gate_proj, ...
        return param + (part if per_expert else hf_part)

    return (
        Rule(prefix + "gate", hf + gate + ".weight", pname("gate", "gate_proj"), True,
             lambda cfg: (inner(cfg), cfg.hidden_size), when=when, per_expert=per_expert),
        Rule(prefix + "up", hf + up + ".weight", pname("up", "up_proj"), True,
             lambda cfg: (inner(cfg), cfg.hidden_size), when=when, per_expert=per_expert),
        Rule(prefix + "down", hf + down + ".weight", pname("down", "down_proj"), True,
             lambda cfg: (cfg.hidden_size, inner(cfg)), when=when, per_expert=per_expert),
    )


def moe_rules(block: str = "mlp", expert_names=("gate_proj", "up_proj", "down_proj"),
              balance_bias: bool = False, shared: Callable | None = None, shared_name: str = "shared_experts",
              shared_gate: bool = False) -> tuple:
    """A MoE block's tensors: router (`{block}.gate.weight`, [E, H]), balance bias, routed experts
    (`{block}.experts.{e}.*`), shared experts (`{block}.{shared_name}.*`, inner size `shared(cfg)`,
    in MoE layers where it is > 0) and their sigmoid gate (`{block}.shared_expert_gate.weight`,
    [1, H], Qwen2-MoE). moejax's parameters are the same in every family."""
    stem = L + block + "."
    rules = (
        Rule("router", stem + "gate.weight", L + "mlp.router", False, lambda cfg: (None, cfg.hidden_size),
             when=moe_layer),
    )
    if balance_bias:
        rules += (Rule("balance_bias", stem + "gate.e_score_correction_bias", L + "mlp.bias", False,
                       lambda cfg: (None,), when=moe_layer),)
    rules += swiglu_rules("expert_", stem + "experts.{e}.", L + "mlp.experts_", lambda cfg: cfg.moe_intermediate_size,
                          moe_layer, expert_names, per_expert=True)
    if shared is not None:
        has_shared = lambda cfg, layer: moe_layer(cfg, layer) and shared(cfg) > 0  # noqa: E731
        rules += swiglu_rules("shared_", stem + shared_name + ".", L + "mlp.shared_experts.", shared, has_shared)
        if shared_gate:
            rules += (Rule("shared_expert_gate", stem + "shared_expert_gate.weight", L + "mlp.shared_gate", True,
                           lambda cfg: (1, cfg.hidden_size), when=has_shared),)
    return rules


def is_mtp_layer(cfg, layer) -> bool:
    return layer is not None and layer >= cfg.num_hidden_layers


MTP_PREDICTOR = ("mtp_enorm", "mtp_hnorm", "mtp_eh_proj", "mtp_post_norm")  # rule names


def mtp_rules() -> tuple:
    """An MTP layer's predictor beside its decoder block (layer `num_hidden_layers + j`, DeepSeek-V3's
    names; `moejax.hf.mtp_names` presents Qwen3.5's `mtp.*` under them): the next token's embedding
    norm, the trunk state's norm, their [H, 2H] projection and the final norm
    (`moejax.models.mtp.MtpPredictor`, whose parameters live under `mtp.{l}.`)."""
    h = lambda cfg: (cfg.hidden_size,)  # noqa: E731
    return (
        Rule("mtp_enorm", L + "enorm.weight", "mtp.{l}.enorm.weight", False, h, when=is_mtp_layer),
        Rule("mtp_hnorm", L + "hnorm.weight", "mtp.{l}.hnorm.weight", False, h, when=is_mtp_layer),
        Rule("mtp_eh_proj", L + "eh_proj.weight", "mtp.{l}.eh_proj", True,
             lambda cfg: (cfg.hidden_size, 2 * cfg.hidden_size), when=is_mtp_layer),
        Rule("mtp_post_norm", L + "shared_head.norm.weight", "mtp.{l}.post_norm.weight", False, h, when=is_mtp_layer),
    )


def dense_mlp_rules() -> tuple:
    return swiglu_rules("mlp_", L + "mlp.", L + "mlp.", lambda cfg: cfg.intermediate_size, dense_layer)
