"""scripts/device_check.py (the one command a lent GPU runs) runs end to end on the CPU at tiny
shapes (`--cpu-smoke`): every section without an error, float32 logits of DeepSeek-V3 and
Qwen3-MoE against transformers within the stated tolerance, the ragged dispatch against the dense
oracle, positive rates, and no Hydra imported."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
SECTIONS = ("environment", "matmul_peak", "forward_deepseek_v3", "forward_qwen3_moe", "dispatch_ragged_vs_dense",
            "scoring_pass", "decode")


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("device_check")
    out = tmp / "x.json"
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "device_check.py"), "--cpu-smoke", "--out", str(out),
                          "--tmp", str(tmp)], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return json.loads(out.read_text())


def test_every_section_runs_without_error(report):
    assert report["complete"] and report["mode"] == "smoke"
    for name in SECTIONS:
        section = report["sections"][name]
        assert section["status"] == "ok", (name, section.get("error"), section.get("traceback"))
    assert report["summary"]["sections_failed"] == [] and report["summary"]["sections_skipped"] == []


def test_no_hydra_and_no_pandas_imported(report):
    assert report["hydra_imported"] is False
    assert report["pandas_imported"] is False


def test_environment_is_recorded(report):
    env = report["sections"]["environment"]
    assert env["jax_backend"] == "cpu" and env["torch_device"] == "cpu"
    for pkg in ("jax", "jaxlib", "flax", "numpy", "safetensors", "torch", "transformers"):
        assert env["versions"][pkg], pkg


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_moe"])
def test_forward_agrees_with_transformers(report, family):
    section = report["sections"][f"forward_{family}"]
    f32 = section["float32"]
    assert f32["routing_agreement_all_layers"] == 1.0 and f32["moe_layers_match"] and f32["moe_layers_compared"]
    assert f32["max_abs_diff_all_tokens"] < 1e-4 < f32["max_abs_logit"]   # tight, as tests/test_deepseek_v3.py
    assert f32["pass"] and f32["logits_pass"]
    bf16 = section["bfloat16"]
    assert bf16["routing_pass"] and bf16["logits_pass"] and bf16["pass"]
    assert bf16["against_float32_reference"]["tokens"] > 0
    assert section["pass"] is True
    for who in (f32["moejax"], bf16["moejax"], bf16["transformers"]):
        assert who["tflops_per_s"] > 0 and who["fraction_of_bf16_peak"] > 0 and who["tokens_per_s"] > 0


def test_ragged_dispatch_equals_dense(report):
    section = report["sections"]["dispatch_ragged_vs_dense"]
    assert section["values_float32"]["max_abs_diff_rel_to_max"] <= 1e-5
    assert section["values_float32"]["pass"] and section["values_bfloat16"]["pass"] and section["pass"]
    for backend in ("dense", "sorted", "ragged"):
        assert section["time_bfloat16"][backend]["tflops_per_s"] > 0


def test_scoring_pass_and_decode_rates(report):
    scoring = report["sections"]["scoring_pass"]
    assert scoring["pass"] and set(scoring["backends"]) == {"ragged", "sorted"}
    assert scoring["norm_sums_max_rel_diff_between_backends"] < 1e-4
    for b in scoring["backends"].values():
        assert b["counts_pass"] and b["steady"]["tokens_per_s"] > 0 and b["steady"]["fraction_of_bf16_peak"] > 0
    decode = report["sections"]["decode"]
    assert decode["pass"] and decode["tokens_equal_fraction"] >= 0.9   # float32 greedy on both sides
    for who in ("moejax", "transformers"):
        assert decode[who]["tokens_per_s"] > 0 and decode[who]["fraction_of_bf16_peak"] > 0


def test_summary_lists_every_rate_against_the_measured_peak(report):
    summary = report["summary"]
    assert summary["peak_bf16_tflops_per_s"] > 0
    assert report["sections"]["matmul_peak"]["peak_tflops_per_s"] == summary["peak_bf16_tflops_per_s"]
    assert len(summary["rates"]) >= 10
    assert all(r["tflops_per_s"] > 0 and r["fraction_of_bf16_peak"] > 0 for r in summary["rates"])
    assert all(v is True for v in summary["checks_passed"].values()) and len(summary["checks_passed"]) == 5
