"""Fault injection: every bad input a new user is likely to hand moejax, built from one small valid
checkpoint, and every fault a long job meets (signals, a full disk, an unwritable output).

For each: the exit status, a message naming the file / tensor / key, no destination (or the old
one intact), no staging folder left, and the source's bytes unchanged (hashed before and after).
Signals go to real subprocesses. Each of these cases gave a wrong result, a traceback or debris
before the shared check (`moejax.hf.check`) and the staging rules (`staged_directory`)."""

import errno
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

pytest.importorskip("transformers")

from hf_fixtures import QUANT_CONFIGS, corrupt, make_checkpoint, quantize, rewrite  # noqa: E402

from moejax.cli import main  # noqa: E402
from moejax.hf.io.checkpoint_reader import CheckpointReader  # noqa: E402
from moejax.hf.io.checkpoint_writer import write_safetensors_file  # noqa: E402
from moejax.hf.io.safetensors_format import INDEX_NAME  # noqa: E402
from moejax.hf.io.staging import STAGING_MARKER  # noqa: E402

E = 8


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    """Three layers (layer 0 dense), 8 experts, no groups, sharded with an index, a tokenizer file."""
    path = tmp_path_factory.mktemp("faults") / "src"
    make_checkpoint(path, seed=31, n_group=1, topk_group=1, max_shard_size="200KB")
    (path / "tokenizer_config.json").write_text('{"model_max_length": 256}')
    return path


def digest(folder: Path) -> str:
    """Names, link targets and bytes of everything under `folder` (links not followed)."""
    h = hashlib.sha256()
    for path in sorted(Path(folder).rglob("*")):
        h.update(str(path.relative_to(folder)).encode())
        if path.is_symlink():
            h.update(os.readlink(path).encode())
        elif path.is_file():
            h.update(path.read_bytes())
    return h.hexdigest()


def copy_of(src, dst, transform=None, config_update=None, **kw):
    return rewrite(src, dst, transform or (lambda name, reader: [(name, reader.read(name))]), config_update, **kw)


def clean(dst: Path) -> bool:
    """No destination and no staging folder beside it."""
    return not dst.exists() and not dst.is_symlink() and not list(dst.parent.glob(f".{dst.name}.*"))


def run(argv, capsys):
    status = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return status, captured.err


def refused(argv, capsys, match, source, status=2):
    """Run the command on `source`, expect `status` with one line naming the problem, nothing
    written, the source unchanged."""
    before = digest(source)
    code, err = run(argv, capsys)
    assert code == status, err
    assert match in err, err
    assert "Traceback" not in err
    assert digest(source) == before
    return err


def prune_args(source, dst, *extra):
    return ["prune", source, dst, "--score", "l1", "--keep", "4", *extra]


# --------------------------------------------------------------------------------------------
# 1. Shards that share a file name keep their relative path
# --------------------------------------------------------------------------------------------


def test_shards_in_subfolders_with_one_file_name(src, tmp_path, capsys):
    nested = tmp_path / "nested"
    shutil.copytree(src, nested)
    index = json.loads((nested / INDEX_NAME).read_text())
    shards = sorted(set(index["weight_map"].values()))
    moves = {shards[0]: "a/m.safetensors", shards[1]: "b/m.safetensors"}
    for old, new in moves.items():
        (nested / new).parent.mkdir(exist_ok=True)
        (nested / old).rename(nested / new)
    index["weight_map"] = {n: moves.get(s, s) for n, s in index["weight_map"].items()}
    (nested / INDEX_NAME).write_text(json.dumps(index))

    assert run(prune_args(nested, tmp_path / "a_out"), capsys)[0] == 0
    assert run(prune_args(src, tmp_path / "b_out"), capsys)[0] == 0
    a, b = CheckpointReader(tmp_path / "a_out"), CheckpointReader(tmp_path / "b_out")
    assert (tmp_path / "a_out" / "a" / "m.safetensors").is_file() and (tmp_path / "a_out" / "b" / "m.safetensors").is_file()
    assert a.keys() == b.keys() and all(a.read_bytes(n) == b.read_bytes(n) for n in a.keys())


