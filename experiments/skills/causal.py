"""The causal importance of every expert of the skills models, and whether any observational score
predicts it (experiments/skills/README.md, "Causal importance"):

    python experiments/skills/causal.py $MOEJAX_HOME/models/skills-deepseek_v3/seed-{0,1,2,3} --out causal-dsv3

For each model (moejax.evaluation.causal, moejax.evaluation.causal_stats):
- causal.parquet: every single-expert removal (re-routed as pruning does) on each task's held-out
  documents: per skill `--docs` documents (prompt -> answer and terminator), and "code" (`--docs`
  windows of held-out code, 16 bytes of context then 48 to predict); nll, exact_match and their
  changes, per (layer, expert, task).
- scores.parquet: every observational score the model supports, measured two ways: calibration
  "code" (the eval_skills calibration: prune_real's default code text and token count) and
  calibration "task" (each task's own documents, the very tokens the causal side scores).
- paired_d.parquet: the causal audit's paired statistic (arXiv 2606.10703) per (calibration, score,
  layer, task), over every continuation token of the task, from zeroing each expert (no re-routing).
- timings.json: seconds per part.

`make_tables.py --causal DIR [DIR ...]` reads these.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import pandas as pd

CONTEXT, PREDICT = 16, 48   # a code window: bytes of context, bytes predicted


def task_docs(path: Path, n: int, seed: int = 0) -> dict:
    """{task: [(context, continuation)]}: each skill's held-out documents and held-out code windows."""
    from moejax.data import read_text
    from moejax.evaluation.tasks import heldout_files
    from moejax.training.skills import SKILLS, TERMINATOR, documents

    docs = {s: [(p, a + TERMINATOR) for p, a in documents(s, n, seed, "heldout")] for s in SKILLS}
    code = "".join(read_text(f) for _, f in heldout_files(path)[:4]).encode("utf-8")
    step = max(CONTEXT + PREDICT, len(code) // n)
    docs["code"] = [(code[i:i + CONTEXT], code[i + CONTEXT:i + CONTEXT + PREDICT])
                    for i in range(0, len(code) - CONTEXT - PREDICT, step)][:n]
    return docs


def observational(path: Path, docs: dict, seed: int = 0) -> pd.DataFrame:
    """Every score the model supports, on the eval_skills calibration ("code") and on each task's
    own documents ("task")."""
    from moejax.evaluation.causal import DocBatch
    from moejax.data import Tokenizer
    from moejax.experiments.prune_real import PruneRealConfig, calibration_tokens, default_texts, file_tokens
    from moejax.hf.model_io import open_checkpoint
    from moejax.scoring.observe import calibrate_streamed
    from moejax.scoring.score_checkpoint import score_table
    from moejax.scoring.scores import pass_needs, scores_for

    ckpt = open_checkpoint(path)
    names = scores_for(None, ckpt.config.HAS_BALANCE_BIAS, str(path))
    needs = pass_needs(names)
    cfg = PruneRealConfig(path=str(path), seed=seed)
    tok = Tokenizer(str(path), ckpt.config.vocab_size)
    calib = calibration_tokens(cfg, default_texts(cfg)[0], tok, file_tokens(tok, cfg.seq_len))
    frames = []
    stats = calibrate_streamed(ckpt, [(calib[i:i + 8], None) for i in range(0, len(calib), 8)], **needs)
    frames.append(score_table(stats.items(), names).assign(calibration="code", task="all"))
    for task, pairs in docs.items():
        batch = DocBatch.of({task: pairs})
        mask = batch.ids_NS > 0          # the documents' bytes (never NUL), not the padding
        rows = [(batch.ids_NS[i:i + 16], mask[i:i + 16].astype(np.int32)) for i in range(0, len(batch.ids_NS), 16)]
        stats = calibrate_streamed(ckpt, rows, **needs)
        frames.append(score_table(stats.items(), names).assign(calibration="task", task=task))
    return pd.concat(frames, ignore_index=True)


def paired(docs: dict, scores: pd.DataFrame, model) -> pd.DataFrame:
    """The paired statistic per (calibration, score, layer, task) over each task's continuation tokens."""
    from moejax.evaluation.causal import DocBatch, chosen_experts, zeroing_deltas
    from moejax.evaluation.causal_stats import paired_d

    batch = DocBatch.of(docs)
    deltas = zeroing_deltas(model, batch)
    chosen = chosen_experts(model, batch)
    rows = []
    for (calibration, task_of_score, score, layer), sc in scores.groupby(["calibration", "task", "score", "layer"]):
        score_E = sc.sort_values("expert").value.to_numpy(float)
        for task in docs:
            if task_of_score not in ("all", task):
                continue
            positions = batch.continuation_NS & (batch.task_N == task)[:, None]
            rows.append(dict(calibration=calibration, score=score, layer=layer, task=task,
                             **paired_d(deltas, chosen[layer], score_E, positions, layer)))
    return pd.DataFrame(rows)


def one_model(path: Path, n_docs: int) -> tuple[dict, dict]:
    from moejax.evaluation.causal import causal_importance
    from moejax.hf.model_io import load_pretrained

    timings = {}
    t = time.perf_counter()
    docs = task_docs(path, n_docs)
    model = load_pretrained(path)
    causal = causal_importance(model, docs)
    timings["removals_s"] = time.perf_counter() - t
    t = time.perf_counter()
    scores = observational(path, docs)
    timings["scores_s"] = time.perf_counter() - t
    t = time.perf_counter()
    d = paired(docs, scores, model)
    timings["paired_s"] = time.perf_counter() - t
    return {"causal": causal, "scores": scores, "paired_d": d}, timings


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--docs", type=int, default=100, help="held-out documents per task (default 100)")
    args = ap.parse_args(argv)
    from moejax.hf.io.staging import check_apart

    check_apart(args.out, args.models, "--out")   # never into (or around) a model it reads
    args.out.mkdir(parents=True, exist_ok=True)
    tables, timings = {}, {}
    for path in args.models:
        name = f"{path.parent.name}/{path.name}"
        got, timings[name] = one_model(path, args.docs)
        for key, df in got.items():
            tables.setdefault(key, []).append(df.assign(model=name))
        print(f"{name}: {timings[name]}", flush=True)
    for key, frames in tables.items():
        pd.concat(frames, ignore_index=True).to_parquet(args.out / f"{key}.parquet")
    (args.out / "timings.json").write_text(json.dumps(timings, indent=1) + "\n")


if __name__ == "__main__":
    main()
