"""What every family's config shares: the fields every MoE language model has, the one reader of
config.json (strict: each key's type and range checked), and the questions the rest of moejax asks a
config without knowing its family.

A family config is a frozen dataclass inheriting `MoeConfig`. Each config.json key it reads is a
field, declared once with `key(rule, default, aliases=, experts=)`: its type/range rule, the other
spellings transformers reads as the same setting, and (experts=True) that it holds the routed-expert
count; FIELD_RULES, ALIASES, EXPERTS_FIELD and EXPERTS_KEYS are read off the fields. A size field
inherited without a default gets the family's in its `DEFAULTS`. Every key moejax reads is checked
before use (an integer size must be a JSON integer, not `"8"`, `8.0` or `true`); every problem is
reported together in one `ConfigError` naming the file, the key, the value given and what was
expected. `raw` keeps the file's dictionary, so a checkpoint written back carries the same config,
spelling included.
"""

from __future__ import annotations

import dataclasses
import json
import math
import operator
from pathlib import Path
from typing import ClassVar

from moejax.errors import ConfigError

# --- checking values ----------------------------------------------------------------------------

def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


# rule: (accepts(value), what was expected)
POS_INT = (lambda v: is_int(v) and v > 0, "a positive integer")
NONNEG_INT = (lambda v: is_int(v) and v >= 0, "a non-negative integer")
POS_INT_OR_NULL = (lambda v: v is None or (is_int(v) and v > 0), "a positive integer or null")
POS_NUMBER = (lambda v: is_number(v) and v > 0, "a positive finite number")
POS_NUMBER_OR_NULL = (lambda v: v is None or (is_number(v) and v > 0), "a positive finite number or null")
NONNEG_NUMBER_OR_NULL = (lambda v: v is None or (is_number(v) and v >= 0), "a non-negative finite number or null")
BOOL = (lambda v: isinstance(v, bool), "true or false")
STRING = (lambda v: isinstance(v, str), "a string")
INT_LIST = (lambda v: isinstance(v, list) and all(is_int(x) and x >= 0 for x in v),
            "a list of non-negative integers")
FRACTION = (lambda v: is_number(v) and 0 < v <= 1, "a number in (0, 1]")


def show(value) -> str:
    """The value as the file spells it, and its Python type: `"8" (str)`, `true (bool)`."""
    try:
        text = json.dumps(value, allow_nan=True)
    except (TypeError, ValueError):
        text = repr(value)
    if len(text) > 80:
        text = text[:77] + "..."
    return f"{text} ({type(value).__name__})"


def check(key: str, value, rule, problems: list) -> bool:
    ok, expected = rule
    if ok(value):
        return True
    problems.append(f"{key}={show(value)}, expected {expected}")
    return False


def check_fields(given: dict, rules: dict, problems: list) -> dict:
    """The fields of `given` that pass their rule; a problem for each that does not."""
    return {k: v for k, v in given.items() if check(k, v, rules[k], problems)}


def message(source: str, problems: list, unimplemented: list) -> str:
    parts = list(problems)
    if unimplemented:
        parts.append("not implemented: " + "; ".join(unimplemented))
    return f"{source}: " + "; ".join(parts)


# --- declaring fields ----------------------------------------------------------------------------

def key(rule, default=dataclasses.MISSING, *, aliases: tuple = (), experts: bool = False):
    """A config field: config.json's key of the same name (and `aliases`, the other spellings
    transformers reads as the same attribute), checked by `rule`; experts=True marks the field
    holding the routed-expert count. A field without a default gets each family's in its DEFAULTS."""
    return dataclasses.field(default=default, metadata={"rule": rule, "aliases": tuple(aliases), "experts": experts})


class _FromFields:
    """A class attribute read off the `key` metadata of the class's fields (once per class)."""

    def __init__(self, read):
        self.read, self.by_class = read, {}

    def __get__(self, obj, cls):
        if cls not in self.by_class:
            self.by_class[cls] = self.read([f for f in dataclasses.fields(cls) if f.metadata.get("rule")])
        return self.by_class[cls]