# --------------------------------------------------------------------------------------------
# 2-4. What the loader refuses, every command refuses
# --------------------------------------------------------------------------------------------


def _view_int32(layer):
    def transform(name, reader):
        value = reader.read(name)
        return [(name, value.view(np.int32) if name == f"model.layers.{layer}.mlp.gate.weight" else value)]
    return transform


def _transposed(name, reader):
    value = reader.read(name)
    return [(name, value.T.copy() if name == "model.layers.1.mlp.experts.0.up_proj.weight" else value)]


BAD_SOURCES = {
    # name: (transform, config update, text the error must contain)
    "fewer_layers_in_config": (None, {"num_hidden_layers": 2}, "decoder layer(s) [2] that config.json does not account for"),
    "router_stored_as_i32": (_view_int32(2), None, "model.layers.2.mlp.gate.weight in"),
    "transposed_expert": (_transposed, None, "model.layers.1.mlp.experts.0.up_proj.weight in"),
    "top_k_zero": (None, {"num_experts_per_tok": 0}, "num_experts_per_tok=0"),
    "top_k_negative": (None, {"num_experts_per_tok": -2}, "num_experts_per_tok=-2"),
    "top_k_true": (None, {"num_experts_per_tok": True}, "num_experts_per_tok=true"),
    "experts_as_string": (None, {"n_routed_experts": "8"}, 'n_routed_experts="8"'),
    "experts_as_float": (None, {"n_routed_experts": 8.0}, "n_routed_experts=8.0"),
    "negative_hidden": (None, {"hidden_size": -64}, "hidden_size=-64"),
}


@pytest.fixture(scope="module")
def bad_sources(src, tmp_path_factory):
    root = tmp_path_factory.mktemp("bad")
    return {name: copy_of(src, root / name, transform, update, max_shard_bytes=200_000)
            for name, (transform, update, _) in BAD_SOURCES.items()}


@pytest.mark.parametrize("case", sorted(BAD_SOURCES))
@pytest.mark.parametrize("command", ["prune", "inspect", "plan", "diff", "score"])
def test_every_command_refuses_what_the_loader_refuses(bad_sources, src, tmp_path, capsys, case, command, monkeypatch):
    import moejax.scoring.observe as observe

    source, match = bad_sources[case], BAD_SOURCES[case][2]
    monkeypatch.setattr(observe, "calibrate_streamed", lambda *a, **k: pytest.fail("the pass ran"))
    argv = {"prune": prune_args(source, tmp_path / "out"), "inspect": ["inspect", source],
            "plan": ["plan", source], "diff": ["diff", source, src],
            "score": ["score", source, "--text", __file__, "--out", tmp_path / "out" / "s.parquet"]}[command]
    refused(argv, capsys, match, source)
    assert clean(tmp_path / "out")


def test_from_pretrained_refuses_surplus_layers(bad_sources):
    from moejax import from_pretrained
    from moejax.errors import CheckpointError

    with pytest.raises(CheckpointError, match=r"decoder layer\(s\) \[2\]"):
        from_pretrained(bad_sources["fewer_layers_in_config"])


def test_unindexed_tensor_is_refused_not_dropped(src, tmp_path, capsys):
    extra = tmp_path / "extra"
    shutil.copytree(src, extra)
    shard = sorted(extra.glob("*.safetensors"))[0]
    reader = CheckpointReader(extra)
    items = [(n, reader.read(n)) for n in reader.names_in(shard)] + [("model.layers.1.mlp.sneaky", np.ones(3, np.float32))]
    write_safetensors_file(shard.with_suffix(".tmp"), items)
    shard.with_suffix(".tmp").rename(shard)
    refused(prune_args(extra, tmp_path / "out"), capsys, "'model.layers.1.mlp.sneaky' in", extra)
    assert clean(tmp_path / "out")


def test_missing_fp8_scale_is_reported_missing(src, tmp_path, capsys):
    name = "model.layers.1.mlp.experts.3.down_proj.weight_scale_inv"
    fp8 = quantize("fp8_block")
    broken = copy_of(src, tmp_path / "broken", lambda n, r: [i for i in fp8(n, r) if i[0] != name],
                     {"quantization_config": QUANT_CONFIGS["fp8_block"]})
    refused(prune_args(broken, tmp_path / "out"), capsys, "without its scale tensor", broken)
    refused(["inspect", broken], capsys, f"{name!r} (missing)", broken)


