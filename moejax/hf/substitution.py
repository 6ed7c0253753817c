"""MoNE expert substitution in a checkpoint folder: the `constant-v1` format of vLLM's generic
expert substitution (vllm-project/vllm PR #50415, `vllm/model_executor/layers/fused_moe/
expert_substitution.py`), read and written here without JAX.

A substituted MoE layer keeps every router row (and balance-bias entry) and its expert count in
config.json; its retained experts keep their tensors under their *logical* (source) names, and a
substituted expert has no weight tensors at all, only a constant vector [H] that it returns (times
its gate) whenever the router chooses it. config.json declares it:

    "compression_config": {"transform_config": {"expert_substitution": {
        "version": 1,
        "router_semantics": {"preserve_logical_expert_ids": true, "preserve_router_weights": true,
                             "renormalize_after_substitution": false},
        "targets": {"model.layers.3.mlp.experts": {
            "num_logical_experts": 64,
            "weight_layout": "compact_retained_experts",
            "replacements": {"5": {"format": "constant-v1",
                                   "tensors": {"value": "model.layers.3.mlp.experts.5.approx_value"}},
                             ...}}}}}}

What vLLM's parser requires (and `parse_substitution` checks the same way): version 1, exactly
these router semantics, weight_layout `compact_retained_experts`, each replacement's format
`constant-v1` with a `tensors.value` name, one decoder-layer index per target path (its only
integer component), each value a tensor of shape [H], at least one retained expert per layer.
What moejax chooses where the PR leaves a choice: value tensors are named as vLLM's other
declaration (`approximate_experts`, mode-pd's) names them, `{experts prefix}.{e}.approx_value`,
one per substituted expert, stored in float32 (vLLM copies them into its model dtype), in the
shard that holds the layer's router; the target path is the family's experts prefix
(`model.layers.{l}.mlp.experts`; Mixtral `...block_sparse_moe.experts`); `num_logical_experts` is
the layer's expert count. Not read by moejax: the legacy `approximate_experts` key (refused by
name). Stock transformers does not read this format either: it would initialise the missing
experts at random.

Every moejax command except `moejax.surgery.substitute.load_substituted` refuses such a folder by
name (`moejax.hf.check`): its MoE layers have experts without weights, which pruning, scoring,
merging, inspection and diff do not model. The loader reads it through `SubstitutedExpertsView`.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

from moejax.errors import CheckpointError
from moejax.hf.io.safetensors_format import numpy_dtype

FORMAT = "constant-v1"
WHERE = "compression_config.transform_config.expert_substitution"
ROUTER_SEMANTICS = {"preserve_logical_expert_ids": True, "preserve_router_weights": True,
                    "renormalize_after_substitution": False}
WEIGHT_LAYOUT = "compact_retained_experts"
VALUE_SUFFIX = "approx_value"
FLOAT_DTYPES = ("F32", "BF16", "F16")


@dataclasses.dataclass(frozen=True)
class Substitution:
    """What a checkpoint's expert_substitution declares, per MoE layer."""

    prefixes: dict[int, str]             # layer -> the experts prefix ("model.layers.3.mlp.experts")
    n_experts: dict[int, int]            # layer -> num_logical_experts
    values: dict[int, dict[int, str]]    # layer -> {substituted expert: its constant tensor's name}


def value_name(experts_prefix: str, expert: int) -> str:
    """The constant tensor of substituted expert `expert`: `{experts prefix}.{e}.approx_value`."""
    return f"{experts_prefix}.{expert}.{VALUE_SUFFIX}"


def declaration(substituted: dict[int, list[int]], prefixes: dict[int, str], n_experts: dict[int, int]) -> dict:
    """The expert_substitution dictionary for the substituted experts of each layer (ascending),
    their constants named by `value_name`."""
    return {"version": 1, "router_semantics": dict(ROUTER_SEMANTICS), "targets": {
        prefixes[l]: {"num_logical_experts": int(n_experts[l]), "weight_layout": WEIGHT_LAYOUT,
                      "replacements": {str(e): {"format": FORMAT, "tensors": {"value": value_name(prefixes[l], e)}}
                                       for e in sorted(experts)}}
        for l, experts in sorted(substituted.items()) if experts}}


def with_declaration(config: dict, entry: dict) -> dict:
    """config.json with `entry` as its compression_config.transform_config.expert_substitution
    (other keys of an existing compression_config kept)."""
    out = dict(config)
    compression = dict(out.get("compression_config") or {})
    transform = dict(compression.get("transform_config") or {})
    transform["expert_substitution"] = entry
    compression["transform_config"] = transform
    out["compression_config"] = compression
    return out


def _decoder_layer(path: str) -> int | None:
    """vLLM's `decoder_layer_index`: the only integer component of a module path, if unique."""
    numbers = [int(part) for part in path.split(".") if part.isdigit()]
    return numbers[0] if len(numbers) == 1 else None


