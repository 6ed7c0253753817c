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
- Output: `model.save_pretrained` into a staged folder plus `moejax_tiny.json` (stdlib root,
  training and held-out files, config, steps, losses, seconds, versions) and a byte-level Hugging
  Face tokenizer (`moejax.data.write_byte_tokenizer`: id == UTF-8 byte, byte 0 is eos/pad, no
  BOS), renamed into place as one folder (`moejax.hf.staging.staged_directory`).

Results: a tidy table with columns step, metric, layer, value; metrics train_loss (every step),
lr, train_max_load_share (largest expert share of the step's routing decisions, mean over MoE
layers; 1/E is perfect balance), heldout_loss / heldout_ppl (nats per byte; at eval steps and at
the end), max_load_share and bias_min / bias_max per MoE layer (held-out tokens, at the end),
start_step (0, or the step a resumed run started from).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import shutil
import sys
import time
from pathlib import Path

import numpy as np

from moejax.errors import ConfigError
from moejax.experiments import refuse_unknown_settings

log = logging.getLogger(__name__)

RECORD = "moejax_tiny.json"      # prune_real reads "heldout" (and "stdlib_root") from it
ORBAX_SUFFIX = ".orbax"


_NULLABLE = {"decay_steps": int, "aux_loss_alpha": float}  # settings whose default is null


def _typed(cls, d, where: str):
    """Build dataclass `cls` from a mapping: unknown keys and wrong types are ConfigErrors."""
    if d is None:
        d = {}
    if not isinstance(d, dict):
        raise ConfigError(f"train_tiny: {where} must be a mapping, got {d!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - set(fields))
    if unknown:
        raise ConfigError(f"train_tiny: unknown setting(s) {[f'{where}.{k}' for k in unknown]}; "
                          f"valid {where}.*: {sorted(fields)}")
    out = {}
    for k, v in d.items():
        want = _NULLABLE.get(k) or type(getattr(cls(), k))
        if want is tuple:
            v = tuple(v) if isinstance(v, (list, tuple)) else (v,)
        elif want is float and isinstance(v, int) and not isinstance(v, bool):
            v = float(v)
        elif v is not None and (not isinstance(v, want) or (want is int and isinstance(v, bool))):
            raise ConfigError(f"train_tiny: {where}.{k}={v!r}; expected {want.__name__}")
        out[k] = v
    return cls(**out)


# byte-level: byte 0 (NUL, never in the text) is eos and pad, there is no BOS; these match the
# tokenizer files written next to the checkpoint (moejax.data.write_byte_tokenizer)
BYTE_LEVEL = {"vocab_size": 256, "eos_token_id": 0, "pad_token_id": 0, "bos_token_id": None, "dtype": "float32"}


@dataclasses.dataclass(frozen=True)
class ArchConfig:
    """The architecture: a registered family and config.json keys over its `tiny` preset
    (moejax.models.<family>/presets.py: TINY). The model config is the family's own, so every
    key is checked by the family's config class and nothing is declared twice."""

    family: str = "deepseek_v3"
    overrides: tuple = ()   # (key, value) pairs, sorted: config.json keys as the family spells them

    @classmethod
    def from_mapping(cls, d) -> "ArchConfig":
        if d is None:
            d = {}
        if not isinstance(d, dict):
            raise ConfigError(f"train_tiny: arch must be a mapping, got {d!r}")
        d = dict(d)
        family = d.pop("family", "deepseek_v3")
        return cls(family, tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in d.items())))

    def hf_dict(self) -> dict:
        """A complete config.json for the family's transformers and moejax models."""
        from moejax.models.registry import FAMILIES

        if self.family not in FAMILIES:
            raise ConfigError(f"train_tiny: arch.family={self.family!r}; registered families: {sorted(FAMILIES)}")
        family = FAMILIES[self.family]
        if family.tiny is None:
            raise ConfigError(f"train_tiny: the {family.title} family has no tiny preset (TINY in "
                              f"moejax/models/{family.name}/presets.py)")
        overrides = {k: list(v) if isinstance(v, tuple) else v for k, v in self.overrides}
        return {**family.tiny, **BYTE_LEVEL, "initializer_range": 0.02, **overrides}

    def as_dict(self) -> dict:
        return {"family": self.family, **{k: list(v) if isinstance(v, tuple) else v for k, v in self.overrides}}


