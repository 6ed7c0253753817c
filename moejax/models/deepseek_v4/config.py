"""DeepSeek-V4 configuration (`deepseek_v4`: DeepSeek-V4-Flash, DeepSeek-V4-Pro), read as transformers
5.24's `DeepseekV4Config` resolves config.json (JAX-free: the checkpoint tools read it without a model).

What each setting is (paper sections as transformers' docstrings cite them):

- the router: `scoring_func` "sqrtsoftplus" (or "sigmoid") with a balance bias
  (`e_score_correction_bias`, the Hub's `ffn.gate.bias`) for the choice only; the chosen scores
  always renormalised (transformers' V4 router ignores `norm_topk_prob`: false is refused) and
  scaled by `routed_scaling_factor`; one shared expert (`n_shared_experts`) per layer; every layer MoE;
- `mlp_layer_types` ("hash_moe" / "moe" per layer; legacy `num_hash_layers`: the first ones hash):
  a `hash_moe` layer's experts are `tid2eid[input_ids]` (section 2.1), its gates as the router's;
- `layer_types` per layer (legacy `compress_ratios`: 0, 4, 128): "sliding_attention" (the window
  alone), "compressed_sparse_attention" (CSA: + entries compressed every `compress_rates[...]`
  tokens from overlapping windows, of which the lightning indexer keeps `index_topk` per query,
  section 2.3.1), "heavily_compressed_attention" (HCA: + entries compressed every
  `compress_rates[...]` tokens, all visible, section 2.3.2); default V4-Pro's schedule (2 HCA, then
  CSA / HCA alternating); legacy `compress_rate_csa` / `compress_rate_hca`;
- shared-KV multi-query attention of `num_attention_heads` heads of `head_dim` (one KV head, read
  as key and value), a q LoRA (`q_lora_rank`), the grouped low-rank output (`o_groups`,
  `o_lora_rank`), a sink logit per head, a `sliding_window` in every layer;
- interleaved partial rope on the last `head_dim * partial_rotary_factor` channels (legacy
  `qk_rope_head_dim`): base `rope_theta` in sliding layers ("main"), `compress_rope_theta` (with
  YaRN when `rope_parameters.compress` / `rope_scaling` says so, attention factor 1) in CSA / HCA
  layers, their compressors and indexer ("compress");
- hyper-connections: `hc_mult` residual streams mixed by Sinkhorn-projected matrices
  (`hc_sinkhorn_iters`, `hc_eps`; section 2.2);
- experts: SwiGLU clamped at `swiglu_limit` (routed and shared).

Quantised checkpoints (`quantization_config`, `quant_method` "fp8", as the Hub ships V4-Flash and
V4-Pro): read as transformers' DeepseekV4Config does, config.json's top-level `expert_dtype` moved
into it ("fp4": FP4 routed experts; absent: "fp8", FineGrainedFP8Config's default); every
quantised Linear then stores `<x>.weight` with `<x>.scale` (`moejax.hf.quant.decode`'s
`deepseek_v4_fp8`).

Not read: the MTP block (`mtp.*` on the Hub), which transformers 5.24 does not instantiate
(`_keys_to_ignore_on_load_unexpected`); `--mtp keep` carries it byte for byte, `--mtp drop` removes it
(num_nextn_predict_layers 0), `--mtp prune` is refused by name (`moejax.hf.mtp_names.carried_mtp_block`).
"""

from __future__ import annotations

from typing import ClassVar

from moejax.models.config_base import (BOOL, FRACTION, NONNEG_INT, POS_INT, POS_INT_OR_NULL, POS_NUMBER, STRING,
                                       MoeConfig, family_config, is_int, key, show)
from moejax.models.rope_settings import RopeConfig, rope_from_dict

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
ATTENTION_TYPES = (SLIDING, CSA, HCA)
HASH_MOE, MOE = "hash_moe", "moe"
_LEGACY_RATIO = {0: SLIDING, 4: CSA, 128: HCA}  # transformers' `_COMPRESS_RATIO_TO_LAYER_TYPE`

ONE_ONLY = (lambda v: v == 1, "1 (DeepSeek-V4's attention is shared-KV multi-query: one KV head)")
FALSE_ONLY = (lambda v: v is False, "false (transformers' DeepSeek-V4 has no such bias)")


def _list_of(allowed):
    return (lambda v: v is None or (isinstance(v, list) and all(t in allowed for t in v)),
            f"a list of {' or '.join(repr(t) for t in allowed)} (or null)")