def check_targets(prefixes: dict[int, str], where) -> None:
    """Refuse, before any pass, experts prefixes ({MoE layer: prefix}) a declaration cannot name as
    vLLM's parser reads it: each target is the decoder layer of the one integer in its path, so that
    integer must be the layer's own index. Qwen3.5-MoE's MTP block, stored apart as
    `mtp.layers.0.mlp.experts`, would read as decoder layer 0."""
    wrong = {l: p for l, p in prefixes.items() if _decoder_layer(p) != l}
    if wrong:
        raise CheckpointError(f"{where}: {FORMAT} names a layer's experts by the one integer in their path, which "
                              f"for {wrong} is not the layer's own index (an MTP block stored apart); substitute "
                              "with --mtp keep (written whole) or --mtp drop")


def parse_substitution(config: dict, where="config.json") -> Substitution | None:
    """The substitution config.json declares (None when it declares none), checked as vLLM checks
    it; anything else raises a CheckpointError naming the key and what was expected."""
    if "approximate_experts" in config:
        raise CheckpointError(f"{where}: declares approximate_experts (mode-pd's form of MoNE expert substitution), "
                              f"which moejax does not read; it reads {WHERE} ({FORMAT})")
    compression = config.get("compression_config")
    transform = compression.get("transform_config") if isinstance(compression, dict) else None
    raw = transform.get("expert_substitution") if isinstance(transform, dict) else None
    if raw is None:
        return None
    problems, prefixes, n_experts, values = [], {}, {}, {}
    try:
        if raw.get("version") != 1:
            problems.append(f"version {raw.get('version')!r}, expected 1")
        if raw.get("router_semantics") != ROUTER_SEMANTICS:
            problems.append(f"router_semantics {raw.get('router_semantics')!r}, expected {ROUTER_SEMANTICS}")
        for path, target in raw["targets"].items():
            layer = _decoder_layer(path)
            if layer is None or layer in prefixes:
                problems.append(f"target {path!r} must name one decoder layer (one integer in its path), once")
                continue
            if target.get("weight_layout") != WEIGHT_LAYOUT:
                problems.append(f"target {path!r}: weight_layout {target.get('weight_layout')!r}, expected {WEIGHT_LAYOUT!r}")
            E = target.get("num_logical_experts")
            if isinstance(E, bool) or not isinstance(E, int) or E < 1:
                problems.append(f"target {path!r}: num_logical_experts {E!r}, expected a positive integer")
                continue
            layer_values = {}
            for expert, replacement in target["replacements"].items():
                name = replacement.get("tensors", {}).get("value") if isinstance(replacement, dict) else None
                if not re.fullmatch(r"\d+", str(expert)) or int(expert) >= E:
                    problems.append(f"target {path!r}: replacement {expert!r} is not an expert index in [0, {E})")
                elif replacement.get("format") != FORMAT or not isinstance(name, str):
                    problems.append(f"target {path!r}: replacement {expert}: expected format {FORMAT!r} with a "
                                    f"tensors.value name, got {replacement!r:.200}")
                else:
                    layer_values[int(expert)] = name
            if len(layer_values) >= E:
                problems.append(f"target {path!r}: substitutes all {E} experts; a layer must retain at least one")
            prefixes[layer], n_experts[layer], values[layer] = path, E, dict(sorted(layer_values.items()))
    except (AttributeError, KeyError, TypeError) as error:
        problems.append(f"malformed ({type(error).__name__}: {error})")
    if problems:
        raise CheckpointError(f"{where}: invalid {WHERE} ({FORMAT}): " + "; ".join(problems))
    return Substitution(prefixes, n_experts, values)


def describe(substitution: Substitution) -> str:
    """'N experts of layers [...]' for messages."""
    n = sum(len(v) for v in substitution.values.values())
    return f"{n} expert(s) of MoE layers {sorted(substitution.values)} substituted by constants"


