"""`moejax score`: every score of every MoE layer of a checkpoint from one streamed calibration
pass, written as a tidy table (layer, expert, score, value) plus a JSON sidecar with the per-layer
statistics and the run's settings. The scores file is what pruning and evaluation consume.

Without calibration data, `score_data_free` computes the data-free scores (bias, signed, l1,
random from the router tensors alone; aimer from the routed experts' weight matrices, read one
tensor at a time), of a local or a remote checkpoint (`moejax.hf.io.storage`)."""

from __future__ import annotations

import contextlib
import platform
import time
from pathlib import Path

import numpy as np
import pandas as pd

from moejax import __version__
from moejax.data import Tokenizer, npy_tokens, text_files, text_tokens
from moejax.errors import CheckpointError, ConfigError
from moejax.hf.check import check_checkpoint
from moejax.hf.io.location import open_location
from moejax.hf.io.staging import check_apart, text_inputs
from moejax.hf.io.storage import require_local
from moejax.hf.mtp_names import MTP_DEFAULT, carried_mtp_block, check_mtp_policy
from moejax.hf.provenance import FINGERPRINT_KEY, checkpoint_fingerprint, router_fingerprint
from moejax.parallel.mesh import MeshConfig, make_mesh
from moejax.results import check_output_file, write_json_atomic, write_parquet_atomic
from moejax.scoring.scores import DATA_FREE_SCORES, check_score_names, compute_scores, pass_needs, scores_for
from moejax.scoring.data_free import data_free_stats

DEFAULT_SEQ_LEN = 512  # or the model's max_position_embeddings when that is shorter


def score_checkpoint(checkpoint, *, text=None, tokens=None, seq_len: int | None = None, max_tokens: int | None = None,
                     scores=None, batch_size: int = 8, out=None, progress=None, dtype="float32",
                     mesh: MeshConfig | None = None, mtp: str = MTP_DEFAULT):
    """Scores as a pandas DataFrame (layer, expert, score, value); written to `out` (parquet, plus
    `out` with suffix .json) when given. Everything is checked before the pass starts (the output
    paths are created and written to, so a read-only or full disk fails now, not after the pass).
    seq_len: tokens per packed text sequence; default 512, or max_position_embeddings if shorter.
    dtype: compute dtype of the pass ("float32", or "bfloat16" to halve the memory of a layer;
    routers and statistics stay float32/float64 either way). scores: names, or None for every score
    the model supports (`bias` only where routers have a balance bias). mesh: run the pass expert-parallel
    (routed experts split over mesh.expert devices); the scores are the same. mtp: "prune" (the
    default) also scores the checkpoint's MTP layers, run as inference runs them (what `moejax prune
    --mtp prune` ranks them by); "keep" and "drop" leave them out (`check_mtp_policy`)."""
    require_local(checkpoint, "moejax score with calibration data")  # before JAX starts
    import jax

    from moejax.hf.model_io import open_checkpoint
    from moejax.scoring.observe import calibrate_streamed

    if scores is not None:
        check_score_names(scores)
    if dtype not in ("float32", "bfloat16"):
        raise ConfigError(f"dtype={dtype!r}; expected 'float32' or 'bfloat16'")
    if batch_size < 1:
        raise ConfigError(f"batch_size={batch_size} must be >= 1 (--batch-size)")
    check_calibration_args(text, tokens, seq_len, max_tokens)
    check_mtp_policy(mtp)
    ckpt = open_checkpoint(checkpoint)  # headers only: fails fast on a wrong checkpoint
    carried_mtp_block(ckpt.config, mtp, ckpt.reader.keys())  # an MTP block moejax does not run: prune refused
    scores = scores_for(scores, ckpt.config.HAS_BALANCE_BIAS, f"{checkpoint}")
    if out is not None:  # before the pass, not after hours of it
        _check_out(out, (checkpoint, text_inputs(text), tokens))
    for count in sorted({ckpt.config.experts_in_layer(l) for l in ckpt.config.moe_layers}):  # per layer when pruned so
        (mesh or MeshConfig()).check_experts(count, str(checkpoint))
    ids, tokenizer = calibration_ids(checkpoint, ckpt.config, text, tokens, seq_len, max_tokens)
    batches = [(ids[i:i + batch_size], None) for i in range(0, len(ids), batch_size)]
    mesh = mesh or MeshConfig()
    device_mesh = make_mesh(mesh) if mesh.n_devices > 1 else None
    t0 = time.perf_counter()
    with contextlib.nullcontext() if device_mesh is None else jax.set_mesh(device_mesh):
        stats = calibrate_streamed(ckpt, batches, dtype=jax.numpy.dtype(dtype), progress=progress, mesh=device_mesh,
                                   mtp=mtp == "prune", **pass_needs(scores))
    seconds = time.perf_counter() - t0
    df = score_table(stats.items(), scores)
    if out is not None:
        out = Path(out)
        sidecar = {
            "checkpoint": str(Path(checkpoint).resolve()), FINGERPRINT_KEY: checkpoint_fingerprint(ckpt),
            "tokens": int(ids.size), "sequences": int(len(ids)),
            "seq_len": int(ids.shape[1]), "tokenizer": tokenizer, "scores": scores, "batch_size": batch_size, "dtype": dtype,
            "mesh": {"data": mesh.data, "expert": mesh.expert}, "mtp": mtp,
            "seconds": round(seconds, 3),
            "versions": {"moejax": __version__, "jax": jax.__version__, "python": platform.python_version()},
            "layers": {str(l): {"counts": st.counts_E.tolist(), "gate_norm_sum": st.gate_norm_sum_E.tolist(),
                                "norm_sum": st.norm_sum_E.tolist(), "code_counts": st.code_counts_E.tolist(),
                                "code_gate_norm_sum": st.code_gate_norm_sum_E.tolist(),
                                "norm_sq_sum": st.norm_sq_sum_E.tolist(), "norm_max": st.norm_max_E.tolist(),
                                "weight_abs_sum": st.weight_abs_sum_E.tolist(),
                                "weight_sq_sum": st.weight_sq_sum_E.tolist(), "weight_count": st.weight_count,
                                "mean_input": st.mean_input_D.tolist()} for l, st in stats.items()},
        }
        write_json_atomic(out.with_suffix(".json"), sidecar)
        write_parquet_atomic(df, out)  # last: its presence means the run completed
    return df


