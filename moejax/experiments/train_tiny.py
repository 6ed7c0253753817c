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
`checkpoints`, the progress line in `progress`; this module runs them and writes the results:
`run` reads as its steps (data, resume, the `TrainLoop` with its hooks: held-out evaluation and
skill curve every `train.eval_every` steps, checkpoints every `train.checkpoint_every` and at the
end; the final evaluation, `build_record`, the staged save, the rows).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import io
import json
import logging
import math
import os
import platform
import shutil
import time
from pathlib import Path
from typing import Callable

import numpy as np
import pandas as pd

import moejax
from moejax.data import write_byte_tokenizer
from moejax.errors import ConfigError
from moejax.hf.io.staging import check_apart, staged_directory, text_inputs
from moejax.parallel import cores
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
            "seeds": cfg.get("seeds", 1), "workers": cfg.get("workers", 0),
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
    """Train (or resume) and save; returns (tidy results DataFrame, timings dict). seeds > 1:
    every seed's model, trained by `run_seeds` below (a `seed` column tells them apart)."""
    if cfg.seeds > 1:
        return run_seeds(cfg, progress)
    return train_one(cfg)


def train_one(cfg: TrainTinyConfig, progress_stream=None):
    """One seed's training (`run` with seeds=1); progress_stream: where its progress line goes
    (default stderr, drawn only on a terminal)."""
    timings = {}
    check_output(cfg)
    corpus = _prepare_data(cfg, timings)
    trainer, manager, state = _resume(cfg, timings)
    skill_docs = _skill_docs(cfg)
    loop = TrainLoop(cfg, trainer, corpus, state, progress_stream)
    loop.add_hook(functools.partial(_evaluate, skill_docs), every=cfg.train.eval_every, pauses_clock=True)
    loop.add_hook(functools.partial(_checkpoint, manager), every=cfg.train.checkpoint_every, at_end=True)
    loop.run()
    timings.update(loop.timings())
    timings.update(_flop_rate(cfg, trainer, state.start, timings))
    heldout_loss, loads = _final_evaluation(loop, skill_docs, timings)
    record = build_record(cfg, corpus, state, heldout_loss, timings["train_s"])
    out = _save_staged(cfg, trainer, record, timings)
    return _results(state, loads, _balance_biases(trainer.model, loads), cfg.train.steps, out), timings


def _prepare_data(cfg: TrainTinyConfig, timings: dict):
    """The training and held-out text (`build_corpus`), timed as data_s."""
    t0 = time.perf_counter()
    corpus = build_corpus(cfg)
    timings["data_s"] = time.perf_counter() - t0
    log.info("train_tiny: %d training files (%d bytes), %d held-out files (%d tokens evaluated)",
             len(corpus.train), len(corpus.train_tokens), len(corpus.heldout), corpus.heldout_ids.size)
    return corpus


@dataclasses.dataclass
class RunState:
    """What a run carries from step to step and into every checkpoint's metadata (so a resumed run
    continues it): the step it started from and the curves so far."""

    start: int = 0                                          # 0, or the step of the checkpoint resumed
    history: list = dataclasses.field(default_factory=list)      # (step, loss, lr, max_load_share)
    evals: list = dataclasses.field(default_factory=list)        # (step, heldout_loss)
    skill_evals: list = dataclasses.field(default_factory=list)  # (step, skill, greedy exact match)
    train_s_before: float = 0.0                             # training seconds of the runs before a resume

    @classmethod
    def from_meta(cls, meta: dict) -> RunState:
        """The state a checkpoint's metadata records ({}: a fresh start)."""
        return cls(start=int(meta.get("step", 0)), history=[tuple(r) for r in meta.get("history", [])],
                   evals=[tuple(r) for r in meta.get("evals", [])],
                   skill_evals=[tuple(r) for r in meta.get("skill_evals", [])],
                   train_s_before=float(meta.get("train_s", 0.0)))

    def meta_at(self, cfg: TrainTinyConfig, step: int, train_s: float) -> dict:
        """The metadata of checkpoint `step` (`restore` checks its fingerprint)."""
        return {"step": step, "seed": cfg.seed, "fingerprint": cfg.fingerprint(), "history": self.history,
                "evals": self.evals, "skill_evals": self.skill_evals, "train_s": train_s}


