"""The weights-only statistics the data-free scores read (SPEC section 2), from a checkpoint's
tensors with no calibration pass: the router rows and balance bias (`router_stats`), and, for
`aimer`, the routed experts' weight sums (`stored_expert_weight_sums`). `data_free_stats` gives
what a list of data-free scores needs. `moejax score`, `moejax diff` and `moejax prune`'s plan
(`moejax.surgery.prune_plan`) read them. JAX-free."""

from __future__ import annotations

import numpy as np

from moejax.errors import CheckpointError
from moejax.hf.check import stored_as
from moejax.hf.io.checkpoint_reader import CheckpointReader
from moejax.hf.layout import MoeLayer
from moejax.hf.quant.decode import detect_format, read_decoded
from moejax.models.registry import family_of
from moejax.scoring.scores import EXPERT_WEIGHT_SCORES, LayerStats


def router_stats(reader: CheckpointReader, ml: MoeLayer, seed: int = 0) -> LayerStats:
    """The weights-only part of a layer's statistics (router rows and balance bias, in float64):
    all that the data-free scores read. Calibration sums are zero and unused by them."""
    router = finite_rows(reader, ml.router, ml.layer)
    E = router.shape[0]
    bias = finite_rows(reader, ml.bias, ml.layer) if ml.bias else np.zeros(E)
    zeros = np.zeros(E)
    return LayerStats(counts_E=zeros, gate_norm_sum_E=zeros, norm_sum_E=zeros, mean_input_D=np.zeros(router.shape[1]),
                      router_ED=router, bias_E=bias, seed=seed, layer=ml.layer)


def data_free_stats(reader, ml: MoeLayer, cfg, names, seed: int = 0) -> LayerStats:
    """The statistics the data-free scores `names` read: the router rows and bias
    (`router_stats`: headers and router tensors only), plus the routed experts' weight sums
    (`stored_expert_weight_sums`) only when a score that reads expert weights (`aimer`) is among them."""
    st = router_stats(reader, ml, seed)
    if any(n in EXPERT_WEIGHT_SCORES for n in names):
        st.weight_abs_sum_E, st.weight_sq_sum_E, st.weight_count = stored_expert_weight_sums(reader, ml, cfg)
    return st


def stored_expert_weight_sums(reader, ml: MoeLayer, cfg) -> tuple[np.ndarray, np.ndarray, int]:
    """(sum |w| [E], sum w^2 [E], entries per expert) over every entry of layer `ml`'s routed
    experts' weight matrices (gate, up and down; gpt-oss's gate_up and down, biases aside: the
    family's names), in float64: what `aimer` reads.
    One tensor at a time, decoded from its stored format as the loader decodes it (FP8, INT4,
    MXFP4; a fused transformers-5 checkpoint through its per-expert view); a non-finite value is
    refused naming the tensor."""
    fmt, qcfg = detect_format(cfg.quantization_config), cfg.quantization_config
    family = family_of(cfg)
    rests = [r.hf.split("experts.{e}.", 1)[1] for r in family.expert_matrix_rules(cfg)]
    E = ml.n_experts
    abs_sum, sq_sum, count = np.zeros(E), np.zeros(E), 0
    for e in range(E):
        count = 0
        for rest in rests:
            name = ml.expert_tensor(e, rest)
            stored = stored_as(reader, name, fmt)
            if stored is None:
                raise CheckpointError(f"layer {ml.layer}: expert {e} has no tensor {name} (needed by the aimer score)")
            w = np.asarray(read_decoded(reader, name, stored, fmt, qcfg), np.float64)
            if not np.isfinite(w).all():
                raise CheckpointError(f"layer {ml.layer}: {name} in {reader.shard_of(stored[0]).name} has non-finite "
                                      "values (NaN or inf)")
            abs_sum[e] += np.abs(w).sum()
            sq_sum[e] += np.square(w).sum()
            count += w.size
    return abs_sum, sq_sum, count


def finite_rows(reader: CheckpointReader, name: str, layer: int) -> np.ndarray:
    """A router or bias tensor in float64, refused when any expert's row holds a NaN or infinity
    (a data-free score would be NaN, or plausible and wrong), naming the layer, tensor and experts."""
    value = reader.read(name).astype(np.float64)
    bad = ~np.isfinite(value.reshape(value.shape[0], -1)).all(axis=1)
    if bad.any():
        raise CheckpointError(f"layer {layer}: {name} in {reader.shard_of(name).name} has non-finite values "
                              f"(NaN or inf) in the rows of expert(s) {np.flatnonzero(bad).tolist()[:16]}")
    return value
