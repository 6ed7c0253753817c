"""Models: the toy MoE layer (SPEC section 4); DeepSeek-V3 comes next."""