def _experts_keys(fields) -> tuple:
    """The field marked experts=True, then its aliases."""
    marked = [f for f in fields if f.metadata["experts"]]
    if len(marked) != 1:
        raise TypeError(f"a family config marks one field experts=True, not {[f.name for f in marked]}")
    return (marked[0].name, *marked[0].metadata["aliases"])


# What a family config defines (itself or through a mixin), checked when the class is made:
# `_read_rest(d, valid, merged, problems, unimplemented, uniform_experts) -> dict` reads what the
# fields do not say (rope, relations between fields, per-layer expert counts), noting problems and
# returning the remaining constructor arguments (`valid`: the fields given with good values;
# `merged`: those over the defaults, less the fields given with bad values).
FAMILY_HOOKS = ("_read_rest", "is_moe_layer", "router_settings")


def family_config(title: str, model_types: tuple, architecture: str):
    """The decorator of a family's config class: the family's name (TITLE), its config.json
    model_type values (MODEL_TYPES, the first the one written) and transformers architecture
    (ARCHITECTURE: also the name of its NNX model class); its DEFAULTS made the defaults of the
    fields it inherits (their type, rule and aliases stay where they are declared); a frozen,
    keyword-only dataclass."""

    def make(cls):
        missing = [hook for hook in FAMILY_HOOKS if not callable(getattr(cls, hook, None))]
        if missing:
            raise TypeError(f"{cls.__name__}: a family config defines {missing} (see MoeConfig's docstring)")
        cls.TITLE, cls.MODEL_TYPES, cls.ARCHITECTURE = title, tuple(model_types), architecture
        inherited = {f.name: f for base in reversed(cls.__mro__[1:]) if dataclasses.is_dataclass(base)
                     for f in dataclasses.fields(base)}
        annotations = cls.__dict__.get("__annotations__")
        if annotations is None:
            cls.__annotations__ = annotations = {}
        for name, default in cls.__dict__.get("DEFAULTS", {}).items():
            if name not in inherited:
                raise TypeError(f"{cls.__name__}.DEFAULTS: {name!r} is not a field {cls.__name__} inherits")
            f = inherited[name]
            annotations[name] = f.type
            setattr(cls, name, dataclasses.field(default=default, repr=f.repr, compare=f.compare, hash=f.hash,
                                                 metadata=f.metadata, kw_only=True))
        return dataclasses.dataclass(frozen=True, kw_only=True)(cls)

    return make


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoeConfig:
    """The base of the family configs: the fields every family reads (the sizes without a default:
    each family states its own in `DEFAULTS`), the reader (`from_dict`) and the questions asked of
    any config. A family config (decorated with `family_config`) also states the settings it
    refuses (`UNIMPLEMENTED`: config.json key -> (accepts, what is implemented)),
    `is_moe_layer(layer)`, `router_settings()` (the keyword arguments of
    `moejax.moe.routing.RouterConfig`, a dict so configs stay JAX-free), `_read_rest` (what the
    fields do not say: rope, relations between fields, per-layer expert counts) and `_written` (the
    config.json keys `default_dict` writes beside the fields)."""

    TITLE: ClassVar[str]                                # these three: see `family_config`
    MODEL_TYPES: ClassVar[tuple]
    ARCHITECTURE: ClassVar[str]
    DEFAULTS: ClassVar[dict] = {}                       # inherited field -> this family's default
    UNIMPLEMENTED: ClassVar[dict] = {}
    HAS_BALANCE_BIAS: ClassVar[bool] = False            # e_score_correction_bias beside the router
    HAS_ROUTER_BIAS: ClassVar[bool] = False             # a bias added to the router logits (gpt-oss)
    NORM_SCALES_IN_FLOAT32: ClassVar[bool] = False      # RMSNorm scales before casting back (gpt-oss)
    NORM_PLUS_ONE: ClassVar[bool] = False               # RMSNorm scales by 1 + weight (Qwen3-Next)
    EXPERT_KIND: ClassVar[str] = "swiglu"               # a key of moejax.moe.dispatch.EXPERT_SHAPES
    # A multimodal wrapper's config (Qwen3.5-MoE): the key of the language model's settings inside it
    # (read and rewritten there; the wrapper's other keys, vision_config included, are kept as they are)
    TEXT_CONFIG: ClassVar[str | None] = None
    # Other spellings of ARCHITECTURE config.json may give (transformers' class where the Hub's remote
    # code names it otherwise: Kimi-K2.5's Kimi_K25ForConditionalGeneration)
    ARCHITECTURE_SPELLINGS: ClassVar[tuple] = ()
    # Tensors with no parameter that the checkpoint carries byte for byte (a vision tower, an MTP
    # block transformers does not read): name prefixes
    CARRIED_PREFIXES: ClassVar[tuple] = ()
    # The prefix of an MTP block moejax carries and never runs (`moejax.hf.mtp_names.carried_mtp_block`:
    # --mtp keep or drop only); None where MTP layers, if any, are decoder layers moejax runs
    MTP_CARRIED: ClassVar[str | None] = None
    num_nextn_predict_layers = 0                        # MTP layers after the decoder layers (a field where read)
    # The checkpoint passes this family cannot run yet: {the pass as `require_passes` names it (the
    # start of its `what`): why}; empty when every pass runs
    PASSES_NOT_IMPLEMENTED: ClassVar[dict] = {}

    # field (= its config.json key) -> (accepts, expected) type/range rule
    FIELD_RULES = _FromFields(lambda fields: {f.name: f.metadata["rule"] for f in fields})
    # other config.json spellings -> field (transformers' attribute_map)
    ALIASES = _FromFields(lambda fields: {alias: f.name for f in fields for alias in f.metadata["aliases"]})
    # the field holding the routed-expert count, and its config.json spellings, preferred first
    EXPERTS_FIELD = _FromFields(lambda fields: _experts_keys(fields)[0])
    EXPERTS_KEYS = _FromFields(_experts_keys)

    vocab_size: int = key(POS_INT)
    hidden_size: int = key(POS_INT)
    intermediate_size: int = key(POS_INT)
    num_hidden_layers: int = key(POS_INT)
    num_attention_heads: int = key(POS_INT)
    num_experts_per_tok: int = key(POS_INT)
    rms_norm_eps: float = key(POS_NUMBER)
    max_position_embeddings: int = key(POS_INT)
    tie_word_embeddings: bool = key(BOOL, False)
    # moe_sparsity_config.num_experts of a checkpoint pruned per layer (one entry a layer, None for
    # dense layers); None when the config has none. See `experts_in_layer`.
    layer_num_experts: tuple[int | None, ...] | None = None
    raw: dict = dataclasses.field(default_factory=dict, compare=False, hash=False, repr=False)

    # --- the routed experts -------------------------------------------------------------------
    @property
    def n_experts(self) -> int:
        """Routed experts per MoE layer (the family's key: n_routed_experts, num_experts, ...)."""
        return getattr(self, self.EXPERTS_FIELD)

    @property
    def experts_key(self) -> str:
        """The config.json key that holds the expert count, as the source spells it (a pruned
        checkpoint updates that key, so it keeps the source's spelling)."""
        raw = self.settings_dict()
        return next((k for k in self.EXPERTS_KEYS if k in raw), self.EXPERTS_KEYS[0])

    def keys_of(self, field: str) -> list[str]:
        """The config.json keys spelling `field` in this config's source (its own name and its
        aliases; at least its own name): a copy that changes the setting updates every one, or
        the spellings would disagree."""
        raw = self.settings_dict()
        keys = [field] + [key for key, target in self.ALIASES.items() if target == field]
        return [key for key in keys if key in raw] or [field]

    @property
    def moe_layers(self) -> list[int]:
        return [l for l in range(self.num_hidden_layers) if self.is_moe_layer(l)]

    def experts_in_layer(self, layer: int) -> int:
        """The routed experts decoder layer `layer` holds: its entry of moe_sparsity_config.num_experts
        when the config lists per-layer counts (a checkpoint pruned per layer, read with
        uniform_experts=False), n_experts otherwise; 0 for a dense layer. MTP layers
        (num_hidden_layers .. num_hidden_layers + num_nextn_predict_layers - 1) count too."""
        n_layers = self.num_hidden_layers + self.num_nextn_predict_layers
        try:
            index = operator.index(layer)
        except TypeError:
            index = None
        if index is None or isinstance(layer, bool) or not 0 <= index < n_layers:
            raise ConfigError(f"experts_in_layer: layer={layer!r}; expected an integer in [0, {n_layers}) "
                              f"(num_hidden_layers={self.num_hidden_layers} + num_nextn_predict_layers="
                              f"{self.num_nextn_predict_layers})")
        if not self.is_moe_layer(index):
            return 0
        if self.layer_num_experts is not None and index < len(self.layer_num_experts):
            return self.layer_num_experts[index]
        return self.n_experts

    @property
    def per_layer_experts(self) -> bool:
        """True when MoE layers hold different expert counts (a checkpoint pruned per layer: each
        layer is built with its own count, `experts_in_layer`; variant masks stay n_experts wide)."""
        return len({self.experts_in_layer(l) for l in self.moe_layers}) > 1

    def is_kept_whole(self, layer: int) -> bool:
        """Whether MoE layer `layer`'s experts are outside every pass that chooses experts: never
        scored, pruned, merged or substituted, and a variant leaves them as they are (DeepSeek-V4's
        hash layers, whose experts a token-id table gives, `docs/families.md`)."""
        return False

    @property
    def scored_layers(self) -> list[int]:
        """The MoE layers the passes score and change: `moe_layers` less those kept whole."""
        return [l for l in self.moe_layers if not self.is_kept_whole(l)]

    def require_passes(self, what: str) -> None:
        """Refuse, naming the family and the reason, a pass this family cannot run yet (rather than
        compute something wrong): `what` names the pass, and starts with its `PASSES_NOT_IMPLEMENTED` key."""
        why = next((why for key, why in self.PASSES_NOT_IMPLEMENTED.items() if what.startswith(key)), None)
        if why:
            raise ConfigError(f"{self.TITLE}: {what} is not implemented for this family yet: {why}")

    # --- the router and the MoE block ---------------------------------------------------------
    @property
    def n_group(self) -> int:
        """Routing groups (1 = none): what group-aware pruning must respect."""
        return self.router_settings().get("n_group", 1)

    @property
    def shared_intermediate_size(self) -> int:
        """Inner width of the shared expert MLP of each MoE layer (0 = none)."""
        return 0

    def expert_fn(self):
        """The routed experts' function `expert_fn(linear, w, x)` (`moejax.moe.dispatch`; imports JAX)."""
        from moejax.moe import dispatch

        return dispatch.swiglu

    def shared_expert_fn(self):
        """The shared experts' SwiGLU (`expert_fn`'s form; DeepSeek-V4's clamps as its routed experts)."""
        from moejax.moe import dispatch

        return dispatch.swiglu

    @property
    def quantization_config(self) -> dict | None:
        return (getattr(self, "raw", None) or {}).get("quantization_config")

    # --- reading ------------------------------------------------------------------------------
    @classmethod
    def from_json_file(cls, path, *, uniform_experts: bool = True):
        return cls.from_dict(read_json_object(path), source=str(path), uniform_experts=uniform_experts)

    @classmethod
    def from_dict(cls, d: dict, source: str = "config", *, uniform_experts: bool = True):
        """Read a config.json dictionary. Wrong types and ranges, disagreeing spellings, inconsistent
        sizes and settings moejax does not implement are all collected and raised as one ConfigError.

        uniform_experts: refuse (the default) a moe_sparsity_config.num_experts that gives layers
        different expert counts, for a caller that needs one count in every layer. The loader, scoring
        and prune pass False and ask `experts_in_layer` (the model builds each layer with its count)."""
        check_family(d, source, cls.MODEL_TYPES, (cls.ARCHITECTURE, *cls.ARCHITECTURE_SPELLINGS), cls.TITLE,
                     wrapper=cls.TEXT_CONFIG is not None)
        outer = d
        d = dict(cls._settings_of(d, source))
        problems: list[str] = []        # wrong types, ranges and inconsistencies
        unimplemented: list[str] = []   # valid settings moejax does not implement
        given, spelled = {}, {}         # field -> the value given, and the key that gave it
        agreeing = []                   # (key, field): a second spelling, equal to the first
        for name, field in cls.config_keys().items():
            if name not in d:
                continue
            if field not in given:
                given[field], spelled[field] = d[name], name
            elif d[name] != given[field]:
                problems.append(f"{name}={show(d[name])} disagrees with {spelled[field]}={show(given[field])} "
                                "(two spellings of one setting)")
            else:
                agreeing.append((name, field))
        valid = {f: v for f, v in given.items() if check(spelled[f], v, cls.FIELD_RULES[f], problems)}
        for name, field in agreeing:    # equal is not enough: 8.0 == 8 and false == 0
            if field in valid:
                check(name, d[name], cls.FIELD_RULES[field], problems)
        for name, (accepts, what) in cls.UNIMPLEMENTED.items():
            if name in d and not accepts(d[name]):
                unimplemented.append(f"{name}={show(d[name])} ({what})")
        # every field's value for the checks between fields; a key given with a bad value has none
        merged = {f: v for f, v in {**cls.field_defaults(), **valid}.items() if f in valid or f not in given}
        rest = cls._read_rest(d, valid, merged, problems, unimplemented, uniform_experts)
        if problems or unimplemented:
            raise ConfigError(message(source, problems, unimplemented))
        return cls(**valid, **rest, raw=outer)

    @classmethod
    def config_keys(cls) -> dict:
        """config.json key -> field: every field under its own name, and the aliases."""
        return {**{f: f for f in cls.FIELD_RULES}, **cls.ALIASES}

    @classmethod
    def field_defaults(cls) -> dict:
        """field -> its default (this family's), for the fields read from config.json."""
        return {f.name: f.default for f in dataclasses.fields(cls) if f.name in cls.FIELD_RULES}

    @classmethod
    def _settings_of(cls, d: dict, source: str) -> dict:
        """The dictionary the fields are read from: config.json itself, or a wrapper's TEXT_CONFIG."""
        if cls.TEXT_CONFIG is None:
            return d
        inner = d.get(cls.TEXT_CONFIG)
        if not isinstance(inner, dict):
            raise ConfigError(f"{source}: {cls.TEXT_CONFIG}={show(inner)}, expected an object (the language model's "
                              f"config inside the {cls.TITLE} wrapper)")
        return inner

    def settings_dict(self) -> dict:
        """A copy of the dictionary holding the settings (config.json, or a wrapper's TEXT_CONFIG):
        what a writer changes, then gives back to `with_settings`."""
        raw = self.to_dict()
        return dict(raw.get(self.TEXT_CONFIG) or {}) if self.TEXT_CONFIG else raw

    def with_settings(self, settings: dict) -> dict:
        """config.json with `settings` (an edited `settings_dict()`) in their place."""
        return {**self.to_dict(), self.TEXT_CONFIG: settings} if self.TEXT_CONFIG else dict(settings)

    def to_dict(self) -> dict:
        """The config as written to config.json: the source dictionary when there is one."""
        if getattr(self, "raw", None):
            return dict(self.raw)
        return self.default_dict()

    def default_dict(self) -> dict:
        """config.json written from the fields (a config built in code, without a source file)."""
        d = {field: getattr(self, field) for field in self.FIELD_RULES}
        d.update(model_type=self.MODEL_TYPES[0], architectures=[self.ARCHITECTURE], **self._written())
        if self.layer_num_experts is not None:
            d["moe_sparsity_config"] = {"method": "prune", "num_experts": list(self.layer_num_experts)}
        return d

    def _written(self) -> dict:
        """config.json keys `default_dict` writes beside the fields."""
        return {}


