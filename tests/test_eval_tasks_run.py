"""experiment=eval_tasks: one calibration pass, then every variant on the local tasks through the
moejax lm-eval backend; results tidy and loadable; a variant keeping every expert reproduces the
unpruned numbers exactly; bad task names fail before any calibration."""

import json
import os
import sysconfig

import numpy as np
import pandas as pd
import pytest

pytest.importorskip("transformers")
pytest.importorskip("lm_eval")

from hf_fixtures import make_checkpoint  # noqa: E402

from moejax.data import write_byte_tokenizer  # noqa: E402
from moejax.errors import ConfigError  # noqa: E402
from moejax.experiments.runner import run_job  # noqa: E402

E = 16


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("evaltasks")
    os.environ["HF_DATASETS_CACHE"] = str(root / "datasets")
    path = root / "tiny"
    make_checkpoint(path, seed=41, vocab_size=256, max_position_embeddings=512, n_routed_experts=E, n_group=4,
                    topk_group=2, num_experts_per_tok=4, eos_token_id=0, pad_token_id=0, bos_token_id=None)
    write_byte_tokenizer(path, 512)
    # what train_tiny records: the held-out files the tasks are built from
    (path / "moejax_tiny.json").write_text(json.dumps({"stdlib_root": sysconfig.get_paths()["stdlib"],
                                                       "heldout": ["textwrap.py", "fractions.py"]}))
    return path


def job(ckpt, **over):
    text = ckpt.parent / "calib.txt"
    text.write_text("def f(x):\n    return x * 2\n" * 40)
    cfg = {"name": "eval_tasks", "model": {"path": str(ckpt)}, "keep": [E, 8], "scores": ["frequency", "l1"],
           "tasks": ["stdlib_nextline", "stdlib_mc", "stdlib_ppl"],
           "lm_eval": {"n_nextline": 3, "n_mc": 6, "n_ppl": 2, "eval_batch_size": 4, "bootstrap_iters": 0},
           "workers": 1,
           "data": {"calib": [str(text)], "heldout": [str(text)], "seq_len": 32, "calib_tokens": 256,
                    "heldout_tokens": 128, "batch_size": 4}}
    for key, value in over.items():
        cfg[key] = {**cfg.get(key, {}), **value} if isinstance(value, dict) else value
    return cfg


@pytest.fixture(scope="module")
def results(ckpt, tmp_path_factory):
    out = tmp_path_factory.mktemp("job")
    run_job(job(ckpt, prune={"sequential": True}), out)
    return out, pd.read_parquet(out / "results.parquet")


def test_every_variant_on_every_task_in_a_tidy_table(results):
    out, df = results
    assert list(df.columns) == ["method", "form", "keep", "task", "metric", "value", "stderr", "layer", "expert"]
    assert df.layer.isna().all() and df.expert.isna().all()   # the routing table comes with skills tasks only
    assert json.loads((out / "status.json").read_text())["status"] == "completed"
    assert (out / "tasks" / "stdlib_mc.yaml").is_file()  # the tasks are kept beside the results
    tasks = df[df.task != "heldout"]
    variants = tasks.groupby(["method", "form", "keep"], dropna=False).task.nunique()
    assert len(variants) == 1 + 2 * 2 * 2 and (variants == 3).all()  # none + 2 modes x 2 scores x 2 keeps
    assert set(tasks.metric) == {"exact_match", "chrf", "acc", "acc_norm", "word_perplexity", "byte_perplexity",
                                 "bits_per_byte"}
    assert set(df[df.task == "heldout"].metric) == {"perplexity", "esap", "kl", "top1_agreement", "rel_error_mean"}
    assert set(df[(df.task == "heldout") & (df["form"] == "none")].metric) == {"perplexity"}   # the reference

    from moejax.results import load

    loaded = load(out)
    assert len(loaded) == len(df) and loaded.value.dtype == float


def test_keeping_every_expert_reproduces_the_unpruned_model_exactly(results):
    _, df = results
    base = df[df["form"] == "none"].set_index(["task", "metric"]).value
    agreement = ["esap", "kl", "top1_agreement"]   # against the unpruned model, which has none of its own
    full = df[(df.keep == E) & ~df.metric.isin(["rel_error_mean", *agreement])]
    assert len(full) == 2 * 2 * len(base)
    same = df[(df.keep == E) & df.metric.isin(agreement)].set_index("metric").value
    assert len(same) == 2 * 2 * 3 and np.allclose(same.drop("kl"), 1.0, atol=1e-5) and np.allclose(same["kl"], 0, atol=1e-6)
    for _, row in full.iterrows():
        assert row.value == base[(row.task, row.metric)], (row.task, row.metric)
    pruned = df[(df.keep == 8) & (df.metric == "bits_per_byte")]
    assert (pruned.value != base[("stdlib_ppl", "bits_per_byte")]).all()  # pruning half changes every variant