# --------------------------------------------------------------------------------------------
# 4. Non-finite values
# --------------------------------------------------------------------------------------------


def _nan_at(target, index):
    def transform(name, reader):
        value = reader.read(name)
        if name == target:
            value = value.copy()
            value[index] = np.nan
            value = corrupt(value)
        return [(name, value)]
    return transform


@pytest.mark.parametrize("score", ["l1", "signed", "random"])
def test_nan_router_row_names_layer_tensor_expert(src, tmp_path, capsys, score):
    bad = copy_of(src, tmp_path / "bad", _nan_at("model.layers.2.mlp.gate.weight", (3, 5)))
    err = refused(["prune", bad, tmp_path / "out", "--score", score, "--keep", "4"], capsys,
                  "layer 2: model.layers.2.mlp.gate.weight in", bad)
    assert "expert(s) [3]" in err and clean(tmp_path / "out")
    refused(["diff", src, bad], capsys, "checks failed: all_rows_identical", bad, status=1)


def test_nan_bias_and_nan_scores_file(src, tmp_path, capsys):
    bad = copy_of(src, tmp_path / "bad", _nan_at("model.layers.1.mlp.gate.e_score_correction_bias", 6))
    err = refused(["prune", bad, tmp_path / "out", "--score", "bias", "--keep", "4"], capsys, "expert(s) [6]", bad)
    assert "e_score_correction_bias" in err
    rows = [{"layer": l, "expert": e, "score": "reap", "value": np.nan if (l, e) == (2, 1) else float(e)}
            for l in (1, 2) for e in range(E)]
    pd.DataFrame(rows).to_parquet(tmp_path / "s.parquet")
    refused(["prune", src, tmp_path / "out", "--score", "reap", "--scores-file", tmp_path / "s.parquet", "--keep", "4"],
            capsys, "layer 2: non-finite values at experts [1]", src)
    assert clean(tmp_path / "out")


def test_nan_embedding_stops_score_naming_the_tensor(src, tmp_path, capsys):
    bad = copy_of(src, tmp_path / "bad", _nan_at("model.embed_tokens.weight", (7, 0)), max_shard_bytes=200_000)
    out = tmp_path / "s.parquet"
    np.save(tmp_path / "ids.npy", np.arange(64, dtype=np.int32).reshape(4, 16) % 90)
    err = refused(["score", bad, "--tokens", tmp_path / "ids.npy", "--out", out], capsys,
                  "model.embed_tokens.weight in", bad)
    assert "token id(s) [7]" in err
    assert not out.exists() and not list(tmp_path.glob(".s.parquet*")) and not list(tmp_path.glob("s.json"))


# --------------------------------------------------------------------------------------------
# 5. Paths outside the checkpoint, links, special files
# --------------------------------------------------------------------------------------------


def _with_index_entry(src, dst, shard_path):
    shutil.copytree(src, dst)
    index = json.loads((dst / INDEX_NAME).read_text())
    name, first = next(iter(sorted(index["weight_map"].items())))
    index["weight_map"][name] = shard_path
    (dst / INDEX_NAME).write_text(json.dumps(index))
    return dst


def test_index_paths_outside_the_checkpoint(src, tmp_path, capsys):
    outside = tmp_path / "outside.safetensors"
    write_safetensors_file(outside, [("x", np.ones(2, np.float32))])
    for entry in ("../outside.safetensors", str(outside)):
        bad = _with_index_entry(src, tmp_path / f"bad{len(entry)}", entry)
        for argv in (prune_args(bad, tmp_path / "out"), ["inspect", bad]):
            refused(argv, capsys, "shard paths must be relative paths inside the checkpoint folder", bad)
        assert clean(tmp_path / "out")


