"""Primitives that run a model, used by scoring, training, surgery and evaluation.

- `stream`    the streamed executor: a checkpoint run one decoder layer at a time
              (`stream_layers`), with only that layer's weights in memory
- `nll`       the one next-token negative log-likelihood, whole or over vocabulary chunks
- `generate`  KV-cached generation (`generate(model, ...)`, `Generator`)

Floor: above `moejax.hf` (the loader) and `moejax.models` (the model), which is all these
import; below `moejax.training` and `moejax.scoring`, which import them
(`tests/test_import_graph.py:FLOORS`). Nothing here is imported by `moejax/__init__`; import
the module you need.
"""