def test_requests_built_once_give_what_each_variant_built_afresh_gives(results, ckpt):
    """The job builds lm-eval's requests for its first variant and reads them back for the others;
    lm-eval building them afresh for the unpruned model gives the job's numbers exactly (and the
    keep=all variants, read back, equal the unpruned: the test above). No request cache is left."""
    from lm_eval import evaluator
    from lm_eval.tasks import TaskManager

    from moejax.evaluation.lm_eval import MoejaxLM

    out, df = results
    assert not (out / "lm_eval_requests").exists()
    tm = TaskManager(include_path=str(out / "tasks"), include_defaults=False)
    afresh = evaluator.evaluate(lm=MoejaxLM(pretrained=str(ckpt), batch_size=4),
                                task_dict=tm.load(["stdlib_nextline", "stdlib_mc", "stdlib_ppl"]),
                                bootstrap_iters=0, log_samples=False)
    from moejax.experiments.task_workers import task_rows

    want = {(r["task"], r["metric"]): r["value"] for r in task_rows(afresh, {})}
    got = df[(df["form"] == "none") & (df.task != "heldout")].set_index(["task", "metric"]).value
    assert len(want) == len(got) > 0
    for key, value in want.items():
        assert got[key] == value or (np.isnan(got[key]) and np.isnan(value)), key


def test_variants_in_two_processes_equal_one_process(results, ckpt, tmp_path):
    """workers=2 (a process per core: each carries half the variants through the calibration pass,
    then evaluates every other variant on the tasks) gives every variant's every task metric of the
    one-process run, within float32 reordering (a process on one core sums in another order than
    one on two)."""
    _, one = results
    out = tmp_path / "two"
    run_job(job(ckpt, prune={"sequential": True}, workers=2), out)
    two = pd.read_parquet(out / "results.parquet")
    timings = json.loads((out / "timings.json").read_text())
    assert timings["task_workers"] == timings["pass_workers"] == 2
    key = ["method", "form", "keep", "task", "metric"]
    merged = one.merge(two, on=key, how="outer", suffixes=("_one", "_two"), indicator=True)
    assert (merged["_merge"] == "both").all() and len(merged) == len(one) == len(two)
    np.testing.assert_allclose(merged.value_two, merged.value_one, rtol=1e-5, atol=1e-6)
    assert not (out / "lm_eval_requests").exists()


def test_unknown_task_fails_before_the_calibration_pass(ckpt, tmp_path, monkeypatch):
    from moejax.experiments import prune_real

    monkeypatch.setattr(prune_real, "evaluate", lambda *a, **k: pytest.fail("calibrated"))
    from moejax.evaluation.tasks import write_stdlib_tasks

    stdlib = sysconfig.get_paths()["stdlib"]
    tasks = write_stdlib_tasks(tmp_path / "tasks", [f"{stdlib}/textwrap.py"], n_nextline=1, n_mc=1, n_ppl=1)
    with pytest.raises(ConfigError, match=r"unknown task\(s\) \['stdlib_nope'\]; looked in .*tasks"):
        run_job(job(ckpt, tasks=["stdlib_mc", "stdlib_nope"],
                    lm_eval={"include_defaults": False, "task_dir": str(tasks)}), tmp_path / "a")
    with pytest.raises(ConfigError, match="need task_dir"):
        run_job(job(ckpt, tasks=["stdlib_nope"], lm_eval={"include_defaults": False}), tmp_path / "a2")
    with pytest.raises(ConfigError, match="below top_k=4"):
        run_job(job(ckpt, keep=[2]), tmp_path / "b")
    with pytest.raises(ConfigError, match="unknown score"):
        run_job(job(ckpt, scores=["frequency", "nonsense"]), tmp_path / "c")