def _special(kind, target_dir, outside):
    path = target_dir / "extra.bin"
    if kind == "link_outside":
        path.symlink_to(outside)
    elif kind == "folder_link_outside":
        path.symlink_to(outside.parent)
    elif kind == "dev_zero":
        path.symlink_to("/dev/zero")
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "dangling":
        path.symlink_to(target_dir / "nowhere")
    elif kind == "loop":
        path.symlink_to(target_dir / "loop2")
        (target_dir / "loop2").symlink_to(path)
    return path


SPECIAL = {"link_outside": "outside the checkpoint folder", "folder_link_outside": "outside the checkpoint folder",
           "dev_zero": "outside the checkpoint folder", "fifo": "not a regular file",
           "dangling": "does not exist", "loop": "cannot be resolved"}


@pytest.mark.parametrize("kind", sorted(SPECIAL))
def test_links_and_special_files_refused_before_any_byte(src, tmp_path, capsys, kind, monkeypatch):
    import moejax.surgery.prune as prune_module

    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    (tmp_path / "secret.txt").write_text("not yours")
    _special(kind, bad, tmp_path / "secret.txt")
    monkeypatch.setattr(prune_module, "write_pruned", lambda *a, **k: pytest.fail("wrote before checking"))
    refused(prune_args(bad, tmp_path / "out"), capsys, SPECIAL[kind], bad)
    assert clean(tmp_path / "out")


def test_shard_that_is_a_fifo_or_a_link_outside(src, tmp_path, capsys):
    for kind, match in (("fifo", "not a regular file"), ("link_outside", "outside the checkpoint folder")):
        bad = tmp_path / f"bad_{kind}"
        shutil.copytree(src, bad)
        shard = sorted(bad.glob("*.safetensors"))[0]
        moved = tmp_path / f"{kind}.safetensors"
        shard.rename(moved)
        os.mkfifo(shard) if kind == "fifo" else shard.symlink_to(moved)
        refused(["inspect", bad], capsys, match, bad)


def test_hugging_face_cache_symlinks_still_work(src, tmp_path, capsys):
    """A cache snapshot's files are links to ../../blobs/HASH: inside the cached repository."""
    repo = tmp_path / "hub" / "models--org--tiny"
    snapshot = repo / "snapshots" / "0123abc"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for f in sorted(src.iterdir()):
        blob = repo / "blobs" / hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copyfile(f, blob)
        (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
    before = digest(repo)
    assert run(prune_args(snapshot, tmp_path / "out"), capsys)[0] == 0
    assert (tmp_path / "out" / "tokenizer_config.json").read_text() == '{"model_max_length": 256}'
    assert not (tmp_path / "out" / "tokenizer_config.json").is_symlink()
    assert run(["inspect", snapshot], capsys)[0] == 0 and digest(repo) == before


# --------------------------------------------------------------------------------------------
# Destinations and outputs
# --------------------------------------------------------------------------------------------


def test_overwrite_onto_a_symlink_is_refused(src, tmp_path, capsys):
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "keep.txt").write_text("mine")
    (tmp_path / "out").symlink_to(precious)
    refused(prune_args(src, tmp_path / "out", "--overwrite"), capsys, "is a symbolic link", src)
    assert (precious / "keep.txt").read_text() == "mine" and (tmp_path / "out").is_symlink()


def test_existing_destination_names_the_flag(src, tmp_path, capsys):
    (tmp_path / "out").mkdir()
    refused(prune_args(src, tmp_path / "out"), capsys, "pass --overwrite", src)


def test_drop_mtp_with_no_moe_layer_left(src, tmp_path, capsys):
    only_mtp = copy_of(src, tmp_path / "mtp", lambda n, r: [] if n.startswith("model.layers.2.") else [(n, r.read(n))],
                       {"num_hidden_layers": 1, "num_nextn_predict_layers": 1})
    refused(prune_args(only_mtp, tmp_path / "out", "--mtp", "drop"), capsys, "--mtp drop would leave no MoE layer", only_mtp)
    assert clean(tmp_path / "out")


def test_mesh_expert_must_divide_the_experts(src, tmp_path, capsys):
    refused(["score", src, "--text", __file__, "--mesh-expert", "3", "--out", tmp_path / "s.parquet"], capsys,
            "mesh.expert=3 (--mesh-expert) does not divide the 8 routed experts", src)


