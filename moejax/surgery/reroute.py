"""`moejax reroute SRC COMPRESSED DST --text ... [--steps N --lr ... --batch-size ...]`: router
distillation after any compression (`moejax.training.reroute`): the original checkpoint SRC is
the teacher, the compressed checkpoint COMPRESSED (pruned, merged or substituted by moejax, any
family) the student, whose MoE routers alone are trained to match the teacher's next-token
distribution on calibration text. DST is COMPRESSED with new router weights:

- every tensor but the decoder layers' MoE routers is COMPRESSED's bytes, every file but the
  shards (config.json, pruning.json, keep_map.json, the tokenizer, ...) copied as it is; a router is written in
  its stored dtype (the student trains it in float32);
- `reroute.json` beside it: teacher and student (paths, fingerprints), the settings, the data, the
  loss of every step, the held-out selection (`heldout`: the KL before and after on the held-out
  sequences, the step kept, whether training stopped early; `moejax.training.reroute`: the result
  is never worse than COMPRESSED on them), the teacher cache used, the time;
- written atomically (a staging folder renamed at the end).

Checked before any work: the settings, both checkpoints' headers against their configs, that
COMPRESSED was made from SRC (its pruning.json's fingerprint is SRC's), the same vocabulary and
tokenizer, the calibration data, and that `teacher_cache` is absent, an empty folder or a teacher
cache (a file is refused). Memory: the teacher runs once per batch before training (its log-probs
[B, S, V] float32 kept in memory, or on disk with `teacher_cache`); the student trains
end to end (its forward and backward through every layer), so it must fit in memory; on several
devices `mesh=` loads the student's experts split over the mesh's expert axis.

The teacher cache (`teacher_cache`, --teacher-cache DIR): batch_<i>.npy (float32 [B, S, V]) and
teacher.json (its key: the teacher's fingerprint, the tokens' hash and shape, the batch size, the
vocabulary, the dtype; written last). A cache is reused only for exactly this key (another text or
teacher is refused by name), and only after its record and every batch are checked (readable, not
truncated, float32, the expected shape, finite), before any training; every fault names the file.
It is written atomically after the teacher pass (a staging folder renamed into place; a full disk
leaves nothing and names the cache).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np

from moejax import __version__
from moejax.errors import CheckpointError, ConfigError
from moejax.hf.check import check_checkpoint
from moejax.hf.io.safetensors_format import CONFIG_NAME, numpy_dtype
from moejax.hf.io.staging import check_apart, check_destination, staged_directory, text_inputs
from moejax.hf.io.storage import require_local
from moejax.hf.keep_map import KEEP_MAP
from moejax.hf.provenance import FINGERPRINT_KEY, checkpoint_fingerprint
from moejax.hf.substitution import SubstitutedExpertsView
from moejax.parallel.mesh import MeshConfig, make_mesh
from moejax.scoring.score_checkpoint import calibration_ids
from moejax.surgery.prune import PRUNING_RECORD, other_files, write_index, write_shard
from moejax.surgery.substitute import load_substituted
from moejax.variants.spec import VariantSpec

RECORD = "reroute.json"
FLOAT_DTYPES = ("F32", "BF16", "F16", "F64")   # the router dtypes reroute writes back


def _student_record(checked) -> dict:
    path = checked.path / "pruning.json"
    if not path.is_file():
        raise CheckpointError(f"{checked.path}: no pruning.json; moejax reroute trains the routers of a checkpoint "
                              "moejax compressed (prune, merge, prune --substitute), whose record names its source")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: unreadable ({e})") from None


CACHE_RECORD = "teacher.json"   # a teacher cache's record, written last: its key and batch count
CACHE_FORMAT = 1                # the layout of a teacher cache folder (batch_<i>.npy + teacher.json)


def check_teacher_cache(cache) -> Path | None:
    """Before any work: `cache` (--teacher-cache) is absent, an empty folder (both written after the
    teacher pass) or a folder holding teacher.json (read, `_teacher_cache`); a file, or a folder of
    something else, is refused by name."""
    if cache is None:
        return None
    cache = Path(cache)
    if cache.exists() and not cache.is_dir():
        raise ConfigError(f"{cache}: --teacher-cache names a file; expected a folder (absent or empty: the teacher's "
                          f"log-probs are written there; holding {CACHE_RECORD}: read from it)")
    if cache.is_dir() and not (cache / CACHE_RECORD).exists():
        try:
            entries = sorted(p.name for p in cache.iterdir())
        except OSError as e:
            raise ConfigError(f"{cache}: --teacher-cache cannot be listed ({e.strerror or e})") from None
        if entries:
            raise ConfigError(f"{cache}: --teacher-cache is a folder without {CACHE_RECORD} holding {entries[:3]}; "
                              "expected a teacher cache, an empty folder or a new path")
    return cache


def _checked_log_probs(array, shape: tuple, where: str, cache: Path | None = None) -> np.ndarray:
    """`array` (the teacher's log-probs of one batch), checked: float32, exactly `shape` [B, S, V],
    every value finite (read one sequence at a time, so a memory-mapped batch is never loaded
    whole). where: the file (or the batch) the error names."""
    fix = f"; remove {cache} to recompute it" if cache is not None else ""
    if array.dtype != np.float32:
        raise CheckpointError(f"{where}: teacher log-probs of dtype {array.dtype}; expected float32{fix}")
    if tuple(array.shape) != tuple(shape):
        raise CheckpointError(f"{where}: teacher log-probs of shape {list(array.shape)}; expected {list(shape)} "
                              f"[batch, seq_len, vocab]{fix}")
    for j in range(array.shape[0]):
        if not np.isfinite(array[j]).all():
            raise CheckpointError(f"{where}: sequence {j}'s teacher log-probs are not finite (NaN or inf); expected "
                                  f"finite log-softmaxes{fix}")
    return array


def _read_teacher_cache(cache: Path, key: dict, shapes: list) -> list[np.ndarray] | None:
    """The cached log-probs (memory-mapped, each batch checked by `_checked_log_probs`) when `cache`
    holds teacher.json for exactly `key`; None when it holds none. Every fault names the file."""
    meta = cache / CACHE_RECORD
    if not meta.exists():
        return None
    try:
        stored = json.loads(meta.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{meta}: not UTF-8 (byte {e.start}); expected a teacher cache's JSON record: remove "
                              f"{cache} or name another folder") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{meta}: not JSON ({e}); expected a teacher cache's record: remove {cache} or name "
                              "another folder") from None
    except OSError as e:
        raise CheckpointError(f"{meta}: unreadable ({e.strerror or e})") from None
    if not isinstance(stored, dict) or not isinstance(stored.get("key"), dict) \
            or isinstance(stored.get("batches"), bool) or not isinstance(stored.get("batches"), int):
        raise CheckpointError(f'{meta}: expected {{"key": {{...}}, "batches": N}}, got {str(stored)[:200]}: '
                              f"remove {cache} or name another folder")
    if stored["key"] != key:
        differ = sorted(k for k in set(key) | set(stored["key"]) if key.get(k) != stored["key"].get(k))
        raise ConfigError(f"{cache}: a teacher cache for other data or another teacher (its {', '.join(differ)} "
                          f"differ from this run's); remove it or name another folder")
    if stored["batches"] != len(shapes):
        raise CheckpointError(f"{meta}: {stored['batches']} batches; expected {len(shapes)} for its key: remove "
                              f"{cache} to recompute it")
    out = []
    for i, shape in enumerate(shapes):
        path = cache / f"batch_{i}.npy"
        try:
            array = np.load(path, mmap_mode="r", allow_pickle=False)
        except FileNotFoundError:
            raise CheckpointError(f"{path}: missing from the teacher cache; remove {cache} to recompute it") from None
        except (OSError, ValueError, EOFError) as e:
            raise CheckpointError(f"{path}: unreadable teacher log-probs, truncated or not a .npy file ({e}); remove "
                                  f"{cache} to recompute it") from None
        out.append(_checked_log_probs(array, shape, str(path), cache))
    return out


def _teacher_cache(cache: Path | None, key: dict, shapes: list, compute) -> tuple[list[np.ndarray], bool]:
    """(The teacher's log-probs per batch, whether they came from `cache`): read from `cache` when it
    holds them for exactly this key (`_read_teacher_cache`: the record and every batch checked
    before any training), else computed (each batch checked: float32, `shapes`, finite) and, with
    a cache, written atomically (a staging folder renamed into place, teacher.json written last;
    a failed write, a full disk, leaves nothing and names the cache). `check_teacher_cache` ran
    before any work."""
    if cache is not None:
        cached = _read_teacher_cache(cache, key, shapes)
        if cached is not None:
            return cached, True
    computed = compute()
    if len(computed) != len(shapes):
        raise CheckpointError(f"the teacher pass gave {len(computed)} batches of log-probs; expected {len(shapes)}")
    out = [_checked_log_probs(a, shape, f"the teacher's log-probs of batch {i}")
           for i, (a, shape) in enumerate(zip(computed, shapes))]
    if cache is not None:
        with staged_directory(cache, overwrite=cache.exists()) as staging:   # (it exists only empty: checked)
            for i, a in enumerate(out):
                np.save(staging / f"batch_{i}.npy", a, allow_pickle=False)
            (staging / CACHE_RECORD).write_text(json.dumps({"key": key, "batches": len(out)}, indent=2) + "\n",
                                                encoding="utf-8")
    return out, False


def _check_inputs(src: Path, compressed: Path, mesh):
    """Both checkpoints' headers against their configs, that COMPRESSED was made from SRC (its
    record's fingerprint is SRC's), the same vocabulary and widths, and the mesh against every
    layer's expert count. Returns (teacher's check, student's check, the student's variant)."""
    teacher_checked = check_checkpoint(src, uniform_experts=False)
    teacher_checked.config.require_passes("rerouting (router distillation)")
    student_checked = check_checkpoint(compressed, uniform_experts=False, substituted=True)
    record = _student_record(student_checked)
    fingerprint = checkpoint_fingerprint(teacher_checked)
    if record.get(FINGERPRINT_KEY) != fingerprint:
        raise CheckpointError(f"{compressed}/pruning.json: made from a checkpoint with fingerprint "
                              f"{record.get(FINGERPRINT_KEY)!r} ({record.get('source')}), not SRC {src} "
                              f"({fingerprint!r}); the teacher must be the checkpoint it was compressed from")
    try:
        student = VariantSpec.from_record(record)
    except ConfigError as e:
        raise CheckpointError(f"{compressed}/pruning.json: {e}") from None
    tcfg, scfg = teacher_checked.config, student_checked.config
    for field in ("vocab_size", "hidden_size", "num_hidden_layers"):
        if getattr(tcfg, field) != getattr(scfg, field):
            raise CheckpointError(f"{field}: SRC {getattr(tcfg, field)}, COMPRESSED {getattr(scfg, field)}")
    for cfg_, where in ((tcfg, src), (scfg, compressed)):
        for count in sorted({cfg_.experts_in_layer(l) for l in cfg_.moe_layers}):
            mesh.check_experts(count, str(where))
    return teacher_checked, student_checked, dataclasses.replace(student, rerouted=True), record.get("settings") or {}


def reroute_checkpoint(src, compressed, dst, *, settings=None, text=None, tokens=None, seq_len: int | None = None,
                       max_tokens: int | None = None, teacher_cache=None, overwrite: bool = False,
                       progress: bool | None = None, mesh=None) -> dict:
    """Write DST (COMPRESSED with its routers distilled from SRC) and return its record (also
    DST/reroute.json). settings: a `moejax.training.reroute.RerouteSettings` (steps, learning rate,
    batch size, the held-out slice that keeps the result never worse than COMPRESSED, ...; None: its
    defaults). mesh: a `moejax.parallel.MeshConfig`; with several devices the teacher and the
    student are loaded with their routed experts split over its expert axis (the "ep" dispatch,
    gradients included) and the tokens over its data axis."""
    import jax
    import jax.numpy as jnp

    from moejax.hf.model_io import load_opened, opened
    from moejax.training.reroute import reroute, teacher_log_probs
    from moejax.training.reroute_settings import RerouteSettings

    settings = (settings or RerouteSettings()).check()
    for path, what in ((src, "SRC"), (compressed, "COMPRESSED")):
        require_local(path, f"moejax reroute ({what})")
    src, compressed, dst = Path(src), Path(compressed), Path(dst)
    check_destination(dst, overwrite, inputs=(src, compressed, text_inputs(text), tokens, teacher_cache))
    if teacher_cache is not None:   # written as well as read: never into, or over, an input
        check_apart(teacher_cache, (src, compressed, text_inputs(text), tokens), "the teacher cache (--teacher-cache)")
    teacher_cache = check_teacher_cache(teacher_cache)
    mesh = mesh or MeshConfig()
    teacher_checked, student_checked, variant_spec, method_settings = _check_inputs(src, compressed, mesh)
    tcfg, scfg = teacher_checked.config, student_checked.config
    device_mesh = make_mesh(mesh) if mesh.n_devices > 1 else None
    ids, tokenizer = calibration_ids(src, tcfg, text, tokens, seq_len, max_tokens)
    batches = [(ids[i:i + settings.batch_size], None) for i in range(0, len(ids), settings.batch_size)]
    show = sys.stderr.isatty() if progress is None else progress

    t0 = time.perf_counter()
    key = _cache_key(checkpoint_fingerprint(teacher_checked), ids, settings.batch_size, int(tcfg.vocab_size))
    shapes = [(len(b), int(ids.shape[1]), int(tcfg.vocab_size)) for b, _ in batches]

    def compute():
        teacher = load_opened(opened(teacher_checked), jnp.float32, mesh=device_mesh)
        return teacher_log_probs(teacher, batches)

    def report(i, loss):
        if show and (i % max(1, settings.steps // 20) == 0 or i == settings.steps - 1):
            print(f"reroute: step {i + 1}/{settings.steps} KL {loss:.5f}", file=sys.stderr)

    substituted = isinstance(student_checked.reader, SubstitutedExpertsView)
    with contextlib.nullcontext() if device_mesh is None else jax.set_mesh(device_mesh):
        teacher_logp, reused = _teacher_cache(teacher_cache, key, shapes, compute)
        teacher_s = time.perf_counter() - t0
        if substituted:   # its novices' constants are the student's expert maps
            student, variant = load_substituted(compressed, mesh=device_mesh)
        else:
            student, variant = load_opened(opened(student_checked), jnp.float32, mesh=device_mesh), None
        result = reroute(student, teacher_logp, batches, settings, variant, progress=report)
    routers = {ml.router: np.asarray(student.model.layers[l].mlp.router[...], np.float32)   # the trained ones
               for l, ml in student_checked.layout.moe_layers.items()
               if l < scfg.num_hidden_layers and l in result.layers}
    out = {
        "moejax_version": __version__, "method": "router distillation (arXiv 2603.02217)",
        "variant": variant_spec.record(method_settings),
        "teacher": {"path": str(src.resolve()), FINGERPRINT_KEY: key["teacher"]},
        "student": {"path": str(compressed.resolve())},
        "settings": dataclasses.asdict(settings), "trained": sorted(routers),
        "mesh": {"data": mesh.data, "expert": mesh.expert},
        "data": {"tokens": int(ids.size), "sequences": int(len(ids)), "seq_len": int(ids.shape[1]),
                 "tokenizer": tokenizer, "sha256": key["tokens"]},
        "losses": result.losses, "heldout": result.record(),
        "teacher_cache": None if teacher_cache is None else {"path": str(teacher_cache.resolve()), "reused": reused},
        "teacher_seconds": teacher_s, "train_seconds": result.seconds,
    }
    _write(student_checked.reader, routers, compressed, dst, out, overwrite)   # (a substituted view: names as stored)
    return out


def _cache_key(teacher: str, ids, batch_size: int, vocab_size: int) -> dict:
    """What the cached log-probs depend on: the teacher, the tokens, their batching, the vocabulary,
    the dtype (not the mesh: it changes them by float rounding only)."""
    return {"format": CACHE_FORMAT, "teacher": teacher,
            "tokens": hashlib.sha256(np.ascontiguousarray(ids).tobytes()).hexdigest(), "shape": list(ids.shape),
            "batch_size": batch_size, "vocab_size": vocab_size, "dtype": "float32"}


def _write(fused, routers: dict, compressed: Path, dst: Path, record: dict, overwrite: bool) -> None:
    """DST: COMPRESSED's shards with the routers replaced (in their stored dtype), its other files
    copied byte for byte (`moejax.surgery.prune.other_files`' checks: regular files inside the
    folder), its config.json, pruning.json and keep_map.json as they are, and reroute.json. fused: COMPRESSED's
    reader (stored names to the family's names: `view_name`)."""
    stored = fused.reader
    names_of = {name: fused.view_name(name) for name in stored.keys() if fused.view_name(name) in routers}
    missing = set(routers) - set(names_of.values())
    if missing:
        raise CheckpointError(f"{compressed}: router tensor(s) {sorted(missing)} not found among the stored tensors")
    values = {}   # each router in its stored dtype, checked before anything is written
    for name, view in names_of.items():
        info = stored.info(name)
        if info.dtype not in FLOAT_DTYPES:
            raise CheckpointError(f"{compressed}: router {name} is {info.dtype}; reroute writes float "
                                  f"routers only ({', '.join(FLOAT_DTYPES)})")
        value = routers[view]
        if tuple(info.shape) != value.shape:
            raise CheckpointError(f"{compressed}: router {name} is {list(info.shape)} on disk, the "
                                  f"student's {list(value.shape)}")
        values[name] = value.astype(numpy_dtype(info.dtype, name))   # (a non-finite one, an F16 overflow: the writer refuses)
    copied, _ = other_files(stored)
    copied = [r for r in copied if r.as_posix() != RECORD] + [Path(CONFIG_NAME), Path(PRUNING_RECORD)]
    copied += [Path(KEEP_MAP)] if (compressed / KEEP_MAP).is_file() else []   # its kept experts are DST's
    with staged_directory(dst, overwrite) as staging:
        weight_map, total = {}, 0
        for path in stored.files():
            tensors = [(name, values[name] if name in values else stored.info(name)) for name in stored.names_in(path)]
            if tensors:
                total += write_shard(staging, stored, path, tensors, weight_map)
        write_index(staging, stored, weight_map, total)
        for relative in copied:
            (staging / relative).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(compressed / relative, staging / relative)
        (staging / RECORD).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
