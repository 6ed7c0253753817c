"""Issue 27's records from elsewhere, merge's edges and misleading messages: each case a clear
moejax error naming the file / key / setting (or correct behaviour), checked before any long work.

Records from elsewhere: a scores file (its sidecar) and a pruning.json store the router
fingerprint of the checkpoint they were made from (`moejax.hf.provenance`); the lm-eval backend and
`moejax prune --scores-file` refuse one made from another checkpoint, and a merge's record is not
taken for a pruning."""

import dataclasses
import errno
import json
import os
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("transformers")

from hf_fixtures import make_checkpoint  # noqa: E402
from family_fixtures import hf_classes  # noqa: E402

from moejax.cli import main  # noqa: E402
from moejax.errors import ConfigError, MoejaxError  # noqa: E402
from moejax.models.registry import FAMILIES  # noqa: E402

FINGERPRINT_KEY = "fingerprint"  # moejax.hf.provenance.FINGERPRINT_KEY, as records spell it


def provenance_warning():
    from moejax.hf.provenance import ProvenanceWarning

    return ProvenanceWarning


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """Two tiny DeepSeek-V3 checkpoints of the same shapes and different weights (flat routing, 8
    experts, MoE layers 1 and 2), no tokenizer file (vocab 96: no byte-level fallback either)."""
    root = tmp_path_factory.mktemp("refusals")
    make_checkpoint(root / "src", seed=41, n_group=1, topk_group=1)
    make_checkpoint(root / "other", seed=42, n_group=1, topk_group=1)
    np.save(root / "calib.npy", np.random.default_rng(0).integers(0, 96, size=(4, 16)).astype(np.int32))
    return root


def run(argv, capsys):
    status = main([str(a) for a in argv])
    return status, capsys.readouterr().err


def edited_copy(src: Path, dst: Path, **config) -> Path:
    """A copy of `src` whose config.json has `config` applied (a value None removes the key)."""
    shutil.copytree(src, dst)
    d = json.loads((dst / "config.json").read_text())
    d.update(config)
    d = {k: v for k, v in d.items() if v is not None}
    (dst / "config.json").write_text(json.dumps(d))
    return dst


def no_pass(monkeypatch):
    """Fail the test if a calibration pass starts."""
    import moejax.inference.stream

    monkeypatch.setattr(moejax.inference.stream, "stream_layers", lambda *a, **k: pytest.fail("the calibration pass ran"))


# --------------------------------------------------------------------------------------------
# Records from elsewhere
# --------------------------------------------------------------------------------------------


def lm(monkeypatch, **kw):
    """MoejaxLM built as far as its variant (the model is never loaded)."""
    pytest.importorskip("lm_eval")
    import moejax.evaluation.lm_eval

    monkeypatch.setattr(moejax.evaluation.lm_eval, "load_pretrained", lambda *a, **k: pytest.fail("loaded the model"))
    return moejax.evaluation.lm_eval.MoejaxLM(**kw)


def test_every_record_stores_the_same_fingerprint(ckpts, tmp_path):
    """The data-free score (from the routers it read), prune's record and the checked checkpoint agree."""
    from moejax.hf.check import check_checkpoint
    from moejax.hf.provenance import checkpoint_fingerprint
    from moejax.scoring.score_checkpoint import score_data_free
    from moejax.surgery.prune import prune_checkpoint

    score_data_free(ckpts / "src", scores=["l1"], out=tmp_path / "s.parquet")
    record = prune_checkpoint(ckpts / "src", tmp_path / "pruned", score="l1", keep=4)
    sidecar = json.loads((tmp_path / "s.json").read_text())
    want = checkpoint_fingerprint(check_checkpoint(ckpts / "src"))
    assert sidecar[FINGERPRINT_KEY] == record[FINGERPRINT_KEY] == want
    assert want != checkpoint_fingerprint(check_checkpoint(ckpts / "other"))
    assert json.loads((tmp_path / "pruned" / "pruning.json").read_text())[FINGERPRINT_KEY] == want


