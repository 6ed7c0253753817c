"""No command harms its inputs (issue 42, part 1): every command that writes (prune, prune
--substitute, merge, reroute, score, save_pretrained, the training experiments) refuses an output
equal to, inside, or holding ANY of its inputs (the checkpoints, calibration text, token files,
scores files, keep maps, the teacher cache), through one shared check
(`moejax.hf.io.staging.check_apart`), with --overwrite given (the dangerous case): exit 2, one
line naming the input, and not one byte of the tree changed."""

import hashlib
import shutil
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("transformers")

from hf_fixtures import make_checkpoint  # noqa: E402

from moejax.cli import main  # noqa: E402
from moejax.errors import CheckpointError  # noqa: E402
from moejax.hf.io.staging import check_apart, text_inputs  # noqa: E402


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    """Each input alone in a box of its own (so a DST holding the box holds that input only)."""
    root = tmp_path_factory.mktemp("inputs")
    make_checkpoint(root / "box_src" / "src", seed=3, n_group=1, topk_group=1)
    shutil.copytree(root / "box_src" / "src", root / "box_comp" / "comp")   # COMPRESSED: checked later, never reached
    (root / "box_text").mkdir()
    (root / "box_text" / "text.txt").write_text("calibration text\n" * 40)
    (root / "box_tokens").mkdir()
    np.save(root / "box_tokens" / "ids.npy", np.arange(64, dtype=np.int32).reshape(4, 16) % 96)
    (root / "box_scores").mkdir()
    (root / "box_scores" / "scores.parquet").write_bytes(b"PAR1 not read: the destination is refused first")
    (root / "box_scores" / "scores.json").write_text("{}")
    (root / "box_keep").mkdir()
    (root / "box_keep" / "keep.json").write_text('{"1": 4, "2": 4}')
    (root / "box_cache" / "cache").mkdir(parents=True)
    (root / "box_cache" / "cache" / "teacher.json").write_text("{}")
    return root


def snapshot(root: Path) -> dict:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(root.rglob("*"))}


INPUTS = {  # name -> the input's path in the tree
    "src": "box_src/src", "comp": "box_comp/comp", "text": "box_text/text.txt", "tokens": "box_tokens/ids.npy",
    "scores": "box_scores/scores.parquet", "keep": "box_keep/keep.json", "cache": "box_cache/cache",
}


def commands(root: Path, dst: Path) -> dict:
    """Each writing command with every input it takes: (argv, the inputs it reads)."""
    p = {k: root / v for k, v in INPUTS.items()}
    return {
        "prune": (["prune", p["src"], dst, "--score", "frequency", "--scores-file", p["scores"], "--keep", "4",
                   "--overwrite"], ["src", "scores"]),
        "prune-layers-keep": (["prune", p["src"], dst, "--score", "l1", "--layers-keep", p["keep"], "--overwrite"],
                              ["src", "keep"]),
        "substitute-text": (["prune", p["src"], dst, "--substitute", "--score", "mone", "--keep", "4", "--text",
                             p["text"], "--overwrite"], ["src", "text"]),
        "substitute-tokens": (["prune", p["src"], dst, "--substitute", "--score", "mone", "--keep", "4", "--tokens",
                               p["tokens"], "--overwrite"], ["tokens"]),
        "merge-text": (["merge", p["src"], dst, "--method", "hc_smoe", "--keep", "4", "--text", p["text"],
                        "--overwrite"], ["src", "text"]),
        "merge-tokens": (["merge", p["src"], dst, "--method", "ream", "--keep", "4", "--tokens", p["tokens"],
                          "--overwrite"], ["tokens"]),
        "reroute-text": (["reroute", p["src"], p["comp"], dst, "--text", p["text"], "--teacher-cache", p["cache"],
                          "--overwrite"], ["src", "comp", "text", "cache"]),
        "reroute-tokens": (["reroute", p["src"], p["comp"], dst, "--tokens", p["tokens"], "--overwrite"], ["tokens"]),
    }


CASES = [(command, name, relation) for command, (_, names) in commands(Path("/r"), Path("/d")).items()
         for name in names for relation in ("is", "is inside", "holds")]


@pytest.mark.parametrize("command,name,relation", CASES, ids=["-".join(c).replace(" ", "_") for c in CASES])
def test_no_command_writes_into_or_over_an_input(tree, capsys, command, name, relation):
    path = tree / INPUTS[name]
    dst = {"is": path, "is inside": path / "out", "holds": path.parent}[relation]
    argv, _ = commands(tree, dst)[command]
    before = snapshot(tree)
    status = main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert status == 2, err
    assert f"{relation} the input {path}" in err and err.count("\n") == 1, err
    assert snapshot(tree) == before


