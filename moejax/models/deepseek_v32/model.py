"""DeepSeek-V3.2 in Flax NNX: DeepSeek-V3's decoder stack (dense first layers, the MoE block with
its sigmoid router, balance bias, groups and shared experts) whose MLA attends to the keys each
layer's lightning indexer selects (`moejax.models.sparse_mla`)."""

from moejax.models.deepseek_v32.config import DeepseekV32Config
from moejax.models.sparse_mla import SparseMlaCausalLM


class DeepseekV32ForCausalLM(SparseMlaCausalLM):
    """DeepSeek-V3.2(-Exp): `model(input_ids, attention_mask).logits_BSV`."""

    config_class = DeepseekV32Config