@dataclasses.dataclass(frozen=True, kw_only=True)
class SigmoidGroupRouter:
    """DeepSeek-V3's MoE settings, which GLM-4.5 shares: sigmoid scores with a balance bias,
    group-limited top-k, `norm_topk_prob`, `routed_scaling_factor`, `n_shared_experts` shared
    experts of `moe_intermediate_size` each, dense layers before `first_k_dense_replace`, and
    multi-token-prediction layers on disk after the decoder layers (`num_nextn_predict_layers`)."""

    HAS_BALANCE_BIAS: ClassVar[bool] = True

    moe_intermediate_size: int = key(POS_INT)
    n_routed_experts: int = key(POS_INT, aliases=("num_local_experts",), experts=True)
    n_shared_experts: int = key(NONNEG_INT, 1)
    routed_scaling_factor: float = key(POS_NUMBER)
    n_group: int = key(POS_INT)
    topk_group: int = key(POS_INT)
    first_k_dense_replace: int = key(NONNEG_INT)
    norm_topk_prob: bool = key(BOOL, True)
    # indices num_hidden_layers .. num_hidden_layers + this - 1
    num_nextn_predict_layers: int = key(NONNEG_INT, 0, aliases=("num_mtp_layers",))

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace

    def router_settings(self) -> dict:
        return dict(top_k=self.num_experts_per_tok, scoring_func="sigmoid", n_group=self.n_group,
                    topk_group=self.topk_group, norm_topk_prob=self.norm_topk_prob,
                    routed_scaling_factor=self.routed_scaling_factor)

    @property
    def shared_intermediate_size(self) -> int:
        return self.moe_intermediate_size * self.n_shared_experts