@dataclasses.dataclass(frozen=True)
class DataConfig:
    stdlib: bool = True
    exclude_dirs: tuple = ("site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__")
    text: tuple = ()
    heldout_fraction: float = 0.05
    heldout_always: tuple = ("difflib.py", "textwrap.py", "fractions.py")
    seq_len: int = 128
    eval_tokens: int = 65536


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 1600
    batch_size: int = 16
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    decay_steps: int | None = None   # end of the cosine; None = steps (a resumed run with more steps
    #                                  then follows the longer schedule from where it is)
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    clip_norm: float = 1.0
    bias_update_rate: float = 1e-3
    aux_loss_alpha: float | None = None  # null: 0 with a balance bias, 0.01 without (balance_loss_alpha)
    checkpoint_every: int = 200
    keep_checkpoints: int = 2
    eval_every: int = 400
    eval_batch_size: int = 32
    rng_impl: str = "threefry2x32"   # PRNG of the initialisation; "rbg" initialises faster (tests)
    resume: bool = True


@dataclasses.dataclass(frozen=True)
class TrainTinyConfig:
    path: str = ""                  # where the HF checkpoint is written (model.path)
    seed: int = 0
    arch: ArchConfig = ArchConfig()
    data: DataConfig = DataConfig()
    train: TrainConfig = TrainConfig()
    mesh_data: int = 1
    mesh_expert: int = 1

    @classmethod
    def from_mapping(cls, d: dict) -> "TrainTinyConfig":
        d = dict(d)
        refuse_unknown_settings(cls, d, "train_tiny")
        d["arch"] = ArchConfig.from_mapping(d.get("arch"))
        for key, sub in (("data", DataConfig), ("train", TrainConfig)):
            d[key] = _typed(sub, d.get(key), key)
        cfg = cls(**d)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        dc, t = self.data, self.train
        if not self.path:
            raise ConfigError("train_tiny: no output folder; set model=tiny or model.path=FOLDER")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ConfigError(f"train_tiny: seed={self.seed!r}; expected a non-negative integer")
        if self.mesh_data * self.mesh_expert != 1:
            raise ConfigError(f"train_tiny: runs on one device; got mesh.data={self.mesh_data}, "
                              f"mesh.expert={self.mesh_expert} (use mesh=single)")
        a = self.model_config()  # the family's config class checks every arch key
        if a.vocab_size < 256:
            raise ConfigError(f"train_tiny: arch.vocab_size={a.vocab_size}; byte-level tokens need at least 256")
        if not a.moe_layers:
            raise ConfigError(f"train_tiny: arch gives no MoE layer ({a.num_hidden_layers} layers, all dense)")
        if dc.seq_len < 2:
            raise ConfigError(f"train_tiny: data.seq_len={dc.seq_len} must be >= 2 (next-token prediction)")
        if dc.seq_len > a.max_position_embeddings:
            raise ConfigError(f"train_tiny: data.seq_len={dc.seq_len} exceeds arch.max_position_embeddings="
                              f"{a.max_position_embeddings}")
        if not 0.0 < dc.heldout_fraction < 1.0:
            raise ConfigError(f"train_tiny: data.heldout_fraction={dc.heldout_fraction} must lie in (0, 1)")
        if not dc.stdlib and not dc.text:
            raise ConfigError("train_tiny: no training text: data.stdlib=false and data.text=[] (name files)")
        if dc.eval_tokens < dc.seq_len:
            raise ConfigError(f"train_tiny: data.eval_tokens={dc.eval_tokens} is below one sequence "
                              f"(data.seq_len={dc.seq_len})")
        for name in ("steps", "batch_size", "checkpoint_every", "keep_checkpoints", "eval_batch_size"):
            if getattr(t, name) < 1:
                raise ConfigError(f"train_tiny: train.{name}={getattr(t, name)} must be >= 1")
        if t.rng_impl not in ("threefry2x32", "rbg", "unsafe_rbg"):
            raise ConfigError(f"train_tiny: train.rng_impl={t.rng_impl!r}; expected threefry2x32, rbg or unsafe_rbg")
        if t.decay_steps is not None and t.decay_steps < 1:
            raise ConfigError(f"train_tiny: train.decay_steps={t.decay_steps} must be >= 1 (or null = train.steps)")
        if t.warmup_steps < 0 or t.eval_every < 0:
            raise ConfigError("train_tiny: train.warmup_steps and train.eval_every must be >= 0")
        if not (t.lr > 0 and 0 <= t.min_lr_ratio <= 1 and t.clip_norm > 0 and t.weight_decay >= 0
                and 0 <= t.b1 < 1 and 0 <= t.b2 < 1 and t.bias_update_rate >= 0
                and (t.aux_loss_alpha is None or t.aux_loss_alpha >= 0)):
            raise ConfigError(f"train_tiny: need lr > 0, 0 <= min_lr_ratio <= 1, clip_norm > 0, weight_decay >= 0, "
                              f"b1, b2 in [0, 1), bias_update_rate >= 0, aux_loss_alpha >= 0; got {t}")

    def model_config(self):
        """The family's typed config of the architecture (every key checked by the family's class)."""
        from moejax.models.registry import FAMILIES

        d = self.arch.hf_dict()  # refuses an unknown family by name
        return FAMILIES[self.arch.family].config_class.from_dict(d, source="train_tiny: arch")

    @property
    def balance_loss_alpha(self) -> float:
        """train.aux_loss_alpha, or when null the family's usual balancing: 0 for routers with a
        balance bias (auxiliary-loss-free balancing moves the bias), 0.01 for routers without one
        (the load-balancing loss softmax-routed models train with; OLMoE's coefficient)."""
        if self.train.aux_loss_alpha is not None:
            return self.train.aux_loss_alpha
        return 0.0 if self.model_config().HAS_BALANCE_BIAS else 0.01

    @property
    def orbax_dir(self) -> Path:
        out = Path(self.path).expanduser()
        return out.parent / (out.name + ORBAX_SUFFIX)

    def fingerprint(self) -> dict:
        """The settings a checkpoint must share with the run resuming it (not the step count or
        schedule end, checkpoint cadence, evaluation, initialisation PRNG or resume)."""
        t = dataclasses.asdict(self.train)
        for k in ("steps", "decay_steps", "checkpoint_every", "keep_checkpoints", "eval_every", "eval_batch_size",
                  "rng_impl", "resume"):
            t.pop(k)
        dc = dataclasses.asdict(self.data)
        dc.pop("eval_tokens")
        return json.loads(json.dumps({"seed": self.seed, "arch": self.arch.as_dict(), "data": dc,
                                      "train": t}))


