"""`moejax score` and `experiment=score`: text or token input, the written files, and errors that
leave nothing behind."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

pytest.importorskip("transformers")

from hf_fixtures import aimer_ratio, make_checkpoint  # noqa: E402

from moejax import from_pretrained  # noqa: E402
from moejax.cli import main  # noqa: E402
from moejax.scoring.observe import calibrate  # noqa: E402
from moejax.scoring.scores import ALL_SCORES  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
STDLIB_TEXT = Path(json.__file__).parent / "decoder.py"  # text that ships with Python


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("score") / "ckpt"
    make_checkpoint(path, seed=11, vocab_size=300)  # >= 256: byte-level ids fit
    return path


def test_text_scoring_writes_table_and_sidecar_equal_to_in_memory_pass(ckpt, tmp_path):
    out = tmp_path / "scores.parquet"
    assert main(["score", str(ckpt), "--text", str(STDLIB_TEXT), "--seq-len", "16", "--max-tokens", "96",
                 "--batch-size", "4", "--out", str(out)]) == 0
    df = pd.read_parquet(out)
    assert list(df.columns) == ["layer", "expert", "score", "value"]
    assert sorted(df.layer.unique()) == [1, 2] and df.expert.nunique() == 8 and set(df.score) == set(ALL_SCORES)
    assert len(ALL_SCORES) == 18  # SPEC section 2's nine, man, msan, max_act, aimer, mone, loo_reroute(_cos), ranked_vote,
    # shapley
    side = json.loads(out.with_suffix(".json").read_text())
    assert side["tokens"] == 96 and side["tokenizer"].startswith("byte-level")
    ids = np.frombuffer(STDLIB_TEXT.read_text().encode("utf-8")[:96], np.uint8).astype(np.int32).reshape(6, 16)
    want = calibrate(from_pretrained(ckpt), [(ids[:4], None), (ids[4:], None)])
    for layer, st in want.items():
        np.testing.assert_array_equal(side["layers"][str(layer)]["counts"], st.counts_E)
        for key, value in [("norm_sq_sum", st.norm_sq_sum_E), ("norm_max", st.norm_max_E),
                           ("weight_abs_sum", st.weight_abs_sum_E), ("weight_sq_sum", st.weight_sq_sum_E)]:
            np.testing.assert_allclose(side["layers"][str(layer)][key], value, rtol=1e-6, err_msg=key)
        freq = df[(df.layer == layer) & (df.score == "frequency")].sort_values("expert").value.to_numpy()
        np.testing.assert_array_equal(freq, st.counts_E)


def test_non_utf8_calibration_text_is_read_with_a_warning_naming_the_file(ckpt, tmp_path, capsys):
    """Undecodable bytes are read as U+FFFD (a run does not stop on one stray byte), and the command
    says so: the file and how many sequences; the ids are those of the replaced text. A UTF-8 file
    that holds U+FFFD itself is not counted."""
    latin = tmp_path / "latin1.txt"
    latin.write_bytes(("caf\u00e9 \ufffd ".encode("latin-1", errors="ignore") + "\ufffd".encode() +
                       b" na\xefve \xff\xfe " * 8))
    with pytest.warns(UserWarning, match=f"^{latin}: 25 byte sequence\\(s\\) are not UTF-8 and were read as U\\+FFFD"):
        assert main(["score", str(ckpt), "--text", str(latin), "--seq-len", "8", "--scores", "frequency",
                     "--out", str(tmp_path / "s.parquet")]) == 0
    clean = tmp_path / "clean.txt"
    clean.write_text("plain \ufffd text, valid UTF-8 " * 4, encoding="utf-8")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert main(["score", str(ckpt), "--text", str(clean), "--seq-len", "8", "--scores", "frequency",
                     "--out", str(tmp_path / "c.parquet")]) == 0


def test_tokenizer_json_and_npy_tokens(ckpt, tmp_path):
    from tokenizers import ByteLevelBPETokenizer

    with_tok = tmp_path / "with_tok"
    make_checkpoint(with_tok, seed=11, vocab_size=300)
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator([STDLIB_TEXT.read_text()], vocab_size=290, min_frequency=1)
    bpe.save(str(with_tok / "tokenizer.json"))
    out = tmp_path / "a.parquet"
    assert main(["score", str(with_tok), "--text", str(STDLIB_TEXT.parent / "*.py"), "--seq-len", "32",
                 "--max-tokens", "256", "--out", str(out)]) == 0
    assert "tokenizer.json" in json.loads(out.with_suffix(".json").read_text())["tokenizer"]
    ids = np.random.default_rng(0).integers(0, 300, size=(5, 12))
    np.save(tmp_path / "ids.npy", ids)
    out2 = tmp_path / "b.parquet"
    assert main(["score", str(ckpt), "--tokens", str(tmp_path / "ids.npy"), "--scores", "frequency,l1",
                 "--out", str(out2)]) == 0
    df = pd.read_parquet(out2)
    assert set(df.score) == {"frequency", "l1"}
    assert df[df.score == "frequency"].groupby("layer").value.sum().tolist() == [5 * 12 * 2] * 2  # K=2


def test_aimer_without_data_equals_numpy_on_the_safetensors_and_the_calibrated_pass(ckpt, tmp_path):
    """aimer = -(mean |w|) / sqrt(mean w^2) over each routed expert's gate, up and down entries, read
    here with safetensors: `moejax score` without data, `moejax prune --score aimer` and the
    calibration pass (the model's own copy of the weights, partial sums on the device) agree."""
    from safetensors.numpy import load_file

    from moejax.scoring.scores import compute_scores

    tensors = {k: v for f in sorted(ckpt.glob("*.safetensors")) for k, v in load_file(f).items()}
    want = {l: -np.array([aimer_ratio(*(tensors[f"model.layers.{l}.mlp.experts.{e}.{m}_proj.weight"]
                                        for m in ("gate", "up", "down"))) for e in range(8)]) for l in (1, 2)}
    out = tmp_path / "free.parquet"
    assert main(["score", str(ckpt), "--scores", "aimer,l1", "--out", str(out)]) == 0
    free = pd.read_parquet(out)
    for l in (1, 2):
        got = free[(free.layer == l) & (free.score == "aimer")].sort_values("expert").value.to_numpy()
        np.testing.assert_allclose(got, want[l], rtol=1e-12, err_msg=f"data-free aimer, layer {l}")
    assert main(["prune", str(ckpt), str(tmp_path / "pruned"), "--score", "aimer", "--keep", "4",
                 "--collapse-groups"]) == 0
    record = json.loads((tmp_path / "pruned" / "pruning.json").read_text())
    for l in (1, 2):
        assert record["layers"][str(l)]["kept"] == sorted(np.argsort(-want[l], kind="stable")[:4].tolist())
    ids = np.random.default_rng(2).integers(0, 300, size=(2, 8))
    stats = calibrate(from_pretrained(ckpt), [(ids, None)])
    for l in (1, 2):
        got = compute_scores(stats[l], ["aimer"])["aimer"]
        np.testing.assert_allclose(got, want[l], rtol=1e-6, err_msg=f"calibrated aimer, layer {l}")
        assert np.array_equal(np.argsort(-got, kind="stable"), np.argsort(-want[l], kind="stable"))


@pytest.mark.parametrize("args,match", [
    (["--text", "/no/such/file.txt"], "no such file"),
    (["--text", "{empty}"], "no text files"),
    (["--text", str(STDLIB_TEXT), "--seq-len", "100000"], "exceeds the model's max_position_embeddings=256"),
    (["--text", str(STDLIB_TEXT), "--max-tokens", "0"], "max_tokens=0 (--max-tokens): expected a positive"),
    (["--text", str(STDLIB_TEXT), "--max-tokens", "-5"], "max_tokens=-5"),
    (["--text", str(STDLIB_TEXT), "--scores", "frequency,magic"], "valid scores"),
    (["--tokens", "{bad_npy}"], "ids must lie in"),
])
def test_errors_are_clear_and_leave_no_file(ckpt, tmp_path, capsys, args, match):
    (tmp_path / "empty").mkdir()
    np.save(tmp_path / "bad.npy", np.full((2, 4), 999))
    args = [a.format(empty=tmp_path / "empty", bad_npy=tmp_path / "bad.npy") for a in args]
    out = tmp_path / "s.parquet"
    assert main(["score", str(ckpt), *args, "--out", str(out)]) == 2
    assert match in capsys.readouterr().err
    assert not out.exists() and not out.with_suffix(".json").exists()


def test_non_deepseek_checkpoint_and_bad_tokenizer(ckpt, tmp_path, capsys):
    import shutil

    other = tmp_path / "llama"
    shutil.copytree(ckpt, other)
    cfg = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**cfg, "model_type": "llama"}))
    assert main(["score", str(other), "--text", str(STDLIB_TEXT), "--out", str(tmp_path / "x.parquet")]) == 2
    assert "model_type='llama'" in capsys.readouterr().err
    broken = tmp_path / "broken"
    shutil.copytree(ckpt, broken)
    (broken / "tokenizer.json").write_text("{not json")
    assert main(["score", str(broken), "--text", str(STDLIB_TEXT), "--out", str(tmp_path / "y.parquet")]) == 2
    assert "tokenizer.json: cannot be read" in capsys.readouterr().err