def read_json_object(path) -> dict:
    """config.json as a dict: UTF-8, valid JSON, no key given twice in one object (JSON readers keep
    the last silently). Raises ConfigError naming the file."""
    path = Path(path)
    try:
        text = path.read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: config.json not found") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text ({e}); config.json must be a UTF-8 JSON file") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read config.json ({e.strerror or e})") from None
    repeated: list[str] = []
    try:
        d = json.loads(text, object_pairs_hook=lambda pairs: _object_noting_repeats(pairs, repeated))
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    if repeated:
        raise ConfigError(f"{path}: key(s) {sorted(set(repeated))} given more than once in one object "
                          "(JSON readers keep the last silently); remove the repeats")
    return d


def _object_noting_repeats(pairs: list, repeated: list) -> dict:
    out = dict(pairs)
    if len(out) < len(pairs):
        seen = set()
        for key, _ in pairs:
            if key in seen:
                repeated.append(key)
            seen.add(key)
    return out


def check_family(d, source: str, model_types: tuple, architectures: tuple, family: str, wrapper: bool = False) -> list:
    """Refuse a non-object, a multimodal wrapper (unless the family is one: `wrapper`), and another
    family's model_type/architectures (the family's spellings: `architectures`, the first the one
    written); returns the architectures list."""
    if not isinstance(d, dict):
        raise ConfigError(f"{source}: expected a JSON object (a {family} config), got {show(d)}")
    if "text_config" in d and "hidden_size" not in d and not wrapper:
        raise ConfigError(f"{source}: multimodal config (text_config) is not supported; pass the text model's config")
    archs = d.get("architectures") or [architectures[0]]
    if not isinstance(archs, list):
        raise ConfigError(f"{source}: architectures={show(archs)}, expected a list of class names")
    # the family comes from model_type, else from architectures (moejax.models.registry.family_for):
    # a config that names only its architecture is read as that architecture's
    named_by_architecture = d.get("model_type") is None and "architectures" in d
    if (d.get("model_type") not in model_types and not named_by_architecture) or not set(architectures) & set(archs):
        raise ConfigError(f"{source}: model_type={d.get('model_type')!r}, architectures={archs}; expected model_type "
                          f"in {list(model_types)} with architecture {' or '.join(architectures)}")
    return archs