def _resume(cfg: TrainTinyConfig, timings: dict):
    """(the Trainer, its orbax manager, the RunState): the latest checkpoint's when there is one
    (train.resume=false first deletes them), else a fresh start; timed as setup_s."""
    t0 = time.perf_counter()
    trainer = Trainer(cfg)
    if not cfg.train.resume and cfg.orbax_dir.exists():
        log.info("train_tiny: train.resume=false, removing %s", cfg.orbax_dir)
        shutil.rmtree(cfg.orbax_dir)
    manager = checkpoint_manager(cfg)
    state = RunState.from_meta(restore(cfg, manager, trainer) or {})
    if state.start:
        log.info("train_tiny: resuming from step %d (%s), continuing to step %d", state.start, cfg.orbax_dir,
                 cfg.train.steps)
    timings["setup_s"] = time.perf_counter() - t0
    return trainer, manager, state


@dataclasses.dataclass(frozen=True)
class Hook:
    """fn(loop, done), called after step `done` when `every` divides it (0: never) and, with at_end,
    after the last step. pauses_clock: its time is not training time (an evaluation)."""

    fn: Callable
    every: int
    at_end: bool = False
    pauses_clock: bool = False

    def due(self, done: int, last: int) -> bool:
        if done == last:
            return self.at_end
        return bool(self.every) and done % self.every == 0


class TrainLoop:
    """The training loop (levanter's `Trainer.train` with `add_hook`): steps state.start ..
    train.steps, each batch a pure function of (seed, step); the device metrics fetched lazily
    (every 10 steps, at the end, and before any hook is called) so the host does not wait on every
    step; then the hooks due at that step, in the order added."""

    def __init__(self, cfg: TrainTinyConfig, trainer: Trainer, corpus, state: RunState, progress_stream=None):
        self.cfg, self.trainer, self.corpus, self.state = cfg, trainer, corpus, state
        self.progress_stream = progress_stream
        self.hooks: list[Hook] = []
        self.tokens_per_step = cfg.train.batch_size * cfg.data.seq_len
        self.smooth, self.rate, self.compile_s, self.eval_s = None, 0.0, 0.0, 0.0
        self.pending = []   # (step, device metrics) not yet fetched
        self.t_train = self.t_rate = 0.0

    def add_hook(self, fn: Callable, every: int, at_end: bool = False, pauses_clock: bool = False) -> None:
        self.hooks.append(Hook(fn, every, at_end, pauses_clock))

    def run(self) -> None:
        last = self.cfg.train.steps
        bar = Progress(last, self.state.start, self.progress_stream)
        self.t_train = time.perf_counter()
        self.t_rate = time.perf_counter()
        try:
            for step in range(self.state.start, last):
                self._step(step)
                done = step + 1
                due = [hook for hook in self.hooks if hook.due(done, last)]
                if len(self.pending) >= 10 or done == last or due:
                    self._fetch_metrics(done, bar)
                for hook in due:
                    th = time.perf_counter()
                    hook.fn(self, done)
                    if hook.pauses_clock:
                        self.eval_s += time.perf_counter() - th
        finally:
            bar.close()

    def _step(self, step: int) -> None:
        t = self.cfg.train
        ids = self.corpus.batch(self.cfg.seed, step, t.batch_size, self.cfg.data.seq_len)
        ts = time.perf_counter()
        self.trainer.state, metrics = self.trainer.step(self.trainer.state, ids)
        self.pending.append((step + 1, metrics))
        if step == self.state.start:   # the first step compiles: timed apart, and tokens/s counts after it
            metrics["loss"].block_until_ready()
            self.compile_s = time.perf_counter() - ts
            self.t_rate = time.perf_counter()

    def _fetch_metrics(self, done: int, bar: Progress) -> None:
        """The pending steps' metrics into the history; the smoothed loss and tokens/s onto the
        progress line. A loss that is not finite stops training."""
        history, start = self.state.history, self.state.start
        for s, m in self.pending:
            loss, share = float(m["loss"]), float(m["max_load_share"])
            history.append((s, loss, float(self.trainer.schedule(s - 1)), share))
            self.smooth = loss if self.smooth is None else 0.95 * self.smooth + 0.05 * loss
        if done > start + 1:
            self.rate = (done - start - 1) * self.tokens_per_step / (time.perf_counter() - self.t_rate - self.eval_s)
        self.pending.clear()
        bar.update(done, self.smooth, self.rate)
        if not math.isfinite(history[-1][1]):
            raise FloatingPointError(f"train_tiny: loss is {history[-1][1]} at step {done}; "
                                     "lower train.lr or raise train.warmup_steps")

    def timings(self) -> dict:
        """train_s (the clock since the loop began, less the hooks that pause it), compile_s, tokens_per_s."""
        trained = self.cfg.train.steps - self.state.start
        train_s = time.perf_counter() - self.t_train - self.eval_s
        return {"train_s": train_s, "compile_s": self.compile_s,
                "tokens_per_s": ((trained - 1) * self.tokens_per_step / max(train_s - self.compile_s, 1e-9)
                                 if trained > 1 else float("nan"))}


