"""Everything that runs a model on text, apart from the model itself.

- `carried`        prune_real's carried pass (`evaluate_pruning`): every variant through each
                   decoder layer together, layer errors and perplexity in one pass
- `stream`         the streamed executor: one decoder layer in memory at a time
- `nll`            next-token negative log-likelihood, whole or over vocabulary chunks
- `generate`       KV-cached generation (`generate(model, ...)`, `Generator`)
- `lm_eval`        the lm-eval backend `moejax` (`MoejaxLM`, the `moejax-lm-eval` command)
- `tasks`          offline lm-eval tasks built from local text (stdlib_*), and the task runner
                   helpers eval_tasks uses
- `skills_tasks`   the skills model's tasks (`python -m moejax.evaluation.skills_tasks`)
- `routing_table`  where each text's routing decisions go (per layer and expert)

Nothing here is imported by `moejax/__init__`; import the module you need.
"""
