"""The predictor of a multi-token-prediction (MTP) layer: what sits around its decoder block.

DeepSeek-V3 (and Qwen3.5-MoE, under other names: `moejax.hf.mtp_names`) predict token t + 2 + j at
position t with MTP depth j. Depth j's input at position t is its own projection of the next
token's embedding and the previous depth's state there (transformers' `MtpLayer`, vLLM's
`DeepSeekMultiTokenPredictorLayer`):

    x_t = eh_proj @ [enorm(embed(token_{t+1+j})); hnorm(h_t)]          (eh_proj: [2H] -> [H])

where h is the trunk's last hidden state after the model's final norm for depth 0 (what
transformers' MTP drafting takes, `hidden_states[-1]`) and the previous depth's output after it.
The block (the family's decoder layer: attention and a MoE layer) runs on x at the positions of
the tokens t + 1 + j, causally; its output through `post_norm` (DeepSeek-V3's `shared_head.norm`)
is depth j's state, which the shared output head turns into logits.

`MtpPredictor` holds the four tensors and computes the two ends; the decoder block is the family's
own (`CausalLM.decoder_layer`), so its MoE layer is scored, pruned and merged as any other.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from moejax.models.layers import RMSNorm, linear, param


class MtpPredictor(nnx.Module):
    def __init__(self, cfg, dtype, rngs: nnx.Rngs):
        H = cfg.hidden_size
        self.enorm = RMSNorm.of(cfg, H, dtype)
        self.hnorm = RMSNorm.of(cfg, H, dtype)
        self.eh_proj = param(rngs, (2 * H, H), dtype)
        self.post_norm = RMSNorm.of(cfg, H, dtype)

    def block_input(self, embedded_BSH, state_BSH):
        """The decoder block's input from the next tokens' embeddings and the previous state at
        the same positions (both [B, S, H])."""
        return linear(jnp.concatenate([self.enorm(embedded_BSH), self.hnorm(state_BSH)], axis=-1),
                      self.eh_proj[...])

    def state(self, block_out_BSH):
        """This depth's state from its block's output: the next depth's input, the head's."""
        return self.post_norm(block_out_BSH)