def test_disk_full_is_one_line_and_leaves_nothing(src, tmp_path, capsys, monkeypatch):
    import moejax.surgery.prune as prune_module

    def full(path, *args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(prune_module, "write_safetensors_file", full)
    err = refused(prune_args(src, tmp_path / "out"), capsys, "No space left on device", src, status=1)
    assert "[Errno 28]" in err and len(err.strip().splitlines()) == 1
    assert clean(tmp_path / "out")


def test_score_output_checked_before_the_pass(src, tmp_path, capsys, monkeypatch):
    import moejax.scoring.observe as observe

    monkeypatch.setattr(observe, "calibrate_streamed", lambda *a, **k: pytest.fail("the pass ran"))
    (tmp_path / "file").write_text("")
    refused(["score", src, "--text", __file__, "--out", tmp_path / "file" / "s.parquet"], capsys,
            "cannot write the output here", src)
    refused(["score", src, "--text", __file__, "--out", tmp_path], capsys, "is a folder", src)
    if os.geteuid() != 0:  # root writes anywhere: permissions cannot be tested as root
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o555)
        refused(["score", src, "--text", __file__, "--out", ro / "s.parquet"], capsys, "Permission denied", src)
        refused(prune_args(src, ro / "out"), capsys, "not a writable folder", src)


def test_missing_parent_is_created(src, tmp_path, capsys):
    assert run(prune_args(src, tmp_path / "a" / "b" / "out"), capsys)[0] == 0
    assert (tmp_path / "a" / "b" / "out" / "pruning.json").is_file()


def test_diff_exits_nonzero_when_a_check_fails(src, tmp_path, capsys):
    assert run(prune_args(src, tmp_path / "out"), capsys)[0] == 0
    assert run(["diff", src, tmp_path / "out"], capsys)[0] == 0
    tampered = copy_of(tmp_path / "out", tmp_path / "tampered", _nan_at("model.layers.1.self_attn.o_proj.weight", (0, 0)))
    shutil.copy(tmp_path / "out" / "pruning.json", tampered / "pruning.json")
    assert run(["diff", src, tampered], capsys)[0] == 0  # same names and shapes: bytes only with --hash
    code, err = run(["diff", src, tampered, "--hash"], capsys)
    assert code == 1 and "checks failed: other_tensors_identical" in err


# --------------------------------------------------------------------------------------------
# Signals: SIGINT / SIGTERM clean up; after SIGKILL the next run does
# --------------------------------------------------------------------------------------------

SLOW_PRUNE = """
import pathlib, sys, time
import moejax.surgery.prune as prune
real = prune.write_safetensors_file
def slow(path, *args, **kwargs):
    pathlib.Path(sys.argv[1]).write_text("writing")
    time.sleep(60)
    return real(path, *args, **kwargs)
prune.write_safetensors_file = slow
from moejax.cli import main
sys.exit(main(sys.argv[2:]))
"""

SLOW_SAVE = """
import pathlib, sys, time
import moejax.hf.io.checkpoint_writer as writer
from moejax import from_pretrained, save_pretrained
model = from_pretrained(sys.argv[2])
real = writer._write_safetensors
def slow(*args, **kwargs):
    pathlib.Path(sys.argv[1]).write_text("writing")
    time.sleep(60)
    return real(*args, **kwargs)
writer._write_safetensors = slow
save_pretrained(model, sys.argv[3])
"""


