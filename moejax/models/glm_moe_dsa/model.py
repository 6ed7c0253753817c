"""GLM-5 in Flax NNX: DeepSeek-V3.2's sparse MLA stack (`moejax.models.sparse_mla`) whose "shared"
layers attend with the selection of the nearest full layer below (handed over by the stack's
forward, prefill and decode)."""

from moejax.models.glm_moe_dsa.config import GlmMoeDsaConfig
from moejax.models.sparse_mla import SparseMlaCausalLM


class GlmMoeDsaForCausalLM(SparseMlaCausalLM):
    """GLM-5, GLM-5.1, GLM-5.2: `model(input_ids, attention_mask).logits_BSV`."""

    config_class = GlmMoeDsaConfig