# --- several seeds in one job (seeds > 1) ---------------------------------------------------
# Seeds seed .. seed + N - 1, seed k saved at <model.path>/seed-<k>, each exactly `train_one` of
# that seed, trained by `workers` processes at once (default one per core), each pinned to its own
# core before JAX starts (`moejax.parallel.cores`). Measured on 2 CPU cores for the skills models
# (docs/benchmarks.md): vectorising the seeds in one program (`jax.vmap`, as toy3) 1.05x four
# sequential steps, one process per core 1.6x. The results are every seed's rows with a `seed`
# column; the timings every seed's, the wall time, the FLOPs of all seeds, the achieved rate and
# the dense matmul rate measured at the end.

def check_parent(cfg: TrainTinyConfig) -> None:
    """model.path holds the seed-<k> folders: it may be absent or a folder, never a file, a link
    or a checkpoint (a config.json there: a model someone reads)."""
    out = Path(cfg.path).expanduser()
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise ConfigError(f"{out}: model.path must be a folder (seeds={cfg.seeds} writes seed-<k> folders in it)")
    if (out / "config.json").exists():
        raise ConfigError(f"{out}: model.path holds a checkpoint (config.json); seeds={cfg.seeds} writes seed-<k> "
                          "folders beside it: choose another model.path")


def run_seeds(cfg: TrainTinyConfig, progress=None):
    """Every seed's training (module docstring); returns (tidy results with a seed column, timings)."""
    check_parent(cfg)
    runs = cfg.seed_configs()
    for one in runs:   # every seed's output checked before any training
        check_output(one)
    n_workers = cfg.workers or min(len(runs), len(cores.available_cores()))
    t0 = time.perf_counter()
    results = {}
    if n_workers == 1:
        for one in runs:
            results[one.seed] = train_one(one)
            if progress:
                progress(1)
    else:
        results = _in_workers(runs, n_workers, progress)
    wall = time.perf_counter() - t0
    frames = []
    for seed, (df, _) in sorted(results.items()):
        frames.append(df.assign(seed=seed))
    return pd.concat(frames, ignore_index=True), _timings(results, wall, n_workers)


def _in_workers(runs: list, n_workers: int, progress) -> dict:
    """{seed: train_one's result} from `n_workers` processes, each pinned to its own core."""
    results = {}
    with cores.pool(n_workers) as executor:
        futures = {executor.submit(_train_seed, one): one.seed for one in runs}
        try:
            for done in concurrent.futures.as_completed(futures):
                seed = futures[done]
                try:
                    results[seed] = done.result()
                except Exception as exc:
                    raise RuntimeError(f"train_tiny: seed {seed} failed: {type(exc).__name__}: {exc}") from exc
                log.info("train_tiny: seed %d done (%d of %d)", seed, len(results), len(runs))
                if progress:
                    progress(1)
        except BaseException:
            cores.stop(executor, futures)
            raise
    return results