@pytest.mark.slow  # indexes every task lm-eval ships (about 30 s)
def test_a_hub_task_offline_names_the_dataset_it_needs(ckpt, tmp_path, monkeypatch):
    from moejax.experiments import prune_real

    monkeypatch.setattr(prune_real, "evaluate", lambda *a, **k: pytest.fail("calibrated"))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ConfigError, match=r"'arc_easy'.*allenai/ai2_arc.*need the network"):
        run_job(job(ckpt, tasks=["arc_easy"]), tmp_path / "net")


def test_notebook_code_runs_on_a_run(results, tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    import nbformat

    root = Path(__file__).resolve().parents[1]
    nb = nbformat.read(root / "experiments" / "eval_tasks" / "eval_tasks.ipynb", as_version=4)
    code = "\n\n".join(c.source for c in nb.cells if c.cell_type == "code")
    env = {**os.environ, "PYTHONPATH": str(root), "MPLBACKEND": "Agg", "MOEJAX_EVAL_RESULTS": str(results[0]),
           "MOEJAX_EVAL_FIGURE": str(tmp_path / "tasks.png")}
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "tasks.png").stat().st_size > 5_000


@pytest.mark.slow
def test_merged_variants_on_the_tasks(ckpt, tmp_path, monkeypatch):
    """merges=[hc_smoe]: each merge under both router forms is a variant on every task; at keep=E
    (every cluster a singleton) it reproduces the unpruned numbers exactly. Each layer is merged
    once per keep, by the calibration pass: the tasks get its plans (no second merge)."""
    from moejax.merging import layer as merging_layer
    from moejax.models.registry import read_config

    import moejax.evaluation.carried as carried

    calls = []   # every merge's experts are made from its merge_averaging (merged_rows and the carried pass call it)
    real = merging_layer.merge_averaging
    counted = lambda *a, **k: calls.append(a[0]) or real(*a, **k)  # noqa: E731
    monkeypatch.setattr(merging_layer, "merge_averaging", counted)
    monkeypatch.setattr(carried, "merge_averaging", counted)   # (the carried pass imports it by name)
    run_job(job(ckpt, scores=["frequency"], merges=["hc_smoe"], tasks=["stdlib_ppl"]), tmp_path)
    assert len(calls) == 2 * len(read_config(ckpt / "config.json").moe_layers)   # 2 keeps
    df = pd.read_parquet(tmp_path / "results.parquet")
    tasks = df[df.task == "stdlib_ppl"]
    base = tasks[tasks["form"] == "none"].set_index("metric").value
    for form in ("tied", "shrunk"):
        merged = tasks[(tasks["form"] == form) & (tasks.method == "hc_smoe")]
        assert set(merged.keep) == {E, 8}
        for _, row in merged[merged.keep == E].iterrows():
            assert row.value == base[row.metric]
        assert (merged[(merged.keep == 8) & (merged.metric == "bits_per_byte")].value != base["bits_per_byte"]).all()


def test_rerouted_variants_on_the_tasks(ckpt, tmp_path, monkeypatch):
    """prune.reroute=true: each variant is also evaluated with its routers distilled, once (the pass
    trains them; the tasks get the rerouted expert maps), as rows with rerouted=True beside its own.
    (The routers kept are the best measured on held-out calibration sequences, the variant's own
    included; on this random model step 2 beats them there and step 3 does not, so the spy measures
    after every step, not only after the last, for the rerouted rows to differ.)"""
    import dataclasses

    from moejax.training import reroute as rr

    calls = []
    real = rr.train_routers
    monkeypatch.setattr(rr, "train_routers", lambda model, teacher, batches, settings, *a, **k: calls.append(1) or real(
        model, teacher, batches, dataclasses.replace(settings, eval_every=1), *a, **k))
    run_job(job(ckpt, keep=[8], scores=["frequency"], tasks=["stdlib_ppl"], prune={"reroute": True},
                router_distillation={"steps": 3, "warmup": 0, "lr": 5e-3, "batch_size": 4}), tmp_path)
    assert len(calls) == 1
    df = pd.read_parquet(tmp_path / "results.parquet")
    assert df.rerouted.dtype == bool
    ppl = df[(df.task == "stdlib_ppl") & (df.metric == "bits_per_byte") & (df.method == "frequency")]
    assert sorted(ppl.rerouted) == [False, True] and ppl.value.nunique() == 2
    held = df[(df.task == "heldout") & (df.method == "frequency")]
    assert set(held[held.rerouted].metric) == {"perplexity", "esap", "kl", "top1_agreement", "reroute_kl_first",
                                               "reroute_kl_last"}