def test_scores_file_of_another_checkpoint_is_refused_by_prune(ckpts, tmp_path, capsys):
    from moejax.scoring.score_checkpoint import score_data_free

    score_data_free(ckpts / "other", scores=["l1"], out=tmp_path / "s.parquet")
    code, err = run(["prune", ckpts / "src", tmp_path / "out", "--score", "l1", "--scores-file",
                     tmp_path / "s.parquet", "--keep", "4"], capsys)
    assert code == 2 and not (tmp_path / "out").exists()
    assert f"{tmp_path / 's.json'}: this scores file was made from {ckpts / 'other'}" in err
    assert f"not from {ckpts / 'src'}" in err
    # a copy of the checkpoint it was made from (another path, the same weights) is accepted silently
    copy = shutil.copytree(ckpts / "other", tmp_path / "copy")
    with warnings.catch_warnings():
        warnings.simplefilter("error", provenance_warning())
        assert run(["prune", copy, tmp_path / "out", "--score", "l1", "--scores-file", tmp_path / "s.parquet",
                    "--keep", "4"], capsys)[0] == 0


def test_lm_eval_refuses_records_of_another_checkpoint(ckpts, tmp_path, monkeypatch):
    from moejax.scoring.score_checkpoint import score_data_free
    from moejax.surgery.prune import prune_checkpoint

    prune_checkpoint(ckpts / "other", tmp_path / "pruned", score="l1", keep=4)
    with pytest.raises(ConfigError, match=f"this pruning record was made from {ckpts / 'other'}.*not from "
                                          f"{ckpts / 'src'}"):
        lm(monkeypatch, pretrained=str(ckpts / "src"), pruning=str(tmp_path / "pruned"))
    score_data_free(ckpts / "other", scores=["l1"], out=tmp_path / "s.parquet")
    with pytest.raises(ConfigError, match=f"this scores file was made from {ckpts / 'other'}"):
        lm(monkeypatch, pretrained=str(ckpts / "src"), scores=str(tmp_path / "s.parquet"), score="l1", keep=4)


def test_records_without_provenance_are_warned_about(ckpts, tmp_path, monkeypatch):
    import pandas as pd

    kept = {str(l): {"n_experts": 8, "kept": [0, 1, 2, 3]} for l in (1, 2)}
    (tmp_path / "pruning.json").write_text(json.dumps({"layers": kept}))
    with pytest.warns(provenance_warning(), match="records neither its source checkpoint"), \
            pytest.raises(ConfigError, match="no tokenizer.json"):  # past the variant: the record was used
        lm(monkeypatch, pretrained=str(ckpts / "src"), pruning=str(tmp_path))
    # a record of an older moejax: a source path, no fingerprint
    (tmp_path / "pruning.json").write_text(json.dumps({"source": str(ckpts / "other"), "layers": kept}))
    with pytest.warns(provenance_warning(), match=f"made from {ckpts / 'other'} and is applied to .*no 'fingerprint'"), \
            pytest.raises(ConfigError, match="no tokenizer.json"):
        lm(monkeypatch, pretrained=str(ckpts / "src"), pruning=str(tmp_path))
    pd.DataFrame([{"layer": l, "expert": e, "score": "l1", "value": float(e)} for l in (1, 2) for e in range(8)]
                 ).to_parquet(tmp_path / "s.parquet")  # no sidecar
    with pytest.warns(provenance_warning(), match="s.parquet: this scores file records neither"), \
            pytest.raises(ConfigError, match="no tokenizer.json"):
        lm(monkeypatch, pretrained=str(ckpts / "src"), scores=str(tmp_path / "s.parquet"), score="l1", keep=4)


