"""Expert merging (issue 18, in progress): the two baselines the REAP paper compares pruning with,
as pure functions over one layer's calibration statistics and expert weights.

- `clusters.hc_smoe_clusters`: HC-SMoE (Chen et al. 2024): agglomerative clustering with average
  linkage of the experts' mean outputs over all calibration tokens (k-means as a named option).
- `clusters.m_smoe_groups`: M-SMoE (Li et al. 2024): the `keep` most frequent experts dominate;
  every other expert joins the dominant one whose router-logit column is most similar (cosine).
- `average.align_neurons`: M-SMoE's permutation of a member's intermediate neurons onto the
  dominant expert's (Hungarian assignment on the SwiGLU weights).
- `average.merge_cluster`: the frequency-weighted average of a cluster's gate, up and down matrices.

Labels are int [E]: the cluster of each expert, clusters numbered by their lowest member, so equal
partitions give equal labels. Wiring into variants, the forward, `moejax merge` and the experiments
is the rest of issue 18.
"""
