"""The MoE structure of a checkpoint, from its tensor names and headers alone.

Checkpoint tools (prune, inspect, diff) work on any registered family's checkpoint without building
a model, so they need to know, per decoder layer: which tensor is the router
(`...{block}.gate.weight`, one row per routed expert), which is the balance bias
(`...{block}.gate.e_score_correction_bias`, in the families that have one), and which tensors
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
    bias: str | None                           # stem + "gate.e_score_correction_bias"
    experts: dict[int, list[str]]              # expert index -> its tensors (sorted names)

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
        return {n for ml in self.moe_layers.values() for n in (ml.router, ml.bias) if n}


def layer_of(name: str) -> int | None:
    """The decoder layer index in a tensor name (`...layers.{l}....`), or None."""
    m = _DECODER.match(name)
    return int(m["layer"]) if m else None


def _patterns(block: str):
    stem = r"^(?P<stem>(?:.*\.)?layers\.(?P<layer>\d+)\." + re.escape(block) + r"\.)"
    return (re.compile(stem + r"experts\.(?P<expert>\d+)\.(?P<rest>.+)$"), re.compile(stem + r"gate\.weight$"),
            re.compile(stem + r"gate\.e_score_correction_bias$"))


def checkpoint_layout(reader: CheckpointReader | FusedExpertsReader, moe_block: str = "mlp") -> CheckpointLayout:
    """Group a checkpoint's tensors into MoE layers; every inconsistency (experts numbered with
    gaps, experts with different tensor sets, a router whose row count is not the expert count, a
    bias of the wrong length) is collected and raised together. Reads headers only."""
    expert_re, router_re, bias_re = _patterns(moe_block)
    routers, biases, experts, other, decoder = {}, {}, {}, [], set()
    stems: dict[int, str] = {}
    for name in reader.keys():
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
        else:
            other.append(name)
    problems, layers = [], {}
    for layer in sorted(set(routers) | set(experts)):
        if layer not in routers:
            problems.append(f"layer {layer}: routed experts but no router tensor {stems[layer]}gate.weight")
            continue
        if layer not in experts:  # a gate.weight without experts is not an MoE router: leave it alone
            other.append(routers.pop(layer))
            continue
        ml = MoeLayer(layer, stems[layer], routers[layer], biases.get(layer),
                      {e: sorted(names) for e, names in sorted(experts[layer].items())})
        problems += _check_layer(ml, reader)
        layers[layer] = ml
    for layer in sorted(set(biases) - set(layers)):
        other.append(biases[layer])
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
    if ml.bias is not None:
        bias = reader.info(ml.bias)
        if tuple(bias.shape) != (E,):
            problems.append(f"{ml.bias}: shape {list(bias.shape)}, expected [{E}]")
    return problems
