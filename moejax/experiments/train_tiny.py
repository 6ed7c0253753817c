"""`python -m moejax.run experiment=train_tiny`: train a small model of any registered family
(`arch.family=deepseek_v3` by default, `arch.family=qwen3_moe`, ...) on the Python standard library's sources (byte-level, vocab 256) and save it as a Hugging Face checkpoint
at `model=tiny`'s path, for `python -m moejax.run experiment=prune_real model=tiny`.

What it does
- Data: the standard library's *.py files (skipping site-packages and the test suites) plus any
  files named in `data.text`, split *by file* into training and held-out files: a file is held
  out when a stable hash (sha256) of its relative path falls in `data.heldout_fraction`, and the
  files of `data.heldout_always` always are. The model never sees a held-out file. Training
  batches are random windows of `seq_len` bytes of the concatenated training files; batch `i` is a
  pure function of (seed, i), so a resumed run sees exactly the batches an uninterrupted one would.
- Skills (`data.mix`, `experiment=train_skills`): shares of training bytes for the code and for
  generated skills documents (moejax.training.skills: add, sort, rev, kv, close, up). Each row of
  a batch is a code window with probability `code`, else a window of the shuffled skills stream
  starting at a document's first byte. Held-out skills documents (a stable hash of the prompt)
  never occur in training; at every evaluation the model's greedy exact match on
  `data.skill_eval_docs` of them per skill is recorded (metric skill_exact_match, column skill:
  the learning curve; the last values also in moejax_tiny.json as skills_exact_match).
- Model: the family's moejax model at its `tiny` preset (moejax/models/<family>/presets.py: TINY,
  with `+arch.KEY=VALUE` overriding config.json keys; the default is the DeepSeek-V3 tiny model:
  MLA, sigmoid router with e_score_correction_bias, group-limited routing, shared expert, dense
  first layer), float32, "sorted" dispatch.
- Training: AdamW (weight decay on matrices only), linear warmup then cosine decay, global-norm
  clipping, next-token cross-entropy in float32. Routing balance as each family trains it: with a
  balance bias (DeepSeek-V3, GLM-4.5) auxiliary-loss-free, after each step, in each MoE layer,
  bias_e += rate * sign(mean_load - load_e) with load_e the routing decisions expert e got in that
  step's batch; without one (softmax routers) the balance loss alpha * sum_e f_e P_e (DeepSeek-V3
  eq. 17-20; P_e the router's probabilities, the Switch/OLMoE form), alpha 0.01 unless
  `train.aux_loss_alpha` says otherwise (0 with a bias).
- Resume: orbax checkpoints every `train.checkpoint_every` steps (and at the end) in
  `<model.path>.orbax/` (parameters, balance biases, optimizer state, step, seed, loss history, a
  fingerprint of the settings). Rerunning the same command resumes from the latest one and
  continues to `train.steps` (the cosine ends at the new `train.steps` unless `train.decay_steps`
  fixes it); different settings are refused unless `train.resume=false`, which starts over.
- Cost: the defaults (4 layers, 32 experts top 4, hidden 128, 1600 steps of 16 x 128 bytes, ~3.3M
  tokens) take about 10 minutes on 2 idle CPU cores (~6,000 tokens/s) and about 15-17 on cores
  shared with another job (~3,300 tokens/s measured); held-out loss ~1.55 nats/byte (ppl ~4.7).
- Output: `moejax.save_pretrained` into a staged folder plus `moejax_tiny.json` (stdlib root,
  training and held-out files, config, steps, losses, seconds, versions) and a byte-level Hugging
  Face tokenizer (`moejax.data.write_byte_tokenizer`: id == UTF-8 byte, byte 0 is eos/pad, no
  BOS), renamed into place as one folder (`moejax.hf.io.staging.staged_directory`).

Results: a tidy table with columns step, metric, layer, value; metrics train_loss (every step),
lr, train_max_load_share (largest expert share of the step's routing decisions, mean over MoE
layers; 1/E is perfect balance), heldout_loss / heldout_ppl (nats per byte; at eval steps and at
the end), max_load_share and bias_min / bias_max per MoE layer (held-out tokens, at the end),
start_step (0, or the step a resumed run started from).

Where the pieces live (moejax.training): the settings in `config`, the corpus and batches in
`corpus`, the loss, optimizer, step and `Trainer` in `trainer`, the orbax checkpoints in
`checkpoints`, the progress line in `progress`; this module runs them and writes the results.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import platform
import shutil
import time
from pathlib import Path

import numpy as np
import pandas as pd

import moejax
from moejax.data import write_byte_tokenizer
from moejax.errors import ConfigError
from moejax.hf.io.staging import check_apart, staged_directory, text_inputs
from moejax.parallel.mesh import MeshConfig
from moejax.training.checkpoints import checkpoint_manager, restore, save_checkpoint
from moejax.training.config import TrainTinyConfig
from moejax.training.corpus import build_corpus
from moejax.training.progress import Progress
from moejax.training.skill_match import exact_match
from moejax.training.skills import CODE, documents
from moejax.training.trainer import Trainer

log = logging.getLogger(__name__)

RECORD = "moejax_tiny.json"      # prune_real reads "heldout" (and "stdlib_root") from it

Config = TrainTinyConfig


def settings_from(cfg: dict) -> dict:
    mesh = MeshConfig.from_dict(cfg.get("mesh"))
    return {"path": (cfg.get("model") or {}).get("path") or "", "seed": cfg.get("seed", 0),
            "arch": cfg.get("arch"), "data": cfg.get("data"), "train": cfg.get("train"),
            "mesh_data": mesh.data, "mesh_expert": mesh.expert}


def versions() -> dict:
    import flax
    import jax
    import optax
    import orbax.checkpoint

    return {"python": platform.python_version(), "jax": jax.__version__, "flax": flax.__version__,
            "optax": optax.__version__, "orbax_checkpoint": getattr(orbax.checkpoint, "__version__", "?"),
            "moejax": getattr(moejax, "__version__", "?")}


def run(cfg: TrainTinyConfig, progress=None, job_dir=None):
    from moejax.hf.model_io import save_pretrained

    timings = {}
    check_output(cfg)
    t0 = time.perf_counter()
    corpus = build_corpus(cfg)
    timings["data_s"] = time.perf_counter() - t0
    log.info("train_tiny: %d training files (%d bytes), %d held-out files (%d tokens evaluated)",
             len(corpus.train), len(corpus.train_tokens), len(corpus.heldout), corpus.heldout_ids.size)

    t0 = time.perf_counter()
    trainer = Trainer(cfg)
    if not cfg.train.resume and cfg.orbax_dir.exists():
        log.info("train_tiny: train.resume=false, removing %s", cfg.orbax_dir)
        shutil.rmtree(cfg.orbax_dir)
    manager = checkpoint_manager(cfg)
    meta = restore(cfg, manager, trainer) or {}
    start = int(meta.get("step", 0))
    history = [tuple(r) for r in meta.get("history", [])]      # (step, loss, lr, max_load_share)
    evals = [tuple(r) for r in meta.get("evals", [])]          # (step, heldout_loss)
    skill_evals = [tuple(r) for r in meta.get("skill_evals", [])]   # (step, skill, greedy exact match)
    skill_docs = _skill_docs(cfg)
    train_s_before = float(meta.get("train_s", 0.0))
    if start:
        log.info("train_tiny: resuming from step %d (%s), continuing to step %d", start, cfg.orbax_dir,
                 cfg.train.steps)
    timings["setup_s"] = time.perf_counter() - t0

    t, dc = cfg.train, cfg.data
    tokens_per_step = t.batch_size * dc.seq_len

    def meta_at(step, train_s):
        return {"step": step, "seed": cfg.seed, "fingerprint": cfg.fingerprint(), "history": history,
                "evals": evals, "skill_evals": skill_evals, "train_s": train_s}

    bar = Progress(t.steps, start)
    smooth, compile_s, eval_s = None, 0.0, 0.0
    t_train = time.perf_counter()
    t_rate, rate = time.perf_counter(), 0.0
    pending = []   # (step, device metrics): fetched lazily so the host does not wait on every step
    try:
        for step in range(start, t.steps):
            ids = corpus.batch(cfg.seed, step, t.batch_size, dc.seq_len)
            ts = time.perf_counter()
            trainer.state, metrics = trainer.step(trainer.state, ids)
            pending.append((step + 1, metrics))
            if step == start:
                metrics["loss"].block_until_ready()
                compile_s = time.perf_counter() - ts
                t_rate = time.perf_counter()
            done = step + 1
            if len(pending) >= 10 or done == t.steps or done % t.checkpoint_every == 0 \
                    or (t.eval_every and done % t.eval_every == 0):
                for s, m in pending:
                    loss, share = float(m["loss"]), float(m["max_load_share"])
                    history.append((s, loss, float(trainer.schedule(s - 1)), share))
                    smooth = loss if smooth is None else 0.95 * smooth + 0.05 * loss
                if done > start + 1:
                    rate = (done - start - 1) * tokens_per_step / (time.perf_counter() - t_rate - eval_s)
                pending.clear()
                bar.update(done, smooth, rate)
                if not math.isfinite(history[-1][1]):
                    raise FloatingPointError(f"train_tiny: loss is {history[-1][1]} at step {done}; "
                                             "lower train.lr or raise train.warmup_steps")
            if t.eval_every and done % t.eval_every == 0 and done < t.steps:
                te = time.perf_counter()
                evals.append((done, trainer.heldout(corpus.heldout_ids)[0]))
                skill_evals += _skill_curve(trainer, skill_docs, done)
                eval_s += time.perf_counter() - te
            if done % t.checkpoint_every == 0 or done == t.steps:
                log.info("train_tiny: step %d/%d  loss %.4f (smoothed)  %.0f tokens/s%s", done, t.steps, smooth, rate,
                         f"  held-out loss {evals[-1][1]:.4f}" if evals and evals[-1][0] == done else "")
                save_checkpoint(manager, trainer, done,
                                meta_at(done, train_s_before + time.perf_counter() - t_train - eval_s))
    finally:
        bar.close()
    trained = t.steps - start
    timings["train_s"] = time.perf_counter() - t_train - eval_s
    timings["compile_s"] = compile_s
    timings["tokens_per_s"] = ((trained - 1) * tokens_per_step / max(timings["train_s"] - compile_s, 1e-9)
                               if trained > 1 else float("nan"))

    te = time.perf_counter()
    heldout_loss, loads = trainer.heldout(corpus.heldout_ids)
    evals = [e for e in evals if e[0] != t.steps] + [(t.steps, heldout_loss)]
    skill_evals = [e for e in skill_evals if e[0] != t.steps] + _skill_curve(trainer, skill_docs, t.steps)
    timings["eval_s"] = eval_s + time.perf_counter() - te
    model = trainer.model
    biases = {l: np.asarray(b) for l in loads if (b := model.model.layers[l].mlp.balance_bias()) is not None}

    final_loss = float(np.mean([h[1] for h in history[-20:]])) if history else float("nan")
    record = {
        "stdlib_root": str(corpus.root), "train": corpus.train, "heldout": corpus.heldout,
        "config": {"arch": cfg.arch.as_dict(), "data": dataclasses.asdict(cfg.data),
                   "train": {**dataclasses.asdict(cfg.train), "aux_loss_alpha": cfg.balance_loss_alpha},
                   "seed": cfg.seed},
        "family": cfg.arch.family,
        "steps": t.steps, "tokens_seen": t.steps * tokens_per_step,
        "train_loss": final_loss, "heldout_loss": heldout_loss, "heldout_ppl": math.exp(heldout_loss),
        "heldout_tokens": int(corpus.heldout_ids.size), "loss_unit": "nats per byte",
        "skills_exact_match": {k: v for s, k, v in skill_evals if s == t.steps},
        "train_s": train_s_before + timings["train_s"], "resumed_from_step": start,
        "orbax_dir": str(cfg.orbax_dir), "versions": versions(), "fingerprint": cfg.fingerprint(),
    }
    ts = time.perf_counter()
    out = Path(cfg.path).expanduser()
    with staged_directory(out, overwrite=True) as staging:   # checkpoint + record appear as one folder
        save_pretrained(model, staging, overwrite=True)
        write_byte_tokenizer(staging, trainer.model_cfg.max_position_embeddings)   # for transformers / lm-eval
        (staging / RECORD).write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    timings["save_s"] = time.perf_counter() - ts
    log.info("train_tiny: saved %s (held-out loss %.4f, perplexity %.3f)", out, heldout_loss, math.exp(heldout_loss))

    rows = [{"step": 0, "metric": "start_step", "layer": -1, "value": float(start)}]
    for s, loss, lr, share in history:
        rows += [{"step": s, "metric": "train_loss", "layer": -1, "value": loss},
                 {"step": s, "metric": "lr", "layer": -1, "value": lr},
                 {"step": s, "metric": "train_max_load_share", "layer": -1, "value": share}]
    for s, loss in evals:
        rows += [{"step": s, "metric": "heldout_loss", "layer": -1, "value": loss},
                 {"step": s, "metric": "heldout_ppl", "layer": -1, "value": math.exp(loss)}]
    for s, skill, value in skill_evals:
        rows.append({"step": s, "metric": "skill_exact_match", "layer": -1, "skill": skill, "value": value})
    for l, load in loads.items():
        rows.append({"step": t.steps, "metric": "max_load_share", "layer": l, "value": float(load.max() / load.sum())})
        if l in biases:
            rows += [{"step": t.steps, "metric": "bias_min", "layer": l, "value": float(biases[l].min())},
                     {"step": t.steps, "metric": "bias_max", "layer": l, "value": float(biases[l].max())}]
    df = pd.DataFrame(rows)
    if "skill" not in df:
        df["skill"] = None
    df["path"] = str(out)
    return df, timings


def check_output(cfg: TrainTinyConfig) -> None:
    """Before any work: model.path (the output, replaced at the end) may be absent, an empty folder,
    or this training's own output (its moejax_tiny.json records the same settings' fingerprint: a
    rerun or a resume). Anything else, a Hugging Face checkpoint that prune_real or eval_skills
    read for instance, is refused unless train.overwrite=true; and it never holds, or lies inside,
    the training text (data.text)."""
    out = Path(cfg.path).expanduser()
    check_apart(out, text_inputs(cfg.data.text), "model.path (the training output)")
    if out.is_symlink():
        raise ConfigError(f"{out}: model.path is a symbolic link (to {os.readlink(out)}); training replaces the "
                          "folder there: name the folder itself or another model.path")
    if not out.exists() or (out.is_dir() and not any(out.iterdir())):
        return
    if not out.is_dir():
        raise ConfigError(f"{out}: model.path is a file; training writes a checkpoint folder there")
    try:
        made = json.loads((out / RECORD).read_text(encoding="utf-8")).get("fingerprint")
    except (OSError, ValueError, AttributeError):
        made = None
    if made == cfg.fingerprint():
        return
    why = (f"a training output of other settings ({RECORD}'s fingerprint differs)" if made is not None else
           f"not a training output of these settings (no {RECORD} with their fingerprint)")
    if not cfg.train.overwrite:
        raise ConfigError(f"{out}: model.path exists and is {why}; training would replace it. Choose another "
                          "model.path, or set train.overwrite=true to replace it")
    log.warning("train_tiny: train.overwrite=true: %s (%s) will be replaced at the end of training", out, why)


def _skill_docs(cfg: TrainTinyConfig) -> dict:
    """The held-out skills documents of the learning curve ({} without a skills mix)."""
    dc = cfg.data
    return {k: documents(k, dc.skill_eval_docs, cfg.seed, "heldout") for k, v in dc.mix.items() if k != CODE and v > 0}


def _skill_curve(trainer, skill_docs: dict, step: int) -> list:
    """[(step, skill, greedy exact match)] of the model now, on the learning curve's documents."""
    if not skill_docs:
        return []

    scores = exact_match(trainer.model, skill_docs)
    log.info("train_tiny: step %d skills exact match %s", step, {k: round(v, 3) for k, v in scores.items()})
    return [(step, k, v) for k, v in scores.items()]


def summary_title(cfg: TrainTinyConfig) -> str:
    return f"train_tiny: {cfg.train.steps} steps, saved to {cfg.path} (loss in nats per byte):"


def summary_table(df):
    last = df["step"].max()
    train = df[df.metric == "train_loss"].sort_values("step")
    out = {"train_loss (last 20 steps)": train.value.tail(20).mean(),
           "heldout_loss": df[(df.metric == "heldout_loss") & (df.step == last)].value.mean(),
           "heldout_ppl": df[(df.metric == "heldout_ppl") & (df.step == last)].value.mean(),
           "max_load_share (held-out, mean over layers)": df[df.metric == "max_load_share"].value.mean(),
           "started at step": df[df.metric == "start_step"].value.iloc[0]}
    skills = df[(df.metric == "skill_exact_match") & (df.step == last)]
    out.update({f"exact match: {r.skill}": r.value for r in skills.itertuples()})
    return pd.DataFrame({"value": out})