def test_merge_of_mtp_layer_without_predictor_is_refused_and_its_record_is_not_a_pruning(ckpts, tmp_path, capsys,
                                                                                         monkeypatch):
    """An MTP layer (layer 2 of a 2-layer model, as DeepSeek-V3 ships one) without its predictor
    (enorm, hnorm, eh_proj, shared_head.norm) cannot be run by the pass that --mtp prune merges it by:
    refused before the pass naming them; with --mtp drop the layer is removed. The merge's
    pruning.json is refused by the lm-eval backend (it would evaluate the leaders pruned), pointing
    at the merged checkpoint."""
    from moejax.hf.check import check_checkpoint

    mtp = edited_copy(ckpts / "src", tmp_path / "mtp", num_hidden_layers=2, num_nextn_predict_layers=1)
    args = ["merge", mtp, tmp_path / "out", "--method", "hc_smoe", "--keep", "4", "--tokens", ckpts / "calib.npy"]
    with monkeypatch.context() as m:
        no_pass(m)
        code, err = run(args, capsys)
    assert code == 2 and "MTP layer 2 lacks 4 tensor(s) the MTP pass runs" in err and "layers.2.enorm.weight" in err
    code, err = run(args + ["--mtp", "drop"], capsys)
    assert code == 0, err
    record = json.loads((tmp_path / "out" / "pruning.json").read_text())
    assert record["dropped_layers"] == [2] and list(record["layers"]) == ["1"]
    checked = check_checkpoint(tmp_path / "out")
    assert checked.config.num_nextn_predict_layers == 0 and not checked.carried
    assert not any(".layers.2." in name for name in checked.reader.keys())
    with pytest.raises(ConfigError, match=f"the record of a merge .*pretrained={tmp_path / 'out'} without pruning="):
        lm(monkeypatch, pretrained=str(mtp), pruning=str(tmp_path / "out"))


# --------------------------------------------------------------------------------------------
# merge: every setting checked before the calibration pass
# --------------------------------------------------------------------------------------------


def test_merge_settings_refused_before_the_pass(ckpts, tmp_path, capsys, monkeypatch):
    no_pass(monkeypatch)
    base = ["merge", ckpts / "src", tmp_path / "out", "--method", "hc_smoe", "--tokens", ckpts / "calib.npy"]
    code, err = run(base + ["--keep", "4", "--hc-method", "kmeans", "--seed", "-5"], capsys)
    assert code == 2 and "seed=-5 (--seed): expected an integer >= 0 (it seeds k-means++" in err
    code, err = run([*base[:4], "ream", *base[5:], "--keep", "4", "--seed", "-1"], capsys)
    assert code == 2 and "seed=-1 (--seed): expected an integer >= 0 (it draws REAM's sample of" in err
    assert "k-means" not in err
    grouped = edited_copy(ckpts / "src", tmp_path / "grouped", n_group=4, topk_group=2)  # 2 experts per group
    base[1] = grouped
    code, err = run(base + ["--keep", "6"], capsys)
    assert code == 2 and "--keep 6 (6 clusters per MoE layer) cannot keep group-limited routing (n_group=4" in err
    assert "--collapse-groups" in err and not (tmp_path / "out").exists()


# --------------------------------------------------------------------------------------------
# toy3: every combination of its on/off switches runs or is refused by name
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("router", ["sigmoid", "softmax"])
@pytest.mark.parametrize("merges", [(), ("hc_smoe",)])
@pytest.mark.parametrize("eq6_pairs", [0, 2])
def test_toy3_switches(router, merges, eq6_pairs):
    from moejax.experiments import toy3
    from moejax.merging.method import parse

    cfg = toy3.Toy3Config(seeds=1, keep=(4,), scores=("frequency",), merges=tuple(parse(m) for m in merges),
                          eq6_pairs=eq6_pairs,
                          router=router, n_experts=8, top_k=2, d_model=4, d_hidden=8, n_calib=32, n_heldout=24,
                          balance_steps=1, offsets=("ones",), loads=("skewed",))
    if eq6_pairs and not merges:
        with pytest.raises(ConfigError, match="toy3: eq6_pairs=2 with merges=\\[\\].*set toy.eq6_pairs=0"):
            cfg.validate()
        return
    df, _ = toy3.run(cfg)
    scores = set(df.score.dropna())
    assert {s for s in scores if not s.startswith("pair:")} == {"frequency", *(f"{m}:{form}" for m in merges
                                                                              for form in ("shrunk", "tied"))}
    assert len({s for s in scores if s.startswith("pair:")}) == eq6_pairs
    assert df.metric.str.startswith("eq6_").any() == bool(eq6_pairs) and np.isfinite(df.value).all()


# --------------------------------------------------------------------------------------------
# Messages that named the wrong thing
# --------------------------------------------------------------------------------------------


