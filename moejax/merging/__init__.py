"""Expert merging (SPEC section 8): the two baselines the REAP paper compares pruning with, and REAM
(SPEC section 11), evaluated as variants beside the pruning scores and written as checkpoints.

- `clusters`: which experts merge. `hc_smoe_clusters` (HC-SMoE, Chen et al. 2024: agglomerative
  clustering with average linkage of the experts' mean outputs over all calibration tokens; k-means
  as a named option); `m_smoe_groups` / `m_smoe_groups_from_gram` (M-SMoE, Li et al. 2024: the
  `keep` most frequent experts dominate, every other expert joins the dominant one whose
  router-logit column is most similar by cosine).
- `average`: how a cluster becomes one expert. `align_neurons` / `align_layer` (M-SMoE's Hungarian
  alignment of a member's intermediate neurons onto its leader's), `merge_weights` /
  `merge_cluster` (the frequency-weighted average of every matrix), `averaged_rows` (the same rows
  as a table part made when read, `moejax.moe.averaged_rows`: the carried pass's merges).
- `ream`: REAM (Jha et al. 2026): centroids = the `keep` highest-scoring experts (REAP by default),
  pseudo-pruning groups of at most C on the mean of an output and a router-logit similarity
  (`ream_similarity`, `ream_groups`), neurons aligned on activations plus PCA weight rows
  (`ream_align`), the score-weighted average (`ream_averaging`, `ream_merge`).
- `allocation`: per-layer counts, uniform or from one global threshold (`layer_counts`).
- `calibration`: `MergeStats` of a MoE layer from a calibration pass (counts, every expert's output
  summed over all tokens, the router-logit Gram matrix; for REAM, the router-weighted output sums
  and the router inputs of a fixed sample of tokens).
- `method`: what a merge method is: one frozen settings object registered by name (`MergeMethod`:
  its settings as fields, their checks, `clusters`, `leaders`, `averaging`, the statistics and
  scores it reads; `MergeContext`: what it may read; `Averaging`: how its clusters become experts,
  each member's weight and neuron permutation, which `merge_weights` applies). `clusters.HcSmoe`,
  `clusters.MSmoe` and `ream.Ream` are the three, `@register`ed; `parse(name, **settings)` is the
  only check of a name. A new method is its module, its line in `MERGE_METHODS` and its tests.
- `layer`: `merge_layer(method, keep, ctx, weights)` -> `LayerMerge` (clusters, leaders, merged
  experts) and its `ExpertMap` under the `tied` or `shrunk` router form.

Labels are int [E]: the cluster of each expert, clusters numbered by their lowest member, so equal
partitions give equal labels. Pure numpy/scipy except `calibration` (one jitted function), `averaged_rows` and `bf16_align` (XLA).
"""