Config = TrainTinyConfig


def settings_from(cfg: dict) -> dict:
    from moejax.parallel.mesh import MeshConfig

    mesh = MeshConfig.from_dict(cfg.get("mesh"))
    return {"path": (cfg.get("model") or {}).get("path") or "", "seed": cfg.get("seed", 0),
            "arch": cfg.get("arch"), "data": cfg.get("data"), "train": cfg.get("train"),
            "mesh_data": mesh.data, "mesh_expert": mesh.expert}


# --- data ----------------------------------------------------------------------------------------

@dataclasses.dataclass
class Corpus:
    root: Path                      # the standard library folder (names below are relative to it)
    train: list                     # training file names (stdlib-relative, or absolute for data.text)
    heldout: list
    train_tokens: np.ndarray        # uint8 byte stream of the training files
    heldout_ids: np.ndarray         # int32 [n_seq, seq_len], the held-out files packed in order


def _resolve(root: Path, name: str) -> Path:
    p = Path(name)
    return p if p.is_absolute() else root / p


def build_corpus(cfg: TrainTinyConfig) -> Corpus:
    from moejax.data import byte_stream, python_stdlib_root, split_heldout, stdlib_sources, text_files

    dc = cfg.data
    root = python_stdlib_root()
    names = stdlib_sources(root, dc.exclude_dirs) if dc.stdlib else []
    if dc.text:
        names += [str(f.resolve()) for f in text_files(list(dc.text))]
    names = list(dict.fromkeys(names))  # a file named twice counts once
    train, heldout = split_heldout(names, dc.heldout_fraction, dc.heldout_always)
    if not train or not heldout:
        raise ConfigError(f"train_tiny: {len(names)} file(s) give {len(train)} training and {len(heldout)} "
                          "held-out file(s); need both (add files with data.text=[...] or change "
                          "data.heldout_fraction)")
    stream = byte_stream([_resolve(root, n) for n in train])
    if len(stream) < cfg.data.seq_len + 1:
        raise ConfigError(f"train_tiny: the training files hold {len(stream)} bytes, fewer than one "
                          f"sequence (data.seq_len={dc.seq_len})")
    held = byte_stream([_resolve(root, n) for n in heldout])[: dc.eval_tokens]
    n_seq = len(held) // dc.seq_len
    if n_seq == 0:
        raise ConfigError(f"train_tiny: the held-out files hold {len(held)} bytes, fewer than one sequence "
                          f"(data.seq_len={dc.seq_len})")
    ids = held[: n_seq * dc.seq_len].reshape(n_seq, dc.seq_len).astype(np.int32)
    return Corpus(root, train, heldout, stream, ids)