def score_data_free(checkpoint, *, scores, out=None, seed: int = 0):
    """The data-free scores (SPEC section 2: from router rows and balance biases alone, and `aimer`
    from the routed experts' weights; no calibration pass, no JAX) of every MoE layer, MTP layers
    included (the layers `moejax prune --score NAME` ranks, so `prune --scores-file` of this table
    keeps the same experts), as the table `score_checkpoint` gives (layer, expert, score, value);
    written to `out` (parquet, plus `out` with suffix .json) when given. `checkpoint`: a local
    folder or a remote location (https:// base URL, hf://org/name[@revision]), of which only the
    headers, config.json and the router and bias tensors are read, and the routed experts' tensors
    (one at a time, one layer after another) when `aimer` is asked for. seed: the `random` score's."""
    names = check_score_names(scores)
    calibrated = [n for n in names if n not in DATA_FREE_SCORES]
    if calibrated:
        raise ConfigError(f"score(s) {calibrated} need a calibration pass: give --text or --tokens; without "
                          f"calibration data only the data-free scores ({', '.join(DATA_FREE_SCORES)}) are computed")
    if out is not None:  # before any byte is fetched
        _check_out(out, (checkpoint,))
    storage = open_location(checkpoint)
    checked = check_checkpoint(storage, uniform_experts=False)  # headers and config.json only
    names = scores_for(names, checked.config.HAS_BALANCE_BIAS, storage.describe())
    stats = [(layer, data_free_stats(checked.reader, ml, checked.config, names, seed))
             for layer, ml in checked.layout.moe_layers.items() if not checked.config.is_kept_whole(layer)]
    df = score_table(stats, names)
    if out is not None:  # the fingerprint from the routers just read (a remote one is not fetched twice)
        fingerprint = (router_fingerprint({l: st.router_ED for l, st in stats if l < checked.config.num_hidden_layers})
                       if checked.config.scored_layers == checked.config.moe_layers  # else a layer kept whole is unread
                       else checkpoint_fingerprint(checked))
        write_json_atomic(Path(out).with_suffix(".json"), {
            "checkpoint": storage.describe(), FINGERPRINT_KEY: fingerprint, "data_free": True, "scores": names,
            "seed": seed,
            "layers": sorted(l for l, _ in stats),
            "versions": {"moejax": __version__, "python": platform.python_version()}})
        write_parquet_atomic(df, Path(out))  # last: its presence means the run completed
    return df