def test_missing_text_file_is_named_not_the_tokenizer(ckpts, tmp_path, capsys):
    for command in (["score", ckpts / "src", "--out", tmp_path / "s.parquet"],
                    ["merge", ckpts / "src", tmp_path / "m", "--method", "m_smoe", "--keep", "4"]):
        code, err = run(command + ["--text", tmp_path / "missing.txt"], capsys)
        assert code == 2 and f"calibration text {tmp_path / 'missing.txt'}: no such file" in err, err
        assert "tokenizer" not in err


def test_empty_tokens_file_says_so(ckpts, tmp_path, capsys):
    np.save(tmp_path / "empty.npy", np.zeros((0, 16), np.int32))
    code, err = run(["score", ckpts / "src", "--tokens", tmp_path / "empty.npy", "--out", tmp_path / "s.parquet"], capsys)
    assert code == 2 and "empty.npy: holds no tokens (shape [0, 16])" in err and "[-, -]" not in err


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_transformers_spelling_is_read_and_must_agree(family):
    """transformers reads a config.json key of its attribute_map as the attribute it names
    (DeepseekV3Config: num_local_experts -> n_routed_experts, ...): moejax reads the same key as the
    same setting, and refuses two spellings that disagree by name (not, later, as tensor shapes)."""
    import transformers

    fam = FAMILIES[family]
    cls = fam.config_class
    text = cls.TEXT_CONFIG  # a wrapper (Qwen3.5-MoE, Kimi-K2.5): its language model's config class, its keys in text_config
    if text:
        hf_config = type(getattr(hf_classes(family)[0](**fam.test_config), text))
    else:
        hf_config = getattr(transformers, fam.architecture.removesuffix("ForCausalLM") + "Config")
    tiny = fam.tiny[text] if text else fam.tiny

    def config(settings: dict) -> dict:
        return {**fam.tiny, text: settings} if text else settings

    fields = {f.name for f in dataclasses.fields(cls)}
    for alias, target in hf_config.attribute_map.items():
        field = next((f for f in (target, alias) if f in fields), None)
        other = alias if field == target else target
        if field is None:
            continue
        assert cls.ALIASES.get(other) == field, (alias, target)
        value = tiny.get(field, getattr(cls, field))
        with pytest.raises(ConfigError, match=f"{other}={value + 1} \\(int\\) disagrees with {field}={value}"):
            cls.from_dict(config({**tiny, field: value, other: value + 1}))
        with pytest.raises(ConfigError, match=f"{other}={float(value)} \\(float\\), expected"):  # equal is not enough
            cls.from_dict(config({**tiny, field: value, other: float(value)}))
        alone = {k: v for k, v in tiny.items() if k != field}
        assert getattr(cls.from_dict(config({**alone, other: value})), field) == value


def test_disagreeing_expert_counts_named_by_key_and_prune_updates_every_spelling(ckpts, tmp_path, capsys):
    conflict = edited_copy(ckpts / "src", tmp_path / "conflict", num_local_experts=4)
    code, err = run(["inspect", conflict], capsys)
    assert code == 2 and "num_local_experts=4 (int) disagrees with n_routed_experts=8 (int)" in err
    assert "shape" not in err
    both = edited_copy(ckpts / "src", tmp_path / "both", num_local_experts=8)
    assert run(["prune", both, tmp_path / "pruned", "--score", "l1", "--keep", "4"], capsys)[0] == 0
    config = json.loads((tmp_path / "pruned" / "config.json").read_text())
    assert config["n_routed_experts"] == config["num_local_experts"] == 4


def test_config_naming_only_its_architecture_is_read(ckpts, tmp_path, capsys):
    """README: the family comes from model_type, then architectures."""
    only_arch = edited_copy(ckpts / "src", tmp_path / "arch", model_type=None)
    from moejax.hf.check import check_checkpoint

    assert run(["inspect", only_arch], capsys)[0] == 0
    assert check_checkpoint(only_arch).config.n_experts == 8
    other_family = edited_copy(ckpts / "src", tmp_path / "other", model_type=None, architectures=["MiniMaxM2ForCausalLM"])
    code, err = run(["inspect", other_family], capsys)
    assert code == 2 and "architectures=['MiniMaxM2ForCausalLM'] is not a supported family" in err