def _train_seed(cfg: TrainTinyConfig):
    # (the compilation cache's settings come with the parent's environment: runner.enable_compilation_cache)
    return train_one(cfg, progress_stream=io.StringIO())   # no progress line: workers share a terminal


def _timings(results: dict, wall: float, n_workers: int) -> dict:
    """Every seed's timings (seed_<k>.*), the wall time, the FLOPs of all seeds, the achieved rate
    over the wall time, and the dense matmul rate of this machine now (all its cores)."""
    from moejax.training.flops import dense_matmul_gflops

    out = {"workers": n_workers, "seeds_wall_s": wall}
    for seed, (_, t) in sorted(results.items()):
        out.update({f"seed_{seed}.{k}": v for k, v in t.items()})
    flops = sum(t["train_flops"] for _, t in results.values())
    dense = dense_matmul_gflops()
    out.update({"train_flops": flops, "wall_gflops": flops / wall / 1e9, "dense_gflops": dense,
                "share_of_dense": flops / wall / 1e9 / dense})
    return out


def _flop_rate(cfg: TrainTinyConfig, trainer: Trainer, start: int, t: dict) -> dict:
    """train_flops (the steps this run took, `moejax.training.flops.step_flops`) and train_gflops
    (per second of training, compilation and hooks excluded), from the loop's timings `t`."""
    from moejax.training.flops import step_flops, weight_counts

    per_step = step_flops(trainer.model_cfg, weight_counts(trainer.model), cfg.train.batch_size, cfg.data.seq_len)
    steps = cfg.train.steps - start
    return {"train_flops": steps * per_step,
            "train_gflops": (steps - 1) * per_step / max(t["train_s"] - t["compile_s"], 1e-9) / 1e9}


def _evaluate(skill_docs: dict, loop: TrainLoop, done: int) -> None:
    """Hook: the held-out loss and the skill curve at step `done`."""
    loop.state.evals.append((done, loop.trainer.heldout(loop.corpus.heldout_ids)[0]))
    loop.state.skill_evals += _skill_curve(loop.trainer, skill_docs, done)


def _checkpoint(manager, loop: TrainLoop, done: int) -> None:
    """Hook: log the progress and save checkpoint `done`, the run's state its metadata."""
    cfg, state = loop.cfg, loop.state
    evaluated = state.evals and state.evals[-1][0] == done
    log.info("train_tiny: step %d/%d  loss %.4f (smoothed)  %.0f tokens/s%s", done, cfg.train.steps, loop.smooth,
             loop.rate, f"  held-out loss {state.evals[-1][1]:.4f}" if evaluated else "")
    save_checkpoint(manager, loop.trainer, done,
                    state.meta_at(cfg, done, state.train_s_before + time.perf_counter() - loop.t_train - loop.eval_s))


def _final_evaluation(loop: TrainLoop, skill_docs: dict, timings: dict) -> tuple:
    """(held-out loss, {MoE layer: expert loads}) of the trained model; the last step's held-out loss
    and skill scores replace any the loop recorded there. Timed, with the loop's, as eval_s."""
    state, steps = loop.state, loop.cfg.train.steps
    te = time.perf_counter()
    heldout_loss, loads = loop.trainer.heldout(loop.corpus.heldout_ids)
    state.evals = [e for e in state.evals if e[0] != steps] + [(steps, heldout_loss)]
    state.skill_evals = [e for e in state.skill_evals if e[0] != steps] + _skill_curve(loop.trainer, skill_docs, steps)
    timings["eval_s"] = loop.eval_s + time.perf_counter() - te
    return heldout_loss, loads


def _balance_biases(model, loads: dict) -> dict:
    """{MoE layer: its balance bias} for the layers that have one."""
    return {l: np.asarray(b) for l in loads if (b := model.model.layers[l].mlp.balance_bias()) is not None}