def layer_num_experts(d: dict, n_layers, n_mtp, n_experts, experts_key: str, is_dense, problems: list,
                      unimplemented: list, uniform: bool, router: dict | None = None) -> tuple | None:
    """moe_sparsity_config.num_experts, checked: one entry per decoder layer (MTP layers optional),
    null for a dense layer, a positive integer <= the expert count for a MoE layer (an MTP layer
    may hold more: kept whole beside a pruned trunk, `--mtp keep`), the decoder layers' largest
    equal to the expert count (`experts_key`, what the model's variant masks are as wide as), and
    each a count the router can route over (router: the `router_settings()` keys top_k, n_group,
    topk_group; at least top_k experts, and with routing groups a multiple of n_group with at least
    2 per group and top_k within topk_group groups). is_dense(layer): None when the config's own
    fields were wrong (already reported). uniform: refuse different counts in different layers (a
    caller that needs one count everywhere)."""
    sparsity = d.get("moe_sparsity_config")
    if sparsity is None:
        return None
    if not isinstance(sparsity, dict):
        problems.append(f"moe_sparsity_config={show(sparsity)}, expected an object")
        return None
    counts = sparsity.get("num_experts")
    if counts is None:
        return None
    key = "moe_sparsity_config.num_experts"
    if not isinstance(counts, list):
        problems.append(f"{key}={show(counts)}, expected a list with one entry per layer")
        return None
    if n_layers is not None and n_mtp is not None and len(counts) not in (n_layers, n_layers + n_mtp):
        lengths = f"{n_layers}" + (f" or {n_layers + n_mtp}" if n_mtp else "")
        problems.append(f"{key} has {len(counts)} entries, expected {lengths} (num_hidden_layers="
                        f"{n_layers}, num_nextn_predict_layers={n_mtp})")
    ok = True
    for layer, n in enumerate(counts):
        dense = is_dense(layer)
        if n is None:
            if dense is False:
                problems.append(f"{key}[{layer}]=null, but layer {layer} is a MoE layer; expected a positive integer")
                ok = False
        elif not check(f"{key}[{layer}]", n, (POS_INT[0], "a positive integer (null for a dense layer)"), problems):
            ok = False
        elif dense:
            problems.append(f"{key}[{layer}]={n}, but layer {layer} is dense; expected null")
            ok = False
        elif n_experts is not None and n > n_experts and (n_layers is None or layer < n_layers):
            problems.append(f"{key}[{layer}]={n} exceeds {experts_key}={n_experts}")
            ok = False
        elif router is not None and (wrong := _unroutable(n, **router)):
            problems.append(f"{key}[{layer}]={n}: {wrong}")
            ok = False
    distinct = sorted({n for n in counts if is_int(n)})
    if uniform and len(distinct) > 1:
        unimplemented.append(f"{key} gives layers different expert counts {distinct} (this command needs one "
                             "expert count in every layer; moejax loads, scores, evaluates and prunes such a "
                             "checkpoint, `moejax merge` and the prune_real and eval_tasks experiments do not)")
        ok = False
    elif ok and n_experts is not None and distinct and _largest(counts, n_layers) != n_experts:
        distinct = sorted({n for n in counts[:n_layers] if is_int(n)})
        spread = f"every MoE layer {distinct[0]}" if len(distinct) == 1 else f"at most {distinct[-1]}"
        problems.append(f"{key} gives {spread} experts but {experts_key}={n_experts} (expected the largest count)")
        ok = False
    return tuple(counts) if ok else None


def _largest(counts: list, n_layers) -> int:
    """The largest count of the decoder layers (an MTP layer kept whole beside a pruned trunk,
    `--mtp keep`, may hold more experts than the config's count)."""
    return max((n for n in counts[:n_layers] if is_int(n)), default=0)


def _unroutable(n: int, top_k: int, n_group: int = 1, topk_group: int = 1, **_) -> str | None:
    """Why a MoE layer of n routed experts cannot route (None when it can): fewer than top_k
    experts, or (routing groups) n not a multiple of n_group, fewer than 2 per group (the group
    score sums each group's best 2), or top_k beyond the topk_group groups chosen."""
    if n < top_k:
        return f"fewer experts than num_experts_per_tok={top_k}"
    if n_group > 1:
        if n % n_group:
            return f"not divisible by n_group={n_group} (each routing group keeps an equal share)"
        if n // n_group < 2:
            return f"{n // n_group} expert(s) per routing group (n_group={n_group}); group-limited routing needs 2"
        if top_k > topk_group * (n // n_group):
            return (f"num_experts_per_tok={top_k} exceeds the experts of the chosen groups "
                    f"(topk_group={topk_group} x {n // n_group})")
    return None
