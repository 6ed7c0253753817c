"""Variants: the one typed pair between what a researcher asks for and what the forward runs.

- `spec`: `VariantSpec(method, keep, form)`, what was asked for (a score, a merge method or a
  substitution; one_shot / sequential / tied / shrunk / sequential_tied / sequential_shrunk /
  substituted), the results table's
  `method`, `form` and `keep` columns.
- `plan`: `VariantPlan(spec, {MoE layer: Kept | Merged | Substituted})`, what was decided per
  layer, and `.expert_maps()`, the one place a plan becomes the `{layer: ExpertMap}` the forward,
  prefill, decode, generate and the lm-eval backend take.
- `check`: expert masks built from what is on disk or in memory (a `pruning.json`, a scores
  file, kept sets), checked against the checkpoint's config before any compute. The check of a
  variant given to the forward (expert masks, expert maps), and the one conversion of masks into
  expert maps, are the model's own: `moejax.models.variant`.

`moejax.evaluation.carried.evaluate_pruning` returns plans; `eval_tasks` hands them to the lm-eval
backend unchanged.
"""

from moejax.variants.plan import Kept, LayerPlan, Merged, Substituted, VariantPlan
from moejax.variants.spec import FORMS, MERGE_FORMS, PRUNING_FORMS, ROUTER_FORMS, VariantSpec, is_rerouted

__all__ = ["FORMS", "MERGE_FORMS", "PRUNING_FORMS", "ROUTER_FORMS", "Kept", "LayerPlan", "Merged", "Substituted", "VariantPlan",
           "VariantSpec", "is_rerouted"]