def train_batch(stream: np.ndarray, seed: int, step: int, batch: int, seq_len: int) -> np.ndarray:
    """Batch `step` (0-based): random windows of the training stream, a pure function of (seed, step)."""
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(stream) - seq_len + 1, size=batch)
    return stream[starts[:, None] + np.arange(seq_len)].astype(np.int32)


# --- model, loss, step ----------------------------------------------------------------------------

def next_token_loss(logits_BSV, ids_BS):
    """Mean next-token cross-entropy in float32 over positions 0..S-2 (predicting 1..S-1)."""
    from moejax.nll import next_token_nll

    return next_token_nll(logits_BSV, ids_BS).mean()


def sequence_balance_loss(routing, n_experts: int, top_k: int, batch: int):
    """DeepSeek-V3's sequence-wise balance loss sum_e f_e P_e, averaged over sequences:
    f_e = E / (K S) * #{t: e chosen}, P_e = mean_t s_te / sum_e' s_te' (unbiased affinities)."""
    import jax
    import jax.numpy as jnp

    idx = routing.expert_idx_TK.reshape(batch, -1, top_k)
    s = routing.scores_TE.reshape(batch, -1, n_experts)
    counts = jax.nn.one_hot(idx, n_experts, dtype=jnp.float32).sum(axis=(1, 2))          # [B, E]
    f = counts * n_experts / (top_k * idx.shape[1])
    p = (s / (s.sum(-1, keepdims=True) + 1e-20)).mean(axis=1)
    return (f * p).sum(-1).mean()


def make_optimizer(cfg: TrainTinyConfig):
    """(optax transformation, learning-rate schedule): linear warmup to `lr`, cosine decay to
    `lr * min_lr_ratio` at `decay_steps` (default: `steps`), AdamW (decay on matrices only), clipping.
    One object per distinct setting, so equal settings give equal graph definitions and the
    compiled step is reused (`_compiled`)."""
    t = cfg.train
    decay = t.decay_steps if t.decay_steps is not None else t.steps
    return _optimizer(t.lr, t.min_lr_ratio, t.warmup_steps, max(decay, t.warmup_steps + 1), t.weight_decay,
                      t.b1, t.b2, t.clip_norm)