@pytest.mark.parametrize("out,name,relation", [("box_src/src/scores.parquet", "src", "is inside"),
                                               ("box_tokens/ids.npy", "tokens", "is"),
                                               ("box_text/text.txt", "text", "is")])
def test_score_never_writes_into_a_checkpoint_or_over_its_data(tree, capsys, out, name, relation):
    data = ["--tokens", tree / INPUTS["tokens"]] if name != "text" else ["--text", tree / INPUTS["text"]]
    before = snapshot(tree)
    status = main([str(a) for a in ["score", tree / INPUTS["src"], *data, "--out", tree / out]])
    err = capsys.readouterr().err
    assert status == 2 and f"{relation} the input {tree / INPUTS[name]}" in err, err
    assert snapshot(tree) == before


def test_reroute_never_writes_its_teacher_cache_into_a_checkpoint(tree, capsys):
    for inside in (tree / INPUTS["src"] / "cache", tree / INPUTS["comp"] / "cache"):
        before = snapshot(tree)
        status = main([str(a) for a in ["reroute", tree / INPUTS["src"], tree / INPUTS["comp"], tree / "fresh",
                                        "--tokens", tree / INPUTS["tokens"], "--teacher-cache", inside]])
        err = capsys.readouterr().err
        assert status == 2 and "the teacher cache (--teacher-cache) is inside the input" in err, err
        assert snapshot(tree) == before and not (tree / "fresh").exists()


def test_save_pretrained_and_the_writer_refuse_their_source(tree):
    from moejax import from_pretrained, save_pretrained

    src = tree / INPUTS["src"]
    model = from_pretrained(src)
    before = snapshot(tree)
    for dst, relation in ((src, "is"), (src / "copy", "is inside"), (src.parent, "holds")):
        with pytest.raises(CheckpointError, match=f"{relation} the input {src}"):
            save_pretrained(model, dst, overwrite=True)
    assert snapshot(tree) == before


def test_check_apart_follows_links_and_text_globs(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.txt").write_text("a")
    (tmp_path / "link").symlink_to(tmp_path / "data")
    with pytest.raises(CheckpointError, match="holds the input"):      # a text glob stands for what it matches
        check_apart(tmp_path / "data", text_inputs([str(tmp_path / "data" / "*.txt")]))
    with pytest.raises(CheckpointError, match="is the input"):         # a link to an input is the input
        check_apart(tmp_path / "link", [tmp_path / "data"])
    check_apart(tmp_path / "elsewhere", [tmp_path / "data", None, text_inputs(str(tmp_path / "data" / "*.txt"))])
    check_apart(tmp_path / "data2", [tmp_path / "data"])               # a name sharing a prefix is not inside
    (tmp_path / "job").mkdir()
    check_apart(tmp_path / "job", ["???"])   # other inputs are literal paths: '???' is not a glob matching 'job'


def test_text_given_as_a_glob_is_protected_where_it_matches(tree, capsys):
    before = snapshot(tree)
    assert main([str(a) for a in ["merge", tree / INPUTS["src"], tree / "box_text", "--method", "hc_smoe", "--keep",
                                  "4", "--text", tree / "box_text" / "*.txt", "--overwrite"]]) == 2
    assert f"holds the input {tree / INPUTS['text']}" in capsys.readouterr().err
    assert snapshot(tree) == before


@pytest.mark.parametrize("module,relation,args", [
    ("tasks", "is", ["--files", "box_text/text.txt", "--max-positions", "128", "--out", "box_text/text.txt"]),
    ("tasks", "holds", ["--files", "box_text/text.txt", "--max-positions", "128", "--out", "box_text"]),
    ("tasks", "is", ["--model", "box_src/src", "--files", "box_text/text.txt", "--max-positions", "128",
                     "--out", "box_src/src"]),
    ("skills_tasks", "is", ["--model", "box_src/src", "--out", "box_src/src"]),
    ("skills_tasks", "is inside", ["--model", "box_src/src", "--out", "box_src/src/tasks"]),
])
def test_the_task_writers_never_replace_their_inputs(tree, capsys, monkeypatch, module, relation, args):
    """`python -m moejax.evaluation.tasks` / `skills_tasks` replace --out whole: never a checkpoint
    (--model) or the files they read."""
    import importlib

    monkeypatch.chdir(tree)
    before = snapshot(tree)
    assert importlib.import_module(f"moejax.evaluation.{module}")._main(args) == 2
    err = capsys.readouterr().err
    assert f"the tasks folder (--out, replaced) {relation} the input" in err, err
    assert snapshot(tree) == before
