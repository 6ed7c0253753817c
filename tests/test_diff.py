"""`moejax diff`: the selection recovered from the files alone equals what pruning.json records,
for every score; tampering (a changed row, a reordering, a changed byte) is caught."""

import json

import numpy as np
import pandas as pd
import pytest

pytest.importorskip("transformers")

from hf_fixtures import make_checkpoint, rewrite  # noqa: E402

from moejax.cli import main  # noqa: E402
from moejax.hf.io.checkpoint_reader import CheckpointReader  # noqa: E402
from moejax.hf.io.safetensors_format import SafetensorsFile  # noqa: E402
from moejax.scoring.scores import rank_correlation  # noqa: E402
from moejax.surgery.diff import diff_checkpoints, match_rows  # noqa: E402
from moejax.surgery.prune import prune_checkpoint  # noqa: E402


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    path = tmp_path_factory.mktemp("diff") / "src"
    make_checkpoint(path, seed=21, n_routed_experts=16, n_group=1, topk_group=1, num_experts_per_tok=4,
                    max_shard_size="300KB")
    return path


def recorded(dst):
    return {int(l): v["kept"] for l, v in json.loads((dst / "pruning.json").read_text())["layers"].items()}


@pytest.mark.parametrize("score", ["l1", "signed", "bias", "random", "frequency"])
def test_prune_then_diff_recovers_the_recorded_selection(src, tmp_path, score):
    kwargs = {}
    if score == "frequency":  # a calibration score, from a scores file
        rng = np.random.default_rng(1)
        pd.DataFrame([{"layer": l, "expert": e, "score": score, "value": float(rng.integers(0, 50))}
                      for l in (1, 2) for e in range(16)]).to_parquet(tmp_path / "s.parquet")
        kwargs["scores_file"] = tmp_path / "s.parquet"
    dst = tmp_path / "pruned"
    prune_checkpoint(src, dst, score=score, keep=0.5, **kwargs)
    report = diff_checkpoints(src, dst, hash_tensors=True)
    assert {int(l): e["kept"] for l, e in report["layers"].items()} == recorded(dst)
    s = report["summary"]
    assert s["all_rows_identical"] and s["all_bias_identical"] and s["order_preserved"]
    assert s["other_tensors_identical"] and report["tensors"]["bytes_differ"] == []
    assert report["tensors"]["compared"] == len(CheckpointReader(dst).keys()) - 4  # all but routers and biases
    if score in ("l1", "signed", "bias"):
        assert s[f"{score}_reproduces_layers"] == "2/2"
        for entry in report["layers"].values():
            assert entry["scores"][score]["overlap"] == 8
            assert entry["scores"][score]["gap_at_cut"] > 0


def test_score_figures_against_numpy(src, tmp_path):
    dst = tmp_path / "pruned"
    prune_checkpoint(src, dst, score="signed", keep=6)
    report = diff_checkpoints(src, dst)
    r = CheckpointReader(src)
    for layer, entry in report["layers"].items():
        w = r.read(f"model.layers.{layer}.mlp.gate.weight").astype(np.float64)
        b = r.read(f"model.layers.{layer}.mlp.gate.e_score_correction_bias").astype(np.float64)
        kept = entry["kept"]
        l1 = np.abs(w).sum(1)
        top = np.argsort(-l1, kind="stable")
        assert entry["scores"]["l1"]["overlap"] == len(set(top[:6].tolist()) & set(kept))
        assert entry["scores"]["l1"]["gap_at_cut"] == pytest.approx(l1[top[5]] - l1[top[6]])
        ranks = lambda x: np.argsort(np.argsort(x))  # noqa: E731 (no ties in random floats)
        want = np.corrcoef(ranks(w.sum(1)), ranks(-b))[0, 1]
        assert entry["scores"]["signed"]["spearman_with_bias"] == pytest.approx(want)
        both = len(set(np.argsort(-w.sum(1), kind="stable")[:6].tolist()) & set(top[:6].tolist()))
        assert entry["overlap_between_scores"]["signed~l1"] == both


