"""The MoE structure of a checkpoint, from its tensor names and headers alone.

Checkpoint tools (prune, inspect, diff) work on any registered family's checkpoint without building
a model, so they need to know, per decoder layer: which tensor is the router
(`...{block}.gate.weight`, one row per routed expert), which is the balance bias
(`...{block}.gate.e_score_correction_bias`, in the families that have one) and the router's logit
bias (gpt-oss: `mlp.router.bias`), names the family's table gives, and which tensors
belong to routed expert `e` (`...{block}.experts.{e}.*`, quantisation companions included), where
`{block}` is the family's MoE block (`mlp`; Mixtral: `block_sparse_moe`). Everything else (attention, norms,
shared experts, dense MLPs, embeddings) is "other". MTP layers (index >= num_hidden_layers) are MoE
layers like any other here; callers decide what to do with them.

`moejax.hf.check` builds the layout of a checkpoint's per-expert view (`FusedExpertsReader`), so
a checkpoint with transformers 5's fused expert tensors has the same layout, tensor for tensor, as
the same model saved per expert; writers map the names back to the stored ones.
"""

from __future__ import annotations

import dataclasses
import re

from moejax.errors import CheckpointError
from moejax.hf.fused_experts import FusedExpertsReader
from moejax.hf.io.checkpoint_reader import CheckpointReader

_DECODER = re.compile(r"^(?:.*\.)?layers\.(?P<layer>\d+)\.")


@dataclasses.dataclass
class MoeLayer:
    """One MoE layer's routed-expert tensors and router, by name."""

    layer: int
    stem: str                                  # "model.layers.3.mlp."
    router: str                                # stem + "gate.weight", rows = experts (stem: "...layers.{l}.{block}.")
    bias: str | None                           # stem + "gate.e_score_correction_bias" (the balance bias)
    experts: dict[int, list[str]]              # expert index -> its tensors (sorted names)
    router_bias: str | None = None             # stem + "router.bias": the router's logit bias (gpt-oss)

    @property
    def per_expert_rows(self) -> tuple[str, ...]:
        """The tensors with one row per routed expert beside the experts: router, biases."""
        return tuple(n for n in (self.router, self.bias, self.router_bias) if n)

    @property
    def n_experts(self) -> int:
        return len(self.experts)

    def expert_tensor(self, expert: int, rest: str) -> str:
        return f"{self.stem}experts.{expert}.{rest}"

    def rests(self) -> list[str]:
        """Tensor suffixes after `experts.{e}.` (the same for every expert, checked)."""
        prefix = len(self.expert_tensor(0, ""))
        return [name[prefix:] for name in self.experts[0]]


@dataclasses.dataclass
class CheckpointLayout:
    moe_layers: dict[int, MoeLayer]            # layer index -> MoE layer, ascending
    decoder_layers: list[int]                  # every `layers.{l}.` index seen, ascending
    other: list[str]                           # every tensor that is not a routed expert, router or bias

    def routed_names(self) -> set[str]:
        return {n for ml in self.moe_layers.values() for names in ml.experts.values() for n in names}

    def router_names(self) -> set[str]:
        return {n for ml in self.moe_layers.values() for n in ml.per_expert_rows}


def layer_of(name: str) -> int | None:
    """The decoder layer index in a tensor name (`...layers.{l}....`), or None."""
    m = _DECODER.match(name)
    return int(m["layer"]) if m else None


def _in_block(family, rule: str) -> str | None:
    """What follows `{block}.` in the family's name of `rule` ("gate.weight"), None without the rule."""
    r = family.rule(rule)
    return None if r is None else r.hf.split(f".{family.moe_block}.", 1)[1]


