"""Benchmark the lm-eval backend: `moejax` against lm-eval's own `hf` backend on stdlib_mc
(loglikelihood requests), compilation included, float32 CPU.

    python scripts/bench_lm_eval.py                  # the trained tiny model (model=tiny's path), if there
    python scripts/bench_lm_eval.py --random         # a random train_tiny-shaped model, 300-byte contexts
    python scripts/bench_lm_eval.py --n-mc 400 --batch-size 16

Both evaluate the same checkpoint on the same locally built task (`moejax.evaluation.tasks`) through
`lm_eval.simple_evaluate`, in this process, one after the other; each backend object is built
before its clock starts (loading weights is not timed), so moejax's time includes every XLA
compilation its buckets need. A second, warm moejax run shows the compiled rate. The per-request
log-likelihoods of the two are compared. Needs the test extra (lm-eval[hf], torch, transformers).
"""

from __future__ import annotations

import argparse
import os
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def random_tiny(path: Path) -> Path:
    """train_tiny's architecture with random weights (transformers'), and its byte-level tokenizer."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    from moejax.data import write_byte_tokenizer
    from moejax.training.config import ArchConfig

    torch.manual_seed(0)
    d = {k: v for k, v in ArchConfig().hf_dict().items() if k not in ("architectures", "model_type", "dtype")}
    d["initializer_range"] = 0.15  # logits that are not all alike
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**d))
    with torch.no_grad():  # decisive routers, as the parity tests' fixtures: a near-tie in routing would
        for m in model.modules():  # pick different experts in torch and XLA by rounding alone
            if hasattr(m, "e_score_correction_bias"):
                m.weight.normal_(0, 1.0)
                m.e_score_correction_bias.normal_(0, 0.3)
    model.save_pretrained(path)
    write_byte_tokenizer(path, d["max_position_embeddings"])
    return path


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default = Path(os.environ.get("MOEJAX_HOME", Path.home() / ".cache" / "moejax")) / "models" / "tiny"
    ap.add_argument("--model", type=Path, default=default if (default / "tokenizer.json").is_file() else None,
                    help="a checkpoint with tokenizer.json (default: the trained tiny model, else random)")
    ap.add_argument("--random", action="store_true", help="a random tiny-shaped model instead")
    ap.add_argument("--n-mc", type=int, default=200)
    ap.add_argument("--batch-size", type=int, default=8)
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp())
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_CACHE", str(tmp / "datasets"))
    import lm_eval
    import numpy as np
    import torch
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from moejax.evaluation.tasks import write_stdlib_tasks
    from moejax.evaluation.lm_eval import MoejaxLM

    if args.random:
        args.model = None
    ckpt = args.model or random_tiny(tmp / "tiny")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = None if args.model and (args.model / "moejax_tiny.json").is_file() else \
        [stdlib / n for n in ("textwrap.py", "difflib.py", "fractions.py", "argparse.py")]
    tasks = write_stdlib_tasks(tmp / "tasks", files, checkpoint=ckpt, n_nextline=1, n_mc=args.n_mc, n_ppl=1)
    tm = TaskManager(include_path=str(tasks), include_defaults=False)

    def run(lm):
        t0 = time.perf_counter()
        out = lm_eval.simple_evaluate(model=lm, tasks=["stdlib_mc"], task_manager=tm, bootstrap_iters=0,
                                      log_samples=True, verbosity="WARNING")
        return time.perf_counter() - t0, out

    hf_lm = HFLM(pretrained=str(ckpt), dtype="float32", batch_size=args.batch_size, device="cpu")
    t_hf, hf = run(hf_lm)
    mj_lm = MoejaxLM(pretrained=str(ckpt), dtype="float32", batch_size=args.batch_size)
    t_cold, mj = run(mj_lm)
    t_warm, _ = run(mj_lm)
    n = sum(len(s["resps"]) for s in hf["samples"]["stdlib_mc"])
    ll = lambda out: np.array([r[0][0] for s in sorted(out["samples"]["stdlib_mc"], key=lambda s: s["doc_id"])  # noqa: E731
                               for r in s["resps"]])
    a, b = ll(hf), ll(mj)
    diff = np.abs(a - b).max()
    outside = int((np.abs(a - b) > 1e-4 + 1e-6 * np.abs(a)).sum())
    print(f"{ckpt}: stdlib_mc, {len(hf['samples']['stdlib_mc'])} documents = {n} loglikelihood requests, "
          f"batch {args.batch_size}, float32; torch {torch.__version__} ({torch.get_num_threads()} threads), "
          f"{os.cpu_count()} CPU cores")
    print(f"max |log-likelihood difference| {diff:.2e}, {outside} of {n} requests beyond 1e-4 + 1e-6 |ll| "
          f"(a token routed differently by rounding changes its request by O(0.1)); acc hf {hf['results']['stdlib_mc']['acc,none']:.4f}, "
          f"moejax {mj['results']['stdlib_mc']['acc,none']:.4f}")
    print(f"{'':36s} {'seconds':>8s} {'requests/s':>11s}  ratio to hf")
    print(f"{'lm-eval hf backend (transformers)':36s} {t_hf:8.2f} {n / t_hf:11.1f}")
    print(f"{'moejax, compilation included':36s} {t_cold:8.2f} {n / t_cold:11.1f}  {t_hf / t_cold:5.2f}x")
    print(f"{'moejax, compiled (second run)':36s} {t_warm:8.2f} {n / t_warm:11.1f}  {t_hf / t_warm:5.2f}x")


if __name__ == "__main__":
    main()
