"""Evaluating models and their pruned, merged and substituted variants on text. The primitives
that run a model (the streamed executor, next-token NLL, generation) are below, in
`moejax.inference`.

- `carried`        prune_real's carried pass (`evaluate_pruning`): every variant through each
                   decoder layer together, layer errors and perplexity in one pass
- `lm_eval`        the lm-eval backend `moejax` (`MoejaxLM`, the `moejax-lm-eval` command)
- `tasks`          offline lm-eval tasks built from local text (stdlib_*), and the task runner
                   helpers eval_tasks uses
- `skills_tasks`   the skills model's tasks (`python -m moejax.evaluation.skills_tasks`)
- `routing_table`  where each text's routing decisions go (per layer and expert)

Nothing here is imported by `moejax/__init__`; import the module you need.
"""