def test_disk_full_names_the_destination(ckpts, tmp_path, capsys, monkeypatch):
    """A failed write() names no file: the error names the output, keeps errno 28, exits 1."""
    import moejax.hf.io.checkpoint_writer as writer
    import moejax.surgery.prune as prune_module
    from moejax.hf.model_io import load_pretrained, save_pretrained

    def full(path, *args, **kwargs):
        Path(path).write_bytes(b"\0" * 64)  # part written, then the disk is full
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with monkeypatch.context() as m:
        m.setattr(prune_module, "write_safetensors_file", full)
        code, err = run(["prune", ckpts / "src", tmp_path / "out", "--score", "l1", "--keep", "4"], capsys)
    assert code == 1 and "[Errno 28]" in err and f"{tmp_path / 'out'}: could not be written (No space left" in err
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.*"))
    model = load_pretrained(ckpts / "src")
    monkeypatch.setattr(writer, "_write_safetensors", full)
    with pytest.raises(OSError, match=f"{tmp_path / 'saved'}: could not be written") as caught:
        save_pretrained(model, tmp_path / "saved")
    assert isinstance(caught.value, MoejaxError) and isinstance(caught.value, OSError)
    assert caught.value.errno == errno.ENOSPC
    assert not (tmp_path / "saved").exists() and not list(tmp_path.glob(".saved.*"))


def test_disk_full_writing_a_scores_file_names_it(ckpts, tmp_path, capsys, monkeypatch):
    import pandas as pd

    def full(self, path, *args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(pd.DataFrame, "to_parquet", full)
    code, err = run(["score", ckpts / "src", "--scores", "l1", "--out", tmp_path / "s.parquet"], capsys)
    assert code == 1 and f"{tmp_path / 's.parquet'}: could not be written (No space left on device)" in err
    assert not list(tmp_path.glob(".s.parquet*"))


def test_eval_tasks_errors_carry_its_own_name(ckpts):
    import dataclasses

    from moejax.experiments.eval_tasks import EvalTasksConfig

    prune_real = EvalTasksConfig().prune_real   # eval_tasks' composed prune_real settings (its default scores)
    with pytest.raises(ConfigError, match="^eval_tasks: set model=tiny or model.path="):
        EvalTasksConfig(prune_real=dataclasses.replace(prune_real, path="")).validate()
    with pytest.raises(ConfigError, match="^eval_tasks: dtype='float16'; expected float32 or bfloat16"):
        EvalTasksConfig(prune_real=dataclasses.replace(prune_real, path=str(ckpts / "src"), dtype="float16")).validate()
    for workers in (-1, True, 1.5):
        with pytest.raises(ConfigError, match=r"^eval_tasks: workers=.*expected an integer >= 0 \(0: one per core\)"):
            EvalTasksConfig(prune_real=dataclasses.replace(prune_real, path=str(ckpts / "src"), workers=workers)).validate()


def test_hf_location_must_name_a_repository(capsys):
    from moejax.hf.io.remote import parse_hf_location

    for location in ("hf://../../etc", "hf://org/na..me", "hf://-org/name", "hf://org/name/../../x"):
        with pytest.raises(ConfigError, match=f"^{location}: "):
            parse_hf_location(location)
    assert parse_hf_location("hf://deepseek-ai/DeepSeek-V3@main/sub") == ("deepseek-ai/DeepSeek-V3", "main", "sub")
    code, err = run(["inspect", "hf://../../etc"], capsys)
    assert code == 2 and "'..' is not a Hugging Face owner or repository name" in err and "Traceback" not in err


def test_numpy_integer_top_k_is_an_integer():
    import jax.numpy as jnp

    from moejax.inference.generate import Sampling, filtered_logits

    Sampling(1.0, np.int64(5)).validate()
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(2, 10)), jnp.float32)
    np.testing.assert_array_equal(filtered_logits(logits, Sampling(1.0, np.int64(5))),
                                  filtered_logits(logits, Sampling(1.0, 5)))
    for bad in (True, np.bool_(True), 0, np.int64(0), 2.0):
        with pytest.raises(ConfigError, match="top_k="):
            Sampling(1.0, bad).validate()