def _patterns(family):
    stem = r"^(?P<stem>(?:.*\.)?layers\.(?P<layer>\d+)\." + re.escape(family.moe_block) + r"\.)"

    def tail(rule):  # a family without the rule: a pattern that matches nothing
        rest = _in_block(family, rule)
        return re.compile(r"(?!)" if rest is None else stem + re.escape(rest) + "$")

    return (re.compile(stem + r"experts\.(?P<expert>\d+)\.(?P<rest>.+)$"), tail("router"), tail("balance_bias"),
            tail("router_bias"))


def checkpoint_layout(reader: CheckpointReader | FusedExpertsReader, family) -> CheckpointLayout:
    """Group a checkpoint's tensors into MoE layers, by the names of `family`'s table (its MoE
    block, router, balance bias and router bias); every inconsistency (experts numbered with gaps,
    experts with different tensor sets, a router whose row count is not the expert count, a bias of
    the wrong length) is collected and raised together. Reads headers only."""
    expert_re, router_re, bias_re, router_bias_re = _patterns(family)
    routers, biases, router_biases, experts, other, decoder = {}, {}, {}, {}, [], set()
    stems: dict[int, str] = {}
    carried = family.config_class.CARRIED_PREFIXES  # a vision tower, an MTP block: never a decoder layer
    for name in reader.keys():
        if name.startswith(carried):
            other.append(name)
            continue
        if m := _DECODER.match(name):
            decoder.add(int(m["layer"]))
        if m := expert_re.match(name):
            layer = int(m["layer"])
            experts.setdefault(layer, {}).setdefault(int(m["expert"]), []).append(name)
            stems[layer] = m["stem"]
        elif m := router_re.match(name):
            routers[int(m["layer"])] = name
            stems[int(m["layer"])] = m["stem"]
        elif m := bias_re.match(name):
            biases[int(m["layer"])] = name
        elif m := router_bias_re.match(name):
            router_biases[int(m["layer"])] = name
        else:
            other.append(name)
    problems, layers = [], {}
    for layer in sorted(set(routers) | set(experts)):
        if layer not in routers:
            problems.append(f"layer {layer}: routed experts but no router tensor {stems[layer]}{_in_block(family, 'router')}")
            continue
        if layer not in experts:  # a gate.weight without experts is not an MoE router: leave it alone
            other.append(routers.pop(layer))
            continue
        ml = MoeLayer(layer, stems[layer], routers[layer], biases.get(layer),
                      {e: sorted(names) for e, names in sorted(experts[layer].items())}, router_biases.get(layer))
        problems += _check_layer(ml, reader)
        layers[layer] = ml
    for layer in sorted(set(biases) - set(layers)):
        other.append(biases[layer])
    for layer in sorted(set(router_biases) - set(layers)):
        other.append(router_biases[layer])
    if problems:
        raise CheckpointError(f"{reader.directory}: MoE tensors are inconsistent:\n  " + "\n  ".join(problems))
    return CheckpointLayout(layers, sorted(decoder), sorted(other))


def _check_layer(ml: MoeLayer, reader: CheckpointReader) -> list[str]:
    problems = []
    E = ml.n_experts
    if sorted(ml.experts) != list(range(E)):
        missing = sorted(set(range(max(ml.experts) + 1)) - set(ml.experts))
        problems.append(f"layer {ml.layer}: experts numbered with gaps (missing {missing[:8]})")
        return problems
    reference = ml.rests()
    for e in range(1, E):
        rests = [n[len(ml.expert_tensor(e, "")):] for n in ml.experts[e]]
        if rests != reference:
            problems.append(f"layer {ml.layer}: expert {e} has tensors {rests}, expert 0 has {reference}")
            break
    router = reader.info(ml.router)
    if len(router.shape) != 2 or router.shape[0] != E:
        problems.append(f"{ml.router}: shape {list(router.shape)}, expected [{E}, hidden] for {E} experts")
    for name in (ml.bias, ml.router_bias):
        if name is not None and tuple(reader.info(name).shape) != (E,):
            problems.append(f"{name}: shape {list(reader.info(name).shape)}, expected [{E}]")
    return problems
