"""Which checkpoint a record was made from, and the check that it is the one it is applied to.

A scores file (its JSON sidecar: `checkpoint`) and a `pruning.json` (`source`) hold expert
indices of one checkpoint; applied to another (a different model, its fine-tune, the pruned copy)
they select experts by numbers that mean nothing there, and every result looks plausible. So each
record also stores a **fingerprint** of the checkpoint it was made from: the SHA-256 of the
decoder's router weights (every MoE layer below `num_hidden_layers`, in layer order, as float64
values), which are what any score ranks and which differ between any two trained models. It is
computed from the tensors, not from the path, so the same checkpoint downloaded, copied, served
over https:// or stored in another float dtype (a lossless conversion) has the same fingerprint, and
a different checkpoint at the same path does not.

`check_made_from` is what every consumer runs (the lm-eval backend's `pruning=` and `scores=`,
`moejax prune --scores-file`): a different fingerprint is refused naming both checkpoints; a
record without one (hand-made, or written before moejax recorded it) is checked by path if it
names its source, and otherwise gets a warning saying what could not be checked.

Reads router tensors only (small: E x hidden per layer); imports neither JAX nor torch.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from pathlib import Path
from typing import Callable

import numpy as np

from moejax.errors import ConfigError
from moejax.hf.layout import layer_of

FINGERPRINT_KEY = "fingerprint"
PRUNING_RECORD = "pruning.json"   # the record beside a checkpoint moejax pruned, merged or substituted


class ProvenanceWarning(UserWarning):
    """A record's source checkpoint could not be checked against the model it is applied to."""


def router_fingerprint(routers: dict) -> str:
    """'routers-sha256:<hex>' of {decoder layer: router weight [E, H]} (values hashed as float64,
    with each layer's index and shape, in layer order)."""
    digest = hashlib.sha256()
    for layer in sorted(routers):
        value = np.ascontiguousarray(np.asarray(routers[layer], dtype=np.float64))
        digest.update(f"layer {int(layer)} {list(value.shape)}\n".encode())
        digest.update(value.tobytes())
    return "routers-sha256:" + digest.hexdigest()


def checkpoint_fingerprint(checked) -> str:
    """The fingerprint of a checked checkpoint (`moejax.hf.check.CheckedCheckpoint` or an
    `OpenCheckpoint`): its decoder layers' router tensors, read (local or remote) one at a time."""
    n_layers = checked.config.num_hidden_layers
    routers = {}
    for spec in checked.specs:
        if spec.rule == "router":
            layer = layer_of(spec.hf_name)
            if layer is not None and layer < n_layers:
                routers[layer] = checked.reader.read(spec.hf_name)
    return router_fingerprint(routers)


def _same_path(recorded: str, target) -> bool:
    if "://" in str(recorded) or "://" in str(target):
        return str(recorded).rstrip("/") == str(target).rstrip("/")
    return Path(recorded).expanduser().resolve() == Path(target).expanduser().resolve()


def check_made_from(record: dict, record_path, source_key: str, target, fingerprint: Callable[[], str],
                    what: str) -> None:
    """Refuse applying `record` (read from `record_path`; it names its checkpoint under
    `source_key` and FINGERPRINT_KEY) to the checkpoint `target` when it was made from another
    one; `fingerprint()` computes target's (called only when the record has one to compare).
    `what`: what the record is, for the messages ("pruning record", "scores file")."""
    recorded_source = record.get(source_key) if isinstance(record, dict) else None
    recorded = record.get(FINGERPRINT_KEY) if isinstance(record, dict) else None
    if recorded is not None:
        actual = fingerprint()
        if recorded != actual:
            made_from = f"{recorded_source}" if recorded_source else "another checkpoint"
            raise ConfigError(
                f"{record_path}: this {what} was made from {made_from} (router fingerprint {recorded[:30]}...), "
                f"not from {target} ({actual[:30]}...): its expert indices would select another model's "
                f"experts. Apply it to the checkpoint it was made from, or make one from {target}")
        return
    if recorded_source is None:
        warnings.warn(f"{record_path}: this {what} records neither its source checkpoint ({source_key!r}) nor a "
                      f"{FINGERPRINT_KEY!r}, so it cannot be checked that it was made from {target}",
                      ProvenanceWarning, stacklevel=3)
    elif not _same_path(recorded_source, target):
        warnings.warn(f"{record_path}: this {what} was made from {recorded_source} and is applied to {target}; "
                      f"it records no {FINGERPRINT_KEY!r} (written before moejax recorded one), so whether the two "
                      "are the same checkpoint cannot be checked", ProvenanceWarning, stacklevel=3)


def scores_sidecar(path) -> tuple[dict | None, Path]:
    """(the JSON sidecar `moejax score` writes beside a scores parquet, or None when there is none
    or it is unreadable, and what to name in a message about it: the sidecar, or the parquet when
    there is no sidecar)."""
    sidecar = Path(path).with_suffix(".json")
    try:
        value = json.loads(sidecar.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None, Path(path)
    return (value, sidecar) if isinstance(value, dict) else (None, Path(path))