RATES = (lambda v: v is None or isinstance(v, dict) and all(k in (CSA, HCA) and is_int(r) and r > 0 for k, r in v.items()),
         f"an object mapping {CSA!r} / {HCA!r} to positive integers")
RATIO_LIST = (lambda v: v is None or (isinstance(v, list) and all(r in _LEGACY_RATIO for r in v)),
              "a list of 0, 4 or 128 (sliding, CSA, HCA), or null")


@family_config("DeepSeek-V4", ("deepseek_v4",), "DeepseekV4ForCausalLM")
class DeepseekV4Config(MoeConfig):
    HAS_BALANCE_BIAS: ClassVar[bool] = True
    NORM_SCALES_IN_FLOAT32: ClassVar[bool] = True    # DeepseekV4RMSNorm: float32 weight times the float32 state
    CARRIED_PREFIXES: ClassVar[tuple] = ("mtp.",)   # the Hub's MTP block, which transformers does not read
    MTP_CARRIED: ClassVar[str] = "mtp."              # so --mtp keep (carried) or drop; prune refused by name
    # Scoring, pruning, merging, substitution, router distillation, the carried pass and ESAP fitness
    # run (the hash layers kept whole, `is_kept_whole`; the learned layers' removed experts as
    # unreachable slots, or novices in constant-v1; docs/families.md); this not yet
    PASSES_NOT_IMPLEMENTED: ClassVar[dict] = {
        "training": ("a fresh model's hash tables (tid2eid) are zeros, every token to expert 0, as transformers "
                     "initialises them, and which tables to draw instead is a choice not made yet; the other "
                     "families train"),
    }
    UNIMPLEMENTED: ClassVar[dict] = {
        "hidden_act": (lambda v: v == "silu", "only 'silu' is implemented"),
        "scoring_func": (lambda v: v in ("sqrtsoftplus", "sigmoid"), "only 'sqrtsoftplus' and 'sigmoid' are implemented"),
        "norm_topk_prob": (lambda v: v is not False, "transformers' DeepSeek-V4 router renormalises the chosen gates "
                                                     "whatever norm_topk_prob says"),
        "moe_sparsity_config": (lambda v: False, "a DeepSeek-V4 checkpoint pruned per layer is not implemented"),
    }
    DEFAULTS = dict(vocab_size=129280, hidden_size=4096, num_hidden_layers=43,
                    num_attention_heads=64, num_experts_per_tok=6, rms_norm_eps=1e-6,
                    max_position_embeddings=1048576)

    # transformers reads intermediate_size as moe_intermediate_size (its attribute_map): here too, so the
    # base field intermediate_size (dense MLPs, which V4 has none of) is no key of its own, kept equal to it
    moe_intermediate_size: int = key(POS_INT, 2048, aliases=("intermediate_size",))
    intermediate_size: int = 2048
    n_routed_experts: int = key(POS_INT, 256, aliases=("num_local_experts",), experts=True)
    n_shared_experts: int = key(NONNEG_INT, 1)
    num_key_value_heads: int = key(ONE_ONLY, 1)
    head_dim: int = key(POS_INT, 512)
    q_lora_rank: int = key(POS_INT, 1024)
    scoring_func: str = key(STRING, "sqrtsoftplus")
    norm_topk_prob: bool = key(BOOL, True)
    routed_scaling_factor: float = key(POS_NUMBER, 1.5)
    rope_theta: float = key(POS_NUMBER, 10000.0)
    compress_rope_theta: float = key(POS_NUMBER, 160000.0)
    partial_rotary_factor: float | None = key((lambda v: v is None or FRACTION[0](v), "a number in (0, 1] or null"),
                                              None)
    qk_rope_head_dim: int | None = key(POS_INT_OR_NULL, None)          # legacy: partial_rotary_factor * head_dim
    layer_types: list | None = key(_list_of(ATTENTION_TYPES), None)
    compress_ratios: list | None = key(RATIO_LIST, None)                # legacy layer_types
    compress_rates: dict | None = key(RATES, None)
    compress_rate_csa: int | None = key(POS_INT_OR_NULL, None)          # legacy compress_rates entries
    compress_rate_hca: int | None = key(POS_INT_OR_NULL, None)
    mlp_layer_types: list | None = key(_list_of((HASH_MOE, MOE)), None)
    num_hash_layers: int | None = key((lambda v: v is None or (is_int(v) and v >= 0), "a non-negative integer or null"),
                                      None)                             # legacy mlp_layer_types
    hc_mult: int = key(POS_INT, 4)
    hc_sinkhorn_iters: int = key(POS_INT, 20)
    hc_eps: float = key(POS_NUMBER, 1e-6)
    swiglu_limit: float = key(POS_NUMBER, 10.0)
    sliding_window: int = key(POS_INT, 128)
    o_groups: int = key(POS_INT, 8)
    o_lora_rank: int = key(POS_INT, 1024)
    index_n_heads: int = key(POS_INT, 64)
    index_head_dim: int = key(POS_INT, 128)
    index_topk: int = key(POS_INT, 512)
    attention_bias: bool = key(FALSE_ONLY, False)
    mlp_bias: bool = key(FALSE_ONLY, False)

    # resolved by `_read_rest` (as transformers' __post_init__ resolves them), not config.json keys
    attention_types: tuple = ()        # per layer: SLIDING, CSA or HCA
    hash_layers: tuple = ()            # per layer: True for a hash_moe layer
    rates: tuple = (4, 128)            # (CSA's compression rate m, HCA's m')
    rope_dim: int = 64                 # the rotated (last) channels of each head
    main_rope: RopeConfig = RopeConfig()
    compress_rope: RopeConfig = RopeConfig(theta=160000.0)

    def __post_init__(self):  # hashable (a jit static argument): lists as tuples, the rates as pairs
        object.__setattr__(self, "intermediate_size", self.moe_intermediate_size)
        for name in ("layer_types", "compress_ratios", "mlp_layer_types"):
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(getattr(self, name)))
        if isinstance(self.compress_rates, dict):
            object.__setattr__(self, "compress_rates", tuple(sorted(self.compress_rates.items())))
        if not self.attention_types:  # built in code, not read: resolve as a read would
            fields = {name: getattr(self, name) for name in self.FIELD_RULES}
            for name, value in self._resolve(fields, []).items():
                object.__setattr__(self, name, value)
            object.__setattr__(self, "main_rope", RopeConfig(theta=float(self.rope_theta)))
            object.__setattr__(self, "compress_rope", RopeConfig(theta=float(self.compress_rope_theta)))

    # --- the layers ------------------------------------------------------------------------------
    def is_moe_layer(self, layer: int) -> bool:
        return True

    def is_hash_layer(self, layer: int) -> bool:
        return layer < self.num_hidden_layers and self.hash_layers[layer]

    def is_kept_whole(self, layer: int) -> bool:
        """The hash layers: their experts are tid2eid[token id], no router chooses them (docs/families.md)."""
        return self.is_hash_layer(layer)

    def attention_type(self, layer: int) -> str:
        return self.attention_types[layer]

    def compress_rate(self, layer: int) -> int | None:
        """The tokens each compressed entry of layer `layer` summarises (None: a sliding layer)."""
        kind = self.attention_types[layer]
        return None if kind == SLIDING else self.rates[0] if kind == CSA else self.rates[1]

    def router_settings(self) -> dict:
        return dict(top_k=self.num_experts_per_tok, scoring_func=self.scoring_func, norm_topk_prob=True,
                    routed_scaling_factor=self.routed_scaling_factor)

    @property
    def shared_intermediate_size(self) -> int:
        return self.moe_intermediate_size * self.n_shared_experts

    @property
    def quantization_config(self) -> dict | None:
        """config.json's quantization_config with `expert_dtype` in it (transformers 5.24's
        DeepseekV4Config `__post_init__` moves the top-level key there; FineGrainedFP8Config defaults
        it to "fp8"), so an FP8 V4 checkpoint is read with its `.scale` names, FP4 experts or not."""
        raw = getattr(self, "raw", None) or {}
        qcfg = raw.get("quantization_config")
        if not isinstance(qcfg, dict) or qcfg.get("quant_method") != "fp8":
            return qcfg
        return {**qcfg, "expert_dtype": qcfg.get("expert_dtype", raw.get("expert_dtype", "fp8"))}

    def expert_fn(self):
        from moejax.moe.dispatch import LimitedSwiglu

        return LimitedSwiglu(self.swiglu_limit)

    def shared_expert_fn(self):
        return self.expert_fn()

    # --- reading ---------------------------------------------------------------------------------
    @classmethod
    def _read_rest(cls, d, valid, merged, problems, unimplemented, uniform_experts) -> dict:
        """transformers' `__post_init__`: layer_types (or compress_ratios, else V4-Pro's schedule),
        compress_rates (legacy scalars folded in), mlp_layer_types (or num_hash_layers, default 3),
        the rope width (partial_rotary_factor, or qk_rope_head_dim / head_dim, default 64 / 512) and
        the two ropes; then the relations between fields."""
        out = cls._resolve(merged, problems)
        if "rope_dim" in out:
            out.update(cls._read_ropes(d, merged, problems, unimplemented))
        return out

    @classmethod
    def _resolve(cls, merged: dict, problems: list) -> dict:
        """attention_types, hash_layers, rates and rope_dim from the fields (`_read_rest`)."""
        out = {}
        n = merged.get("num_hidden_layers")
        if n is None:
            return out
        types = merged.get("layer_types")
        if types is None and merged.get("compress_ratios") is not None:
            types = [_LEGACY_RATIO[r] for r in merged["compress_ratios"]]
        if types is None:
            types = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
        if len(types) < n:
            problems.append(f"layer_types has {len(types)} entries, expected num_hidden_layers={n}")
        out["attention_types"] = tuple(types[:n])
        mlp = merged.get("mlp_layer_types")
        if mlp is None:
            n_hash = merged.get("num_hash_layers")
            n_hash = 3 if n_hash is None else n_hash
            mlp = [HASH_MOE] * min(n, n_hash) + [MOE] * max(0, n - n_hash)
        if len(mlp) < n:
            problems.append(f"mlp_layer_types has {len(mlp)} entries, expected num_hidden_layers={n}")
        out["hash_layers"] = tuple(t == HASH_MOE for t in mlp[:n])
        rates = {CSA: 4, HCA: 128, **dict(merged.get("compress_rates") or {})}
        for legacy, kind in (("compress_rate_csa", CSA), ("compress_rate_hca", HCA)):
            if merged.get(legacy) is not None:
                rates[kind] = merged[legacy]
        out["rates"] = (rates[CSA], rates[HCA])
        head_dim, factor = merged.get("head_dim"), merged.get("partial_rotary_factor")
        if head_dim is None:
            return out
        if factor is None:
            legacy = merged.get("qk_rope_head_dim")
            factor = legacy / head_dim if legacy is not None else 64 / 512
        rope_dim = int(head_dim * factor)
        out["rope_dim"] = rope_dim
        for name, width in (("head_dim", head_dim), ("index_head_dim", merged.get("index_head_dim"))):
            if width is not None and (rope_dim > width or rope_dim % 2):
                problems.append(f"the rotated width head_dim * partial_rotary_factor = {rope_dim} must be even and at "
                                f"most {name}={width}")
        if merged.get("num_attention_heads") and head_dim and merged.get("o_groups"):
            if merged["num_attention_heads"] % merged["o_groups"]:
                problems.append(f"num_attention_heads={merged['num_attention_heads']} is not a multiple of "
                                f"o_groups={merged['o_groups']}")
        return out

    @classmethod
    def _read_ropes(cls, d, merged, problems, unimplemented) -> dict:
        """The "main" rope (sliding layers: rope_theta, no scaling) and the "compress" one (CSA / HCA
        layers: compress_rope_theta, YaRN when asked, attention factor 1: the V4 reference does not
        scale cos / sin), from rope_parameters nested by rope type as transformers writes it, or flat
        / rope_scaling as the Hub's files give the compress rope's scaling."""
        rp = {}
        for name in ("rope_parameters", "rope_scaling"):  # transformers' order: the first given
            value = d.get(name)
            if value is not None and not isinstance(value, dict):
                problems.append(f"{name}={show(value)}, expected an object (or null)")
                return {}
            rp = rp or dict(value or {})
        nested = isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict)
        main = dict(rp["main"]) if nested else {"rope_type": "default", "rope_theta": merged.get("rope_theta")}
        compress = dict(rp["compress"]) if nested else {k: v for k, v in rp.items() if k not in ("main", "compress")}
        if not nested:
            compress["rope_theta"] = merged.get("compress_rope_theta")
        if compress.get("rope_type", compress.get("type")) == "yarn":
            compress.setdefault("attention_factor", 1.0)
        for part in (main, compress):
            part.pop("partial_rotary_factor", None)
        main_rope = rope_from_dict({"rope_parameters": main}, merged, problems, unimplemented)
        if main_rope.rope_type != "default":
            unimplemented.append(f"rope_parameters.main={show(main)} (the sliding layers' rope has no scaling in "
                                 "transformers' DeepSeek-V4)")
        return dict(main_rope=main_rope,
                    compress_rope=rope_from_dict({"rope_parameters": compress}, merged, problems, unimplemented))

    def _written(self) -> dict:
        return dict(hidden_act="silu", layer_types=list(self.attention_types),
                    mlp_layer_types=[HASH_MOE if h else MOE for h in self.hash_layers],
                    compress_rates={CSA: self.rates[0], HCA: self.rates[1]},
                    partial_rotary_factor=self.rope_dim / self.head_dim)