def test_tampering_is_caught(src, tmp_path):
    dst = tmp_path / "pruned"
    prune_checkpoint(src, dst, score="l1", keep=8)

    def tamper(name, reader):
        value = reader.read(name)
        if name == "model.layers.2.mlp.gate.weight":
            value = value[::-1].copy()  # reorder the kept experts' rows
        if name == "model.layers.1.mlp.gate.weight":
            value = value.copy()
            value[3, 0] += 1.0  # a row that is no longer a copy
        if name == "model.layers.1.self_attn.o_proj.weight":
            value = value.copy()
            value[0, 0] = np.nextafter(value[0, 0], np.float32(np.inf))  # one ulp, same name and shape
        if name == "model.layers.2.mlp.experts.0.up_proj.weight":
            value = value[:, :-1].copy()  # a wrong shape
        return [(name, value)]

    bad = rewrite(dst, tmp_path / "bad", tamper)
    report = diff_checkpoints(src, bad, hash_tensors=True)
    l1, l2 = report["layers"]["1"], report["layers"]["2"]
    assert l1["kept"][3] is None and not l1["rows_identical"]
    assert l2["rows_identical"] and not l2["order_preserved"] and l2["kept"] == recorded(dst)[2][::-1]
    differ = report["tensors"]["bytes_differ"]
    assert "model.layers.1.self_attn.o_proj.weight" in differ
    # with layer 2's rows reversed, its experts claim to be other source experts than they are
    assert {n for n in differ if n != "model.layers.1.self_attn.o_proj.weight"} == {
        f"model.layers.2.mlp.experts.{e}.{p}_proj.weight" for e in range(8) for p in ("gate", "up", "down")
    } - {"model.layers.2.mlp.experts.0.up_proj.weight"}  # that one already differs in shape
    assert [m.split(":")[0] for m in report["tensors"]["shape_or_dtype_mismatch"]] == [
        "model.layers.2.mlp.experts.0.up_proj.weight"]
    assert not report["summary"]["all_rows_identical"] and not report["summary"]["other_tensors_identical"]
    assert not diff_checkpoints(src, bad)["tensors"]["bytes_differ"]  # bytes only with --hash


def test_reads_only_routers_and_biases_without_hash(src, tmp_path, monkeypatch):
    dst = tmp_path / "pruned"
    prune_checkpoint(src, dst, score="l1", keep=8)
    read = []
    for method in ("read", "read_bytes"):
        real = getattr(SafetensorsFile, method)
        monkeypatch.setattr(SafetensorsFile, method,
                            lambda self, name, real=real: read.append(name) or real(self, name))
    diff_checkpoints(src, dst)
    assert read and all(n.endswith(("mlp.gate.weight", "e_score_correction_bias")) for n in read)


def test_match_rows_and_spearman_helpers():
    rows = [b"a", b"b", b"a", b"c"]
    assert match_rows(rows, [b"a", b"a", b"c"]) == [0, 2, 3]
    assert match_rows(rows, [b"c", b"a", b"x"]) == [3, 0, None]
    assert rank_correlation(np.array([1.0, 2, 3, 4]), np.array([10.0, 20, 30, 25])) == pytest.approx(0.8)
    assert np.isnan(rank_correlation(np.ones(3), np.arange(3.0)))


def test_cli(src, tmp_path, capsys):
    dst = tmp_path / "pruned"
    prune_checkpoint(src, dst, score="bias", keep=4)
    assert main(["diff", str(src), str(dst), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["summary"]["bias_reproduces_layers"] == "2/2"
    assert main(["diff", str(src), str(dst), "--hash"]) == 0
    text = capsys.readouterr().out
    assert "router rows byte-identical copies   yes" in text and "same bytes            yes" in text
    assert main(["diff", str(src), str(tmp_path / "nowhere")]) == 2
    assert "does not exist" in capsys.readouterr().err
