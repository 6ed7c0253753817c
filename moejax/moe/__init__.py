"""MoE building blocks: routing (one function) and dispatch backends (one signature)."""