def test_hydra_score_experiment(ckpt, tmp_path):
    ids = np.random.default_rng(1).integers(0, 300, size=(4, 8))
    np.save(tmp_path / "ids.npy", ids)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-m", "moejax.run", "experiment=score", f"model.path={ckpt}",
                          f"data.tokens={tmp_path / 'ids.npy'}", f"hydra.run.dir={tmp_path / 'run'}"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert "spearman_vs_frequency" in out.stdout
    df = pd.read_parquet(tmp_path / "run" / "results.parquet")
    assert set(df.score) == set(ALL_SCORES)


def test_tiktoken_model_with_kimi_split_pattern(tmp_path):
    import base64

    from moejax.data import Tokenizer

    pytest.importorskip("tiktoken")
    ckpt = tmp_path / "kimi_like"
    make_checkpoint(ckpt, seed=12, vocab_size=300)
    ranks = [bytes([i]) for i in range(256)] + [b"de", b"def", b"12", b"123", b"1234"]
    (ckpt / "tiktoken.model").write_text(
        "".join(f"{base64.b64encode(t).decode()} {r}\n" for r, t in enumerate(ranks)))
    tok = Tokenizer(ckpt, vocab_size=300)
    # "def" merges; digits are split in runs of at most 3 before merging, so "1234" never forms
    assert tok.encode("def x123456") == [257, 32, 120, 259, 52, 53, 54]  # 259 = "123", 260 = "1234"
    out = tmp_path / "k.parquet"
    assert main(["score", str(ckpt), "--text", str(STDLIB_TEXT), "--seq-len", "16", "--max-tokens", "64",
                 "--out", str(out)]) == 0
    assert "tiktoken.model" in json.loads(out.with_suffix(".json").read_text())["tokenizer"]
