"""Expert scores (SPEC section 2) and the rules that turn a score into a kept set."""

from moejax.scoring.scores import SCORES, LayerStats, compute_scores, stats_from_pairs
from moejax.scoring.select import resolve_keep, select_kept

__all__ = ["SCORES", "LayerStats", "compute_scores", "stats_from_pairs", "resolve_keep", "select_kept"]