@functools.lru_cache(maxsize=16)
def _optimizer(lr, min_lr_ratio, warmup_steps, decay_steps, weight_decay, b1, b2, clip_norm):
    import jax
    import optax

    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, warmup_steps, decay_steps, lr * min_lr_ratio)
    matrices = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)  # noqa: E731  no decay on norms
    tx = optax.chain(optax.clip_by_global_norm(clip_norm),
                     optax.adamw(schedule, b1=b1, b2=b2, weight_decay=weight_decay, mask=matrices))
    return tx, schedule


@functools.lru_cache(maxsize=8)
def _compiled(graphdef, E: int, K: int, rate: float, alpha: float, B: int, has_bias: bool):
    """The jitted training step and held-out evaluation for one graph definition (cached: a second
    run with the same settings in the same process compiles nothing)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from moejax.moe.balancing import bias_step
    from moejax.moe.routing import routing_counts
    from moejax.nll import next_token_nll

    def step(state, ids_BS):
        model, optimizer = nnx.merge(graphdef, state)

        def loss_fn(model):
            logits, routing, _ = model(ids_BS, return_routing=True)
            ce = next_token_loss(logits, ids_BS)
            loss = ce
            if alpha > 0:
                loss = loss + alpha * sum(sequence_balance_loss(r, E, K, B) for r in routing.values())
            loads = {l: routing_counts(r.expert_idx_TK, E) for l, r in routing.items()}
            return loss, (ce, loads)

        (_, (ce, loads)), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
        optimizer.update(model, grads)
        shares = []
        for l, load in loads.items():
            load = load.astype(jnp.float32)
            if has_bias:  # auxiliary-loss-free balancing (DeepSeek-V3 section 2.1.2)
                bias = model.model.layers[l].mlp.bias
                bias[...] = bias_step(bias[...], load, rate)
            shares.append(load.max() / load.sum())
        return nnx.state((model, optimizer)), {"loss": ce, "max_load_share": jnp.mean(jnp.stack(shares))}

    def evaluate(state, ids_BS):
        model, _ = nnx.merge(graphdef, state)
        logits, routing, _ = model(ids_BS, return_routing=True)
        nll = next_token_nll(logits, ids_BS).sum()
        return nll, {l: routing_counts(r.expert_idx_TK, E) for l, r in routing.items()}

    return jax.jit(step, donate_argnums=0), jax.jit(evaluate)


class Trainer:
    """The model, its optimizer and the jitted step, as one split (graphdef, state) pair."""

    def __init__(self, cfg: TrainTinyConfig):
        import jax
        import jax.numpy as jnp
        from flax import nnx

        from moejax.models.auto import AutoModelForCausalLM

        self.cfg = cfg
        self.model_cfg = cfg.model_config()
        key = jax.random.key(cfg.seed, impl=cfg.train.rng_impl)
        model = AutoModelForCausalLM.from_config(self.model_cfg, jnp.float32, rngs=nnx.Rngs(key))
        tx, self.schedule = make_optimizer(cfg)
        optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)   # BalanceBias is not a Param: untouched
        self.graphdef, state = nnx.split((model, optimizer))
        # committed to one device, as restored and stepped states are: one compiled step serves all
        self.state = jax.device_put(state, jax.devices()[0])
        self.step, self._evaluate = _compiled(self.graphdef, self.model_cfg.n_experts,
                                              self.model_cfg.num_experts_per_tok, cfg.train.bias_update_rate,
                                              cfg.balance_loss_alpha, cfg.train.batch_size,
                                              self.model_cfg.HAS_BALANCE_BIAS)

    @property
    def model(self):
        from flax import nnx

        return nnx.merge(self.graphdef, self.state)[0]

    def heldout(self, ids_BS: np.ndarray) -> tuple[float, dict]:
        """(mean next-token loss over every held-out prediction, {layer: expert loads})."""
        bs = self.cfg.train.eval_batch_size
        total, loads = 0.0, {}
        for i in range(0, len(ids_BS), bs):
            chunk = ids_BS[i:i + bs]
            nll, counts = self._evaluate(self.state, chunk)
            total += float(nll)
            for l, c in counts.items():
                loads[l] = loads.get(l, 0) + np.asarray(c, np.int64)
        return total / (ids_BS.shape[0] * (ids_BS.shape[1] - 1)), loads

    # --- orbax -----------------------------------------------------------------------------------
    def pure_state(self):
        from flax import nnx

        return nnx.to_pure_dict(self.state)

    def load_pure_state(self, pure) -> None:
        from flax import nnx

        nnx.replace_by_pure_dict(self.state, pure)


def _checkpoint_manager(cfg: TrainTinyConfig):
    import orbax.checkpoint as ocp

    options = ocp.CheckpointManagerOptions(max_to_keep=cfg.train.keep_checkpoints, create=True,
                                           enable_async_checkpointing=False)
    return ocp.CheckpointManager(cfg.orbax_dir.resolve(), options=options, item_names=("state", "meta"))


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def _restore(cfg: TrainTinyConfig, manager, trainer: Trainer) -> dict | None:
    """Load the latest checkpoint into `trainer`; its metadata, or None when there is none."""
    import jax
    import orbax.checkpoint as ocp

    step = manager.latest_step()
    if step is None:
        return None
    meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    if meta.get("fingerprint") != cfg.fingerprint():
        old, new = _flat(meta.get("fingerprint") or {}), _flat(cfg.fingerprint())
        diff = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
        raise ConfigError(f"train_tiny: the checkpoint at step {step} in {cfg.orbax_dir} was made with different "
                          f"settings ({', '.join(diff) or 'unknown'}); rerun with the same settings, or with "
                          "train.resume=false to start over (deletes that folder)")
    if step > cfg.train.steps:
        raise ConfigError(f"train_tiny: {cfg.orbax_dir} already holds step {step}, past train.steps="
                          f"{cfg.train.steps}; ask for at least {step} steps, or train.resume=false to start over")
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, trainer.pure_state())
    state = manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))["state"]
    trainer.load_pure_state(state)
    return meta


def _save_checkpoint(manager, trainer: Trainer, step: int, meta: dict) -> None:
    import orbax.checkpoint as ocp

    if manager.latest_step() == step:
        return
    manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(trainer.pure_state()),
                                               meta=ocp.args.JsonSave(meta)))
    manager.wait_until_finished()


# --- progress --------------------------------------------------------------------------------------

class Progress:
    """`train_tiny: 120/2000 steps [..] loss=1.234, tok/s=12,345` (tqdm) on stderr when it is a terminal."""

    def __init__(self, total: int, start: int, stream=None):
        from tqdm import tqdm

        stream = stream if stream is not None else sys.stderr
        self.bar = tqdm(total=total, initial=start, desc="train_tiny", unit="step", file=stream,
                        disable=not stream.isatty(), mininterval=0.5)

    def update(self, step: int, loss: float, tokens_per_s: float) -> None:
        self.bar.set_postfix_str(f"loss {loss:.3f}  {tokens_per_s:,.0f} tok/s", refresh=False)
        self.bar.update(step - self.bar.n)

    def close(self) -> None:
        self.bar.close()


# --- the experiment -------------------------------------------------------------------------------

def versions() -> dict:
    import platform

    import flax
    import jax
    import optax
    import orbax.checkpoint

    import moejax

    return {"python": platform.python_version(), "jax": jax.__version__, "flax": flax.__version__,
            "optax": optax.__version__, "orbax_checkpoint": getattr(orbax.checkpoint, "__version__", "?"),
            "moejax": getattr(moejax, "__version__", "?")}


def run(cfg: TrainTinyConfig, progress=None, job_dir=None):
    import pandas as pd

    from moejax.data import write_byte_tokenizer
    from moejax.hf.staging import staged_directory

    timings = {}
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
    manager = _checkpoint_manager(cfg)
    meta = _restore(cfg, manager, trainer) or {}
    start = int(meta.get("step", 0))
    history = [tuple(r) for r in meta.get("history", [])]      # (step, loss, lr, max_load_share)
    evals = [tuple(r) for r in meta.get("evals", [])]          # (step, heldout_loss)
    train_s_before = float(meta.get("train_s", 0.0))
    if start:
        log.info("train_tiny: resuming from step %d (%s), continuing to step %d", start, cfg.orbax_dir,
                 cfg.train.steps)
    timings["setup_s"] = time.perf_counter() - t0

    t, dc = cfg.train, cfg.data
    tokens_per_step = t.batch_size * dc.seq_len

    def meta_at(step, train_s):
        return {"step": step, "seed": cfg.seed, "fingerprint": cfg.fingerprint(), "history": history,
                "evals": evals, "train_s": train_s}

    bar = Progress(t.steps, start)
    smooth, compile_s, eval_s = None, 0.0, 0.0
    t_train = time.perf_counter()
    t_rate, rate = time.perf_counter(), 0.0
    pending = []   # (step, device metrics): fetched lazily so the host does not wait on every step
    try:
        for step in range(start, t.steps):
            ids = train_batch(corpus.train_tokens, cfg.seed, step, t.batch_size, dc.seq_len)
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
                eval_s += time.perf_counter() - te
            if done % t.checkpoint_every == 0 or done == t.steps:
                log.info("train_tiny: step %d/%d  loss %.4f (smoothed)  %.0f tokens/s%s", done, t.steps, smooth, rate,
                         f"  held-out loss {evals[-1][1]:.4f}" if evals and evals[-1][0] == done else "")
                _save_checkpoint(manager, trainer, done,
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
        "train_s": train_s_before + timings["train_s"], "resumed_from_step": start,
        "orbax_dir": str(cfg.orbax_dir), "versions": versions(),
    }
    ts = time.perf_counter()
    out = Path(cfg.path).expanduser()
    with staged_directory(out, overwrite=True) as staging:   # checkpoint + record appear as one folder
        model.save_pretrained(staging, overwrite=True)
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
    for l, load in loads.items():
        rows.append({"step": t.steps, "metric": "max_load_share", "layer": l, "value": float(load.max() / load.sum())})
        if l in biases:
            rows += [{"step": t.steps, "metric": "bias_min", "layer": l, "value": float(biases[l].min())},
                     {"step": t.steps, "metric": "bias_max", "layer": l, "value": float(biases[l].max())}]
    df = pd.DataFrame(rows)
    df["path"] = str(out)
    return df, timings


def summary_title(cfg: TrainTinyConfig) -> str:
    return f"train_tiny: {cfg.train.steps} steps, saved to {cfg.path} (loss in nats per byte):"


def summary_table(df):
    import pandas as pd

    last = df["step"].max()
    train = df[df.metric == "train_loss"].sort_values("step")
    out = {"train_loss (last 20 steps)": train.value.tail(20).mean(),
           "heldout_loss": df[(df.metric == "heldout_loss") & (df.step == last)].value.mean(),
           "heldout_ppl": df[(df.metric == "heldout_ppl") & (df.step == last)].value.mean(),
           "max_load_share (held-out, mean over layers)": df[df.metric == "max_load_share"].value.mean(),
           "started at step": df[df.metric == "start_step"].value.iloc[0]}
    return pd.DataFrame({"value": out})
