"""How long `experiment=eval_skills` takes on one skills model, this checkout's code against an
earlier commit's (the baseline: the job as it was), on the same model, one after the other, each in
a child process with an empty compilation cache; and whether their results agree.

    python scripts/bench_eval_skills.py --model $MOEJAX_HOME/models/skills-deepseek_v3/seed-0 --old-ref b2dddb5

Prints each job's wall time, its calibration pass and task parts (timings.json), the ratio, the
FLOPs the evaluation needs (every held-out and task token of every variant through the model, the
calibration streams, the head) against the dense matmul rate of this machine, and the agreement of
every (variant, task, metric): equal, or the largest difference. Nothing else should run meanwhile.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd

ROOT = Path(__file__).resolve().parents[1]


def job(code: Path, model: Path, out: Path, overrides: list[str]) -> float:
    """Run eval_skills with the code at `code` into `out`; its wall seconds."""
    env = {**os.environ, "PYTHONPATH": str(code), "MOEJAX_JAX_CACHE": ""}
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "moejax.run", "experiment=eval_skills", f"model.path={model}",
                    f"hydra.run.dir={out}", *overrides], cwd=code, env=env, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t0


def checkout(ref: str, into: Path) -> Path:
    """The code of commit `ref` (git archive), extracted into `into`."""
    into.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "archive", ref], cwd=ROOT, check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def agreement(a: Path, b: Path) -> dict:
    key = ["method", "form", "keep", "task", "metric", "layer", "expert"]
    x, y = (pd.read_parquet(p / "results.parquet") for p in (a, b))
    m = x.merge(y, on=key, how="outer", suffixes=("_old", "_new"), indicator=True)
    both = m[m["_merge"] == "both"]
    diff = (both.value_new - both.value_old).abs()
    rel = diff / both.value_old.abs().clip(lower=1e-12)
    return {"rows_old": len(x), "rows_new": len(y), "matched": len(both), "equal": int((diff == 0).sum()),
            "max_abs_diff": float(diff.max()), "max_rel_diff": float(rel[np.isfinite(rel)].max()),
            "differing": both[diff > 0][key + ["value_old", "value_new"]].head(20).to_dict("records")}


def task_tokens(tasks: Path) -> int:
    """Tokens (bytes) the skills tasks put through the model per variant, about: each generation
    document's prompt plus its whole budget, each choice with its prompt, each log-likelihood
    document, each open prompt to its budget (an upper bound: generations stop early)."""
    import yaml

    class Loader(yaml.SafeLoader):   # lm-eval's `!function` tags read as nothing
        pass

    Loader.add_multi_constructor("!", lambda loader, suffix, node: None)
    total = 0
    for spec in sorted(tasks.glob("*.yaml")):
        task = yaml.load(spec.read_text(), Loader=Loader)
        docs = [json.loads(line) for line in Path(task["dataset_kwargs"]["data_files"]["test"]).read_text().splitlines()]
        budget = (task.get("generation_kwargs") or {}).get("max_gen_toks", 0)
        for d in docs:
            prompt = len(d["prompt"].encode())
            if task["output_type"] == "multiple_choice":
                total += sum(prompt + len(c.encode()) for c in d["choices"])
            elif task["output_type"] == "loglikelihood":
                total += prompt + len(str(d.get("answer", "")).encode()) + 1
            else:
                total += prompt + budget
    return total


def needed_flops(model: Path, run: Path) -> float:
    """About the FLOPs the evaluation needs (module docstring): tokens through the model's forward
    at the calibration pass's sequence length, per token as `moejax.training.flops` counts them."""
    from flax import nnx

    import jax.numpy as jnp

    from moejax.hf.auto import AutoModelForCausalLM
    from moejax.hf.model_io import open_checkpoint
    from moejax.training.flops import step_flops, weight_counts

    t = json.loads((run / "timings.json").read_text())
    cfg = open_checkpoint(model).config
    abstract = nnx.eval_shape(lambda: AutoModelForCausalLM.from_config(cfg, jnp.float32, rngs=nnx.Rngs(0)))
    per_token = step_flops(cfg, weight_counts(abstract), 1, 256) / 3 / 256
    held = sum(t["heldout_tokens"].values())
    variants = t["variants"]
    tokens = t["calib_tokens"] * (1 + variants // 2) + held * variants + task_tokens(run / "tasks" / "skills") * variants
    return per_token * tokens


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--old-ref", default="b2dddb5", help="the baseline's commit (default: before issue 46)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("overrides", nargs="*", help="Hydra overrides for both jobs")
    args = ap.parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="bench_eval_skills_"))
    old_code = checkout(args.old_ref, out / "old_code")
    times = {"new": job(ROOT, args.model, out / "new", args.overrides),
             "old": job(old_code, args.model, out / "old", args.overrides)}
    from moejax.training.flops import dense_matmul_gflops

    flops = needed_flops(args.model, out / "new")
    dense = dense_matmul_gflops()
    report = {"seconds": times, "ratio": times["old"] / times["new"], "needed_gflop": flops / 1e9,
              "achieved_gflops": {k: flops / v / 1e9 for k, v in times.items()}, "dense_gflops": dense,
              "timings": {k: json.loads((out / k / "timings.json").read_text()) for k in times},
              "agreement": agreement(out / "old", out / "new")}
    print(json.dumps(report, indent=1, default=str))


if __name__ == "__main__":
    main()