class SubstitutedExpertsView:
    """A checkpoint reader (`moejax.hf.fused_experts.FusedExpertsReader`) of a substituted checkpoint
    presented as a complete one, for the loader: each substituted expert's tensors appear as zeros
    of the shape and dtype of the same tensors of the layer's first retained expert (never computed:
    `load_substituted`'s ExpertMap marks those slots novice, so their pairs are absent or weighted
    0), and the constant tensors are hidden from `keys` (read them with `constant`). Everything
    else is the wrapped reader's. A family stored only fused (gpt-oss) holds its retained experts
    compacted, row i of each fused tensor the i-th retained expert in ascending order (the format's
    compact_retained_experts), presented here under their logical indices. Refused: a substituted
    expert that still has weight tensors, a missing or non-[H] constant, quantised expert tensors
    (vLLM's loader refuses quantised MoE weights with the format)."""

    def __init__(self, reader, substitution: Substitution, hidden_size: int, fmt: str | None):
        where = reader.directory
        if fmt is not None:
            raise CheckpointError(f"{where}: {describe(substitution)} ({FORMAT}), with quantised ({fmt}) expert "
                                  "tensors; the format holds unquantised expert tensors only")
        self._inner, self.substitution = reader, substitution
        self._zeros: dict[str, str] = {}   # presented name -> the retained tensor it copies shape and dtype from
        self._hidden: set[str] = set()
        self._alias: dict[str, str] = {}   # a compact fused row's logical name -> the inner reader's (row) name
        problems = []
        retained_of = {substitution.prefixes[l]: [e for e in range(substitution.n_experts[l]) if e not in values]
                       for l, values in substitution.values.items()}
        for name in reader.keys():   # compact fused rows (a slab of a fused tensor): row i is retained expert i
            m = re.match(r"(.+\.experts)\.(\d+)\.(.+)$", name)
            if m and m.group(1) in retained_of and reader.holder(name) != reader.stored_name(name):
                retained, row = retained_of[m.group(1)], int(m.group(2))
                if row >= len(retained):
                    problems.append(f"{reader.holder(name)} holds more rows than the {len(retained)} retained experts")
                    continue
                self._alias[f"{m.group(1)}.{retained[row]}.{m.group(3)}"] = name
        self._aliased = set(self._alias.values())
        keys = self.keys()
        for layer, values in substitution.values.items():
            prefix = substitution.prefixes[layer]
            own = {}
            for name in keys:
                if name.startswith(prefix + ".") and (m := re.match(r"(\d+)\.(.+)$", name[len(prefix) + 1:])):
                    own.setdefault(int(m.group(1)), []).append(m.group(2))
            retained = [e for e in range(substitution.n_experts[layer]) if e not in values]
            template = next((e for e in retained if e in own), None)
            if template is None:
                problems.append(f"layer {layer}: no retained expert has tensors under {prefix}.{{e}}.")
                continue
            for e, name in values.items():
                weights = [rest for rest in own.get(e, []) if f"{prefix}.{e}.{rest}" != name]
                if weights:
                    problems.append(f"layer {layer}: expert {e} is substituted but has weight tensors "
                                    f"{[f'{prefix}.{e}.{r}' for r in weights][:3]}")
                if name not in reader:
                    problems.append(f"layer {layer}: expert {e}'s constant {name!r} is missing")
                else:
                    info = reader.info(name)
                    if tuple(info.shape) != (hidden_size,) or info.dtype not in FLOAT_DTYPES:
                        problems.append(f"{name}: {info.dtype} {list(info.shape)}, expected one of {FLOAT_DTYPES} "
                                        f"[{hidden_size}] (hidden_size)")
                    self._hidden.add(name)
                for rest in own[template]:
                    self._zeros[f"{prefix}.{e}.{rest}"] = f"{prefix}.{template}.{rest}"
        if problems:
            raise CheckpointError(f"{where}: {WHERE} ({FORMAT}) does not match the tensors:\n  " + "\n  ".join(problems))

    def __getattr__(self, name):  # directory, storage, reader, fused_names, view_name, expert_slabs, ...
        if name == "_inner":
            raise AttributeError(name)
        return getattr(self._inner, name)

    def _in(self, name: str) -> str:
        """The inner reader's name of a presented one (a compact fused row's: its row's)."""
        return self._alias.get(name, name)

    def keys(self) -> list[str]:
        return sorted((set(self._inner.keys()) - self._hidden - self._aliased) | set(self._alias) | set(self._zeros))

    def __contains__(self, name: str) -> bool:
        return name in self._zeros or name in self._alias or (
            name in self._inner and name not in self._hidden and name not in self._aliased)

    def info(self, name: str):
        if name in self._zeros:  # shape and dtype of its template; no bytes of its own (read_bytes refuses)
            return dataclasses.replace(self._inner.info(self._in(self._zeros[name])), name=name)
        return dataclasses.replace(self._inner.info(self._in(name)), name=name)

    def read(self, name: str) -> np.ndarray:
        if name in self._zeros:
            info = self._inner.info(self._in(self._zeros[name]))
            return np.zeros(info.shape, numpy_dtype(info.dtype, name))
        return self._inner.read(self._in(name))

    def read_rows(self, name: str, start: int, stop: int) -> np.ndarray:
        return self.read(name)[start:stop] if name in self._zeros else self._inner.read_rows(self._in(name), start, stop)

    def shard_of(self, name: str):
        return self._inner.shard_of(self._in(self._zeros.get(name, name)))

    def holder(self, name: str) -> str:
        return self._inner.holder(self._in(self._zeros.get(name, name)))

    def stored_name(self, name: str) -> str:
        return self._inner.stored_name(self._in(name))

    def read_bytes(self, name: str) -> bytes:
        if name in self._zeros:
            raise CheckpointError(f"{self._inner.directory}: {name} belongs to a substituted expert ({FORMAT}) "
                                  "and has no stored bytes")
        return self._inner.read_bytes(self._in(name))

    def constant(self, name: str) -> np.ndarray:
        """A substituted expert's constant [H] in float32."""
        return np.asarray(self._inner.read(name), np.float32)
