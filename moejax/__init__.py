"""moejax: pruning experts out of Mixture-of-Experts language models, in JAX.

Importing the package is cheap and never imports JAX, so `moejax.results.load` works in a plain
pandas notebook. The JAX-backed pieces live in the sub-packages:

- `moejax.moe.routing.route`      the one routing function (SPEC section 1)
- `moejax.moe.dispatch`           dense oracle and the sorted grouped-matmul backend
- `moejax.models.toy`             the toy MoE layer of SPEC section 4 (math: `models.toy_layer`)
- `moejax.scoring`                expert scores (SPEC section 2) and keep/selection rules
- `moejax.experiments.toy3`       the toy3 experiment
- `moejax.generate`               KV-cached generation (`model.generate`, `Generator`)
- `moejax.lm_eval`                the lm-eval backend `moejax` (needs the `eval` extra)
"""

__version__ = "0.1.0"


def __getattr__(name):
    # Lazy, so `import moejax` (and moejax.results) never imports JAX.
    if name == "DeepseekV3ForCausalLM":
        from moejax.models.deepseek_v3 import DeepseekV3ForCausalLM

        return DeepseekV3ForCausalLM
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
