"""Full-size Kimi-K2.5 config (its language model is Kimi-K2's: 61 layers, the first dense, 384
experts top 8 + 1 shared, MLA with 64 heads, vocabulary 163,840; the vision config is left out, it
is carried, not read), for shape work. The text model's shapes are Kimi-K2's published ones; the
context (262,144 positions) and rope fields are taken from Kimi-K2 with the longer context, not
checked against the Hub's file."""

from moejax.models.deepseek_v3.presets import PRESETS as DEEPSEEK_V3_PRESETS
from moejax.models.deepseek_v3.presets import TINY as DEEPSEEK_V3_TINY


def _wrapped(text: dict, **vision) -> dict:
    return {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
            "tie_word_embeddings": False, **vision,
            "text_config": {**{k: v for k, v in text.items() if k != "architectures"}, "model_type": "kimi_k2",
                            "architectures": ["DeepseekV3ForCausalLM"]}}


PRESETS = {"kimi-k2.5": _wrapped({**DEEPSEEK_V3_PRESETS["kimi-k2"], "max_position_embeddings": 262144})}

_VISION = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)

# What `experiment=train_tiny arch.family=kimi_k25` trains: DeepSeek-V3's tiny budget in the wrapper
# (a one-block vision tower transformers builds at random: it is not trained)
TINY = _wrapped(DEEPSEEK_V3_TINY, vision_config=_VISION)

# The random checkpoint the family's tests have transformers write (tests/family_fixtures.py, which
# renames transformers' save to the Hub's names): the wrapper with a one-block vision tower
# (carried), MLA with a q LoRA, a dense layer 0, 8 experts top 2 without groups (Kimi's), one shared
# expert.
TEST = dict(vision_config=_VISION, tie_word_embeddings=False, text_config=dict(
    model_type="deepseek_v3", vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16,
    qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8, n_shared_experts=1,
    num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.827,
    norm_topk_prob=True, rms_norm_eps=1e-5, max_position_embeddings=256, tie_word_embeddings=False))
