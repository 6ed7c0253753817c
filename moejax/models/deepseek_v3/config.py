"""DeepSeek-V3-family configuration (DeepSeek-V3/V3.1/R1, Kimi-K2, Moonlight): read `config.json`,
resolve the rope settings the way transformers does, refuse what moejax does not implement.

`raw` keeps the file's dictionary untouched, so a checkpoint written back carries an equivalent
(indeed identical) config, quantization_config and unknown keys included.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

from moejax.errors import ConfigError

MODEL_TYPES = ("deepseek_v3", "kimi_k2")
ARCHITECTURE = "DeepseekV3ForCausalLM"


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    rope_type: str = "default"          # "default" or "yarn"
    theta: float = 10000.0
    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True


@dataclasses.dataclass(frozen=True)
class DeepseekV3Config:
    vocab_size: int = 129280
    hidden_size: int = 7168
    intermediate_size: int = 18432
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 61
    num_attention_heads: int = 128
    n_shared_experts: int = 1
    n_routed_experts: int = 256
    routed_scaling_factor: float = 2.5
    kv_lora_rank: int = 512
    q_lora_rank: int | None = 1536
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    qk_nope_head_dim: int = 128
    n_group: int = 8
    topk_group: int = 4
    num_experts_per_tok: int = 8
    first_k_dense_replace: int = 3
    norm_topk_prob: bool = True
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    rope_interleave: bool = True
    attention_bias: bool = False
    rope: RopeConfig = RopeConfig()
    raw: dict = dataclasses.field(default_factory=dict, compare=False, hash=False, repr=False)

    # --- derived sizes -------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace

    @property
    def moe_layers(self) -> list[int]:
        return [l for l in range(self.num_hidden_layers) if self.is_moe_layer(l)]

    @property
    def quantization_config(self) -> dict | None:
        return self.raw.get("quantization_config")

    def softmax_scale(self) -> float:
        """qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 for YaRN (transformers)."""
        scale = self.qk_head_dim ** -0.5
        if self.rope.rope_type != "default" and self.rope.mscale_all_dim:
            scale *= yarn_mscale(self.rope.factor, self.rope.mscale_all_dim) ** 2
        return scale

    # --- reading -------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict, source: str = "config") -> "DeepseekV3Config":
        d = dict(d)
        if "text_config" in d and "hidden_size" not in d:
            raise ConfigError(f"{source}: multimodal config (text_config) is not supported; "
                              "pass the text model's config")
        model_type = d.get("model_type")
        archs = d.get("architectures") or [ARCHITECTURE]
        if model_type not in MODEL_TYPES or ARCHITECTURE not in archs:
            raise ConfigError(f"{source}: model_type={model_type!r}, architectures={archs}; expected model_type "
                              f"in {list(MODEL_TYPES)} with architecture {ARCHITECTURE}")
        problems = []
        if d.get("scoring_func", "sigmoid") != "sigmoid":
            problems.append(f"scoring_func={d['scoring_func']!r} (only 'sigmoid' is implemented)")
        if d.get("topk_method", "noaux_tc") != "noaux_tc":
            problems.append(f"topk_method={d['topk_method']!r} (only 'noaux_tc' is implemented)")
        if d.get("moe_layer_freq", 1) != 1:
            problems.append(f"moe_layer_freq={d['moe_layer_freq']!r} (only 1 is implemented)")
        if d.get("hidden_act", "silu") != "silu":
            problems.append(f"hidden_act={d['hidden_act']!r} (only 'silu' is implemented)")
        n_heads = d.get("num_attention_heads", cls.num_attention_heads)
        if d.get("num_key_value_heads", n_heads) != n_heads:
            problems.append(f"num_key_value_heads={d['num_key_value_heads']} differs from num_attention_heads="
                            f"{n_heads} (MLA needs them equal)")
        rope_dim = d.get("qk_rope_head_dim", cls.qk_rope_head_dim)
        if d.get("head_dim", rope_dim) != rope_dim:
            problems.append(f"head_dim={d['head_dim']} differs from qk_rope_head_dim={rope_dim} "
                            "(transformers would use head_dim as the rope dimension)")
        sparsity = d.get("moe_sparsity_config") or {}
        counts = {n for n in sparsity.get("num_experts") or [] if n is not None}
        if len(counts) > 1:
            problems.append(f"moe_sparsity_config.num_experts gives layers different expert counts {sorted(counts)} "
                            "(per-layer expert counts are not implemented; prune with one keep for every layer)")
        rope = _rope_from_dict(d, problems)
        if problems:
            raise ConfigError(f"{source}: not implemented: " + "; ".join(problems))
        names = {f.name for f in dataclasses.fields(cls)} - {"rope", "raw"}
        kwargs = {k: d[k] for k in names if k in d and (d[k] is not None or k == "q_lora_rank")}
        cfg = cls(**kwargs, rope=rope, raw=d)
        cfg.validate(source)
        return cfg

    @classmethod
    def from_json_file(cls, path) -> "DeepseekV3Config":
        path = Path(path)
        try:
            d = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{path}: config.json not found") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
        return cls.from_dict(d, source=str(path))

    def validate(self, source: str = "config") -> None:
        E, G = self.n_routed_experts, self.n_group
        if E % G:
            raise ConfigError(f"{source}: n_routed_experts={E} is not divisible by n_group={G}")
        if G > 1 and E // G < 2:
            raise ConfigError(f"{source}: group-limited routing needs at least 2 experts per group, got {E // G}")
        if not 1 <= self.topk_group <= G:
            raise ConfigError(f"{source}: topk_group={self.topk_group} must lie in [1, n_group={G}]")
        if self.num_experts_per_tok > self.topk_group * (E // G):
            raise ConfigError(f"{source}: num_experts_per_tok={self.num_experts_per_tok} exceeds the experts of "
                              f"the chosen groups ({self.topk_group} x {E // G})")
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"{source}: qk_rope_head_dim={self.qk_rope_head_dim} must be even")

    def to_dict(self) -> dict:
        """The config as written to config.json: the source dictionary when there is one."""
        if self.raw:
            return dict(self.raw)
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("rope", "raw")}
        d.update(model_type="deepseek_v3", architectures=[ARCHITECTURE], num_key_value_heads=self.num_attention_heads,
                 scoring_func="sigmoid", topk_method="noaux_tc", moe_layer_freq=1, hidden_act="silu")
        rp = {"rope_type": self.rope.rope_type, "rope_theta": self.rope.theta}
        if self.rope.rope_type == "yarn":
            rp.update({k: getattr(self.rope, k) for k in ("factor", "original_max_position_embeddings", "beta_fast",
                                                          "beta_slow", "mscale", "mscale_all_dim")})
        d["rope_parameters"] = rp
        return d


def _rope_from_dict(d: dict, problems: list) -> RopeConfig:
    """transformers' resolution: `rope_scaling` wins over `rope_parameters`; a `rope_theta` inside the
    dict wins over the top-level one; `type` is the legacy key of `rope_type`."""
    rp = dict(d.get("rope_scaling") or d.get("rope_parameters") or {})
    rp.setdefault("rope_theta", d.get("rope_theta", 10000.0))
    rp.setdefault("rope_type", rp.get("type", "default"))
    rope_type = rp["rope_type"]
    if rope_type == "default":
        return RopeConfig(theta=float(rp["rope_theta"]))
    if rope_type != "yarn":
        problems.append(f"rope_type={rope_type!r} (only 'default' and 'yarn' are implemented)")
        return RopeConfig()
    omp = d.get("original_max_position_embeddings") or rp.get("original_max_position_embeddings") \
        or d.get("max_position_embeddings", 4096)
    factor = rp.get("factor")
    if factor is None:
        factor = d.get("max_position_embeddings", 4096) / omp
    return RopeConfig(
        rope_type="yarn", theta=float(rp["rope_theta"]), factor=float(factor),
        original_max_position_embeddings=int(omp),
        beta_fast=float(rp.get("beta_fast") or 32), beta_slow=float(rp.get("beta_slow") or 1),
        mscale=rp.get("mscale"), mscale_all_dim=rp.get("mscale_all_dim"),
        attention_factor=rp.get("attention_factor"), truncate=bool(rp.get("truncate", True)))


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0
