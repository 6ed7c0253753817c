"""`AutoModelForCausalLM`: the model of any registered family, chosen by the checkpoint's config.json
(transformers' spelling of `moejax.from_pretrained`, which it calls).

    from moejax import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=jnp.float32)
    logits_BSV = model(input_ids, attention_mask).logits_BSV
"""

from __future__ import annotations

from moejax.models.registry import family_of


class AutoModelForCausalLM:
    """Not instantiated: `from_pretrained` returns the family's own model class."""

    def __init__(self):
        raise TypeError("use AutoModelForCausalLM.from_pretrained(path, dtype=...)")

    @staticmethod
    def from_pretrained(path, dtype=None, **kw):
        """The checkpoint folder's model (family from config.json; see moejax.hf.model_io.load_pretrained
        for backend and mesh)."""
        import jax.numpy as jnp

        from moejax.hf.model_io import load_pretrained

        return load_pretrained(path, dtype=jnp.float32 if dtype is None else dtype, **kw)

    @staticmethod
    def from_config(cfg, dtype=None, **kw):
        """A randomly initialised model of the family of `cfg` (a typed config of any family)."""
        import jax.numpy as jnp

        return family_of(cfg).causal_lm()(cfg, jnp.float32 if dtype is None else dtype, **kw)
