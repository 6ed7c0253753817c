"""Models: the toy MoE layer (SPEC section 4) and the model families, one folder each
(`moejax.models.registry` lists them; `moejax.models.causal_lm`, `moe_block` and `layers` hold what
they share)."""