def build_record(cfg: TrainTinyConfig, corpus, state: RunState, heldout_loss: float, train_s: float) -> dict:
    """moejax_tiny.json: the data (stdlib root, training and held-out files), the settings, the
    losses and skill scores at the end, the time and the versions."""
    t = cfg.train
    final_loss = float(np.mean([h[1] for h in state.history[-20:]])) if state.history else float("nan")
    return {
        "stdlib_root": str(corpus.root), "train": corpus.train, "heldout": corpus.heldout,
        "config": {"arch": cfg.arch.as_dict(), "data": dataclasses.asdict(cfg.data),
                   "train": {**dataclasses.asdict(cfg.train), "aux_loss_alpha": cfg.balance_loss_alpha},
                   "seed": cfg.seed},
        "family": cfg.arch.family,
        "steps": t.steps, "tokens_seen": t.steps * (t.batch_size * cfg.data.seq_len),
        "train_loss": final_loss, "heldout_loss": heldout_loss, "heldout_ppl": math.exp(heldout_loss),
        "heldout_tokens": int(corpus.heldout_ids.size), "loss_unit": "nats per byte",
        "skills_exact_match": {k: v for s, k, v in state.skill_evals if s == t.steps},
        "train_s": state.train_s_before + train_s, "resumed_from_step": state.start,
        "orbax_dir": str(cfg.orbax_dir), "versions": versions(), "fingerprint": cfg.fingerprint(),
    }


def _save_staged(cfg: TrainTinyConfig, trainer: Trainer, record: dict, timings: dict) -> Path:
    """The checkpoint, the byte-level tokenizer and the record, renamed into model.path as one
    folder; timed as save_s."""
    from moejax.hf.model_io import save_pretrained

    ts = time.perf_counter()
    out = Path(cfg.path).expanduser()
    with staged_directory(out, overwrite=True) as staging:   # checkpoint + record appear as one folder
        save_pretrained(trainer.model, staging, overwrite=True)
        write_byte_tokenizer(staging, trainer.model_cfg.max_position_embeddings)   # for transformers / lm-eval
        (staging / RECORD).write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    timings["save_s"] = time.perf_counter() - ts
    log.info("train_tiny: saved %s (held-out loss %.4f, perplexity %.3f)", out, record["heldout_loss"],
             math.exp(record["heldout_loss"]))
    return out


def _results(state: RunState, loads: dict, biases: dict, steps: int, out: Path) -> pd.DataFrame:
    """The tidy rows (module docstring: Results)."""
    rows = [{"step": 0, "metric": "start_step", "layer": -1, "value": float(state.start)}]
    for s, loss, lr, share in state.history:
        rows += [{"step": s, "metric": "train_loss", "layer": -1, "value": loss},
                 {"step": s, "metric": "lr", "layer": -1, "value": lr},
                 {"step": s, "metric": "train_max_load_share", "layer": -1, "value": share}]
    for s, loss in state.evals:
        rows += [{"step": s, "metric": "heldout_loss", "layer": -1, "value": loss},
                 {"step": s, "metric": "heldout_ppl", "layer": -1, "value": math.exp(loss)}]
    for s, skill, value in state.skill_evals:
        rows.append({"step": s, "metric": "skill_exact_match", "layer": -1, "skill": skill, "value": value})
    for l, load in loads.items():
        rows.append({"step": steps, "metric": "max_load_share", "layer": l, "value": float(load.max() / load.sum())})
        if l in biases:
            rows += [{"step": steps, "metric": "bias_min", "layer": l, "value": float(biases[l].min())},
                     {"step": steps, "metric": "bias_max", "layer": l, "value": float(biases[l].max())}]
    df = pd.DataFrame(rows)
    if "skill" not in df:
        df["skill"] = None
    df["path"] = str(out)
    return df


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
    seeds = f", seeds {cfg.seed}..{cfg.seed + cfg.seeds - 1} in seed-<k> folders" if cfg.seeds > 1 else ""
    return f"train_tiny: {cfg.train.steps} steps, saved to {cfg.path}{seeds} (loss in nats per byte):"


def summary_table(df):
    """The last values of one run (a column "value"), or of each seed (a column per seed)."""
    if "seed" in df:
        return pd.concat({f"seed {k}": _summary(part)["value"] for k, part in df.groupby("seed")}, axis=1)
    return _summary(df)


def _summary(df):
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