def _start(script, ready, *args):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    # SIGINT back to its default in the child: a test run started in the background of a
    # non-interactive shell (as CI may be) inherits SIGINT ignored, and moejax leaves an ignored
    # signal ignored
    proc = subprocess.Popen([sys.executable, "-c", script, str(ready), *map(str, args)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    while not ready.exists():
        if proc.poll() is not None:
            pytest.fail(f"exited early: {proc.stderr.read()}")
        time.sleep(0.05)
    return proc


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_prune_signal_removes_its_staging_folder(src, tmp_path, sig):
    before = digest(src)
    proc = _start(SLOW_PRUNE, tmp_path / "ready", "prune", src, tmp_path / "out", "--score", "l1", "--keep", "4")
    assert list(tmp_path.glob(".out.tmp-*"))
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + sig, err
    assert signal.Signals(sig).name in err and "Traceback" not in err
    assert clean(tmp_path / "out") and digest(src) == before


def test_save_pretrained_sigterm_removes_its_staging_folder(src, tmp_path):
    proc = _start(SLOW_SAVE, tmp_path / "ready", src, tmp_path / "saved")
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    assert proc.returncode != 0 and clean(tmp_path / "saved")


def test_sigkill_leaves_staging_that_the_next_run_removes(src, tmp_path, capsys):
    proc = _start(SLOW_PRUNE, tmp_path / "ready", "prune", src, tmp_path / "out", "--score", "l1", "--keep", "4")
    proc.kill()
    proc.communicate(timeout=60)
    stale = list(tmp_path.glob(".out.tmp-*"))
    assert len(stale) == 1 and (stale[0] / STAGING_MARKER).is_file()
    # what moejax must never touch: no marker, or a live owner
    foreign = tmp_path / ".out.tmp-notours"
    foreign.mkdir()
    alive = tmp_path / ".out.tmp-alive"
    alive.mkdir()
    (alive / STAGING_MARKER).write_text(json.dumps({"pid": os.getpid(), "host": os.uname().nodename,
                                                    "destination": "out"}))
    assert run(prune_args(src, tmp_path / "out"), capsys)[0] == 0
    assert not stale[0].exists() and foreign.is_dir() and alive.is_dir()
    assert (tmp_path / "out" / "pruning.json").is_file()


def test_moejax_clean_removes_only_dead_staging(src, tmp_path, capsys):
    proc = _start(SLOW_PRUNE, tmp_path / "ready", "prune", src, tmp_path / "out", "--score", "l1", "--keep", "4")
    proc.kill()
    proc.communicate(timeout=60)
    (tmp_path / ".other.tmp-x").mkdir()
    code, _ = run(["clean", tmp_path], capsys)
    assert code == 0 and not list(tmp_path.glob(".out.tmp-*")) and (tmp_path / ".other.tmp-x").is_dir()


def test_mtp_layer_block_is_checked_like_any_layer(src, tmp_path, capsys):
    """An MTP layer's router is pruned and ranked too: stored as I32 it is refused, not ranked by bits."""
    def add_mtp(name, reader):
        items = [(name, reader.read(name))]
        if name.startswith("model.layers.2."):
            value = reader.read(name)
            items.append((name.replace("model.layers.2.", "model.layers.3."),
                          value.view(np.int32) if name.endswith("mlp.gate.weight") else value))
        return items

    bad = copy_of(src, tmp_path / "mtp", add_mtp, {"num_nextn_predict_layers": 1})
    for argv in (prune_args(bad, tmp_path / "out"), ["inspect", bad]):
        refused(argv, capsys, "model.layers.3.mlp.gate.weight in", bad)
    assert clean(tmp_path / "out")


def test_nan_score_names_the_layer_wherever_experts_are_selected():
    from moejax.errors import ConfigError
    from moejax.scoring.select import select_kept

    with pytest.raises(ConfigError, match=r"^layer 3: score 'reap': non-finite values \(NaN or inf\) at experts \[1\]$"):
        select_kept(np.array([1.0, np.nan, 2.0]), 1, "layer 3: score 'reap'")


def test_a_write_nested_in_a_staging_folder_keeps_it_marked(tmp_path):
    """train_tiny saves a checkpoint into its own staging folder (replacing it): the folder stays
    marked as moejax's until the outer write completes, and the result carries no marker."""
    from moejax.hf.io.checkpoint_writer import write_checkpoint
    from moejax.hf.io.staging import staged_directory

    with staged_directory(tmp_path / "out", overwrite=False) as staging:
        write_checkpoint(staging, [("a", np.ones(2, np.float32))], {"x": 1}, overwrite=True)
        assert (staging / STAGING_MARKER).is_file()
        (staging / "record.json").write_text("{}")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["config.json", "model.safetensors", "record.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
