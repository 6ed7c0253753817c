"""moejax: pruning experts out of Mixture-of-Experts language models, in JAX.

Importing the package is cheap and never imports JAX, so `moejax.results.load` works in a plain
pandas notebook. The JAX-backed pieces live in the sub-packages:

- `moejax.from_pretrained`        any registered family's model from a checkpoint folder, and
                                  `moejax.save_pretrained(model, out_dir)` back (`moejax.hf.model_io`,
                                  the loader: it imports the model, never the reverse);
                                  `moejax.AutoModelForCausalLM` spells loading as transformers does
- `moejax.models.registry`        the model families (one folder each under moejax/models/)
- `moejax.moe.routing.route`      the one routing function (SPEC section 1)
- `moejax.moe.dispatch`           the one dispatch signature: the dense oracle, sorted (grouped matmul), ragged, ep
- `moejax.models.toy`             the toy MoE layer of SPEC section 4 (math: `models.toy_layer`)
- `moejax.scoring`                expert scores (SPEC section 2) and keep/selection rules
- `moejax.hf`                     Hugging Face checkpoints: `io` (files and storage), `quant`
                                  (quantised formats), the model binding (`mapping`, `check`,
                                  `model_io`, ...)
- `moejax.surgery`                the checkpoint commands: prune, merge, substitute, reroute, and
                                  the reports inspect, plan, diff
- `moejax.experiments.toy3`       the toy3 experiment
- `moejax.inference`              the primitives that run a model: the streamed executor
                                  (`stream`), next-token NLL (`nll`), KV-cached generation
                                  (`generate`: `generate(model, ...)`, `Generator`)
- `moejax.evaluation`             evaluating models and variants on text: the carried pass of
                                  prune_real (`carried.evaluate_pruning`), the lm-eval backend
                                  `moejax` (`lm_eval`, needs the `eval` extra) and the offline
                                  tasks (`tasks`, `skills_tasks`)

Shape-suffix letters: an array's name ends in one capital per axis (`x_BSH` is [batch, sequence,
hidden], `rows_B11` adds two unit axes); each letter has one meaning everywhere:

    A  variants (stacked expert masks or maps)     N  attention heads
    B  batch rows (or any leading batch axes)      O  toy3 offsets
    C  KV-cache positions (columns)                P  prompt positions (prefill)
    D  model width of the toy / generic MoE code   Q  per-head query/key width (or its rope part)
    E  experts                                     R  MLA latent rank (kv_lora_rank)
    F  an expert's intermediate width              S  sequence positions
    G  expert groups (group-limited routing)       T  tokens, flattened (B*S, or the toy's tokens)
    H  hidden width of a decoder model             U  per-head value width
    I  a generic linear's input features           V  vocabulary
    J  a generic linear's output features          W  toy3 loads (skewed, balanced)
    K  top-k slots per token                       X  expert-parallel shards (devices)
    L  layers                                      Y  blocks of the sorted grouped matmul
    M  routed (token, slot) pairs, flattened       Z  seeds
"""

__version__ = "0.1.0"


def __getattr__(name):
    # Lazy, so `import moejax` (and moejax.results) never imports JAX. Every family's model class
    # (`moejax.Qwen3MoeForCausalLM`, ...) is reachable here by its transformers name.
    if name in ("from_pretrained", "save_pretrained"):
        from moejax.hf import model_io

        return model_io.load_pretrained if name == "from_pretrained" else model_io.save_pretrained
    if name == "AutoModelForCausalLM":
        from moejax.hf.auto import AutoModelForCausalLM

        return AutoModelForCausalLM
    from moejax.models.registry import FAMILIES

    for family in FAMILIES.values():
        if family.model.split(":")[1] == name:
            return family.causal_lm()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