def score_table(layer_stats, names):
    """The (layer, expert, score, value) table of every score in `names` from each (layer,
    statistics) pair; a score that is not finite is refused naming the layer, score and experts
    (before anything is written)."""
    rows = []
    for layer, st in layer_stats:
        for name, values in compute_scores(st, names).items():
            if not np.isfinite(values).all():
                raise CheckpointError(f"layer {layer}: score {name!r} is not finite (NaN or inf) at experts "
                                      f"{np.flatnonzero(~np.isfinite(values)).tolist()[:16]}; nothing was written")
            rows += [{"layer": layer, "expert": e, "score": name, "value": float(v)} for e, v in enumerate(values)]
    return pd.DataFrame(rows, columns=["layer", "expert", "score", "value"])


def check_calibration_args(text, tokens, seq_len, max_tokens) -> None:
    """The calibration-data arguments every command takes, checked before anything is read."""
    if (text is None) == (tokens is None):
        raise ConfigError("give calibration data as text paths or as a tokens .npy file (exactly one)")
    if seq_len is not None and seq_len < 1:
        raise ConfigError(f"seq_len={seq_len} must be >= 1 (--seq-len)")
    if max_tokens is not None and max_tokens < 1:
        raise ConfigError(f"max_tokens={max_tokens} (--max-tokens): expected a positive number of tokens")


def calibration_ids(checkpoint, config, text=None, tokens=None, seq_len: int | None = None,
                    max_tokens: int | None = None) -> tuple[np.ndarray, str]:
    """(token ids [n_seq, seq_len], what tokenised them) for a calibration pass over `checkpoint`:
    text files (folders, globs) packed into sequences of seq_len (default 512, or the model's
    max_position_embeddings if shorter) by the checkpoint's tokenizer, or a pre-tokenised .npy."""
    check_calibration_args(text, tokens, seq_len, max_tokens)
    if text is not None:  # a missing file is named as such, before the tokenizer is looked for
        text = text_files(text if isinstance(text, (list, tuple)) else [text])
    vocab, max_positions = config.vocab_size, config.max_position_embeddings
    seq_len = min(DEFAULT_SEQ_LEN, max_positions) if seq_len is None else seq_len
    if text is not None and seq_len > max_positions:
        raise ConfigError(f"seq_len={seq_len} (--seq-len) exceeds the model's max_position_embeddings="
                          f"{max_positions} (config.json)")
    if tokens is not None:
        ids = npy_tokens(tokens, vocab, max_tokens)
        if ids.shape[1] > max_positions:
            raise ConfigError(f"tokens file {tokens}: sequences of {ids.shape[1]} tokens exceed the model's "
                              f"max_position_embeddings={max_positions} (config.json)")
        return ids, f"pre-tokenised ({tokens})"
    tok = Tokenizer(checkpoint, vocab)
    ids = text_tokens(text, tok, seq_len, max_tokens)
    if ids.max() >= vocab:
        raise ConfigError(f"tokenizer produced id {ids.max()} >= vocab_size={vocab}")
    return ids, tok.name


def _check_out(out, inputs) -> None:
    """The scores file and its sidecar: writable, and neither an input nor inside one (a checkpoint
    folder is a source, never written into)."""
    for path in (Path(out), Path(out).with_suffix(".json")):
        check_apart(path, inputs, "--out")
        check_output_file(path)
