"""The skills model's training step (`experiment=train_skills`, 16 x 256 bytes) in the arrangements a
several-seeds job can use, with and without micro-batches (`train.micro_batches`), all measured
in this run: one process on every core, and one process per core each training its own seed (what
`train_skills seeds=N` does). Each row gives seconds per step, per seed-step, the ratio to the
baseline (the whole batch at once, one process per core: the job before micro-batches), the
achieved FLOP rate against the dense float32 matmul rate measured in the same run on the same
cores, and what four seeds would take at that rate. With `--old-ref REF`, each row is also timed
on that git ref's code (`_timing.old_source`), in turn with this checkout's, and gets its ratio.
Each row is the best of `--repeat` rounds (with `--old-ref`, the two codes alternating), as
`_timing.best_alternating` does for in-process timings: a slow spell of the machine then lands on
both codes rather than on one.

    python scripts/bench_train_step.py [--family deepseek_v3] [--micro 1 4] [--steps 8] [--repeat 3] [--old-ref REF]

FLOPs of a step: `moejax.training.flops.step_flops` (3 x the forward's matmuls, K of E routed
experts, attention's causal half; block padding and gathers not counted).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _timing import ROOT, old_source  # noqa: E402


def settings(family: str, micro: int):
    """The train_skills recipe's typed settings for `family`, with `micro` micro-batches."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    import moejax
    from moejax.experiments.runner import experiment_config

    conf = Path(moejax.__file__).resolve().parents[1] / "conf"   # the configs beside the code run
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        cfg = compose("config", overrides=["experiment=train_skills", "model.path=/unused",
                                           f"arch.family={family}", f"train.micro_batches={micro}"])
    return experiment_config(OmegaConf.to_container(cfg, resolve=True))[1]


def child(family: str, micro: int, steps: int, warmup: int) -> dict:
    """Time `steps` training steps after `warmup` in this process (on the cores it may use)."""
    import jax
    import numpy as np

    from moejax.training.flops import dense_matmul_gflops, step_flops, weight_counts
    from moejax.training.trainer import Trainer

    cfg = settings(family, micro)
    trainer = Trainer(cfg)
    B, S = cfg.train.batch_size, cfg.data.seq_len
    ids = np.random.default_rng(0).integers(1, 256, (B, S)).astype(np.int32)
    for _ in range(warmup):
        trainer.state, m = trainer.step(trainer.state, ids)
    jax.block_until_ready(m)
    t0 = time.perf_counter()
    for _ in range(steps):
        trainer.state, m = trainer.step(trainer.state, ids)
    jax.block_until_ready(m)
    seconds = (time.perf_counter() - t0) / steps
    flops = step_flops(cfg.model_config(), weight_counts(trainer.model), B, S)
    import moejax

    return {"seconds": seconds, "flops": flops, "steps_per_seed": cfg.train.steps,
            "dense_gflops": dense_matmul_gflops(), "code": str(Path(moejax.__file__).resolve().parents[1])}


def run_children(family: str, micro: int, steps: int, warmup: int, cores: list[list[int]],
                 source: Path = ROOT) -> list[dict]:
    """One child process per entry of `cores` (the cores it is pinned to), all at once, running the
    code under `source` (this checkout, or an older ref's from `old_source`)."""
    procs = []
    env = {**os.environ, "PYTHONPATH": str(source)}
    for pinned in cores:
        cmd = [sys.executable, __file__, "--child", "--family", family, "--micro", str(micro),
               "--steps", str(steps), "--warmup", str(warmup)]
        procs.append(subprocess.Popen(["taskset", "-c", ",".join(map(str, pinned)), *cmd],
                                      stdout=subprocess.PIPE, text=True, cwd=ROOT, env=env))
    out = []
    for p in procs:
        text, _ = p.communicate()
        if p.returncode:
            raise SystemExit(f"a timing process failed (exit {p.returncode})")
        out.append(json.loads(text.strip().splitlines()[-1]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", default="deepseek_v3")
    ap.add_argument("--micro", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--seeds", type=int, default=4, help="seeds for the projected job time")
    ap.add_argument("--repeat", type=int, default=1, help="rounds per row; each row keeps its best")
    ap.add_argument("--old-ref", help="also time every row on this git ref's code, in turn with this checkout's")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.family, a.micro[0], a.steps, a.warmup)))
        return
    cores = sorted(os.sched_getaffinity(0))
    arrangements = [("one process, all cores", [cores]), ("one process per core (the job)", [[c] for c in cores])]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        old = old_source(a.old_ref, Path(tmp)) if a.old_ref else None
        for name, pinned in arrangements:
            for micro in a.micro:
                row = {"arrangement": name, "micro": micro, "procs": len(pinned)}
                for _ in range(a.repeat):
                    for key, source in [("seconds", ROOT)] + ([("old_seconds", old)] if old else []):
                        results = run_children(a.family, micro, a.steps, a.warmup, pinned, source)
                        seconds = max(r["seconds"] for r in results)   # a round ends with its slowest seed
                        if seconds < row.get(key, float("inf")):
                            row[key] = seconds
                            if key == "seconds":   # the dense rate of the same processes, each on its own core(s)
                                row.update(flops=results[0]["flops"], steps=results[0]["steps_per_seed"],
                                           dense=sum(r["dense_gflops"] for r in results))
                row["per_seed_step"] = row["seconds"] / row["procs"]
                rows.append(row)
    base = next(r for r in rows if r["procs"] > 1 and r["micro"] == 1) if 1 in a.micro else rows[0]
    print(f"{a.family} skills step, {len(cores)} cores, {a.steps} steps after {a.warmup}, best of {a.repeat}; "
          f"{rows[0]['flops'] / 1e9:.1f} GFLOP a step")
    old_head = f" {'old s/step':>10s} {'vs old':>6s}" if a.old_ref else ""
    print(f"{'arrangement':34s} {'micro':>5s} {'s/step':>7s} {'s/seed-step':>11s} {'vs base':>7s} "
          f"{'GFLOP/s':>8s} {'% dense':>7s} {f'{a.seeds} seeds':>9s}{old_head}")
    for r in rows:
        rate = r["flops"] * r["procs"] / r["seconds"] / 1e9
        minutes = math.ceil(a.seeds / r["procs"]) * r["steps"] * r["seconds"] / 60
        print(f"{r['arrangement']:34s} {r['micro']:5d} {r['seconds']:7.3f} {r['per_seed_step']:11.3f} "
              f"{base['per_seed_step'] / r['per_seed_step']:6.2f}x {rate:8.1f} {100 * rate / r['dense']:6.0f}% "
              f"{minutes:6.0f} min"
              + (f" {r['old_seconds']:10.3f} {r['old_seconds'] / r['seconds']:5.2f}x" if a.old_ref else ""))
    if a.old_ref:
        print(f"old: the code of {a.old_ref}, each row's rounds alternating with this checkout's")
    print("dense float32 matmul rate (1024^3, best of 10): "
          + ", ".join(f"{r['arrangement']}: {r['dense']:.0f} GFLOP/s" for r in rows if r["micro"] == a.micro[0]))


if __name__ == "__main__":
    main()
