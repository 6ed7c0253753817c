"""The settings of `experiment=train_tiny`, typed: the architecture (`ArchConfig`: a registered
family's `tiny` preset with config.json keys over it), the data (`DataConfig`), the optimisation
and checkpoint cadence (`TrainConfig`), and the whole (`TrainTinyConfig`, which validates them
before any training and says which of them a checkpoint must share with the run resuming it)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from moejax.errors import ConfigError
from moejax.models.registry import FAMILIES
from moejax.settings_check import refuse_unknown_settings
from moejax.training.skills import CODE, check_mix, longest_document

ORBAX_SUFFIX = ".orbax"   # the orbax checkpoints of model.path=P are in P.orbax/ (TrainTinyConfig.orbax_dir)

_NULLABLE = {"decay_steps": int, "aux_loss_alpha": float}  # settings whose default is null
_MAPPINGS = ("mix",)  # settings that are mappings (Hydra gives DictConfig-converted dicts)


def _typed(cls, d, where: str):
    """Build dataclass `cls` from a mapping: unknown keys and wrong types are ConfigErrors."""
    if d is None:
        d = {}
    if not isinstance(d, dict):
        raise ConfigError(f"train_tiny: {where} must be a mapping, got {d!r}")
    refuse_unknown_settings(cls, d, "train_tiny", lambda unknown, valid: (
        f"train_tiny: unknown setting(s) {[f'{where}.{k}' for k in unknown]}; valid {where}.*: {valid}"))
    out = {}
    for k, v in d.items():
        want = _NULLABLE.get(k) or type(getattr(cls(), k))
        if k in _MAPPINGS:
            if not isinstance(v, dict):
                raise ConfigError(f"train_tiny: {where}.{k}={v!r}; expected a mapping")
            v = dict(sorted(v.items()))
        elif want is tuple:
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
        if self.family not in FAMILIES:
            raise ConfigError(f"train_tiny: arch.family={self.family!r}; registered families: {sorted(FAMILIES)}")
        family = FAMILIES[self.family]
        if family.tiny is None:
            raise ConfigError(f"train_tiny: the {family.title} family has no tiny preset (TINY in "
                              f"moejax/models/{family.name}/presets.py)")
        overrides = {k: list(v) if isinstance(v, tuple) else v for k, v in self.overrides}
        text = family.config_class.TEXT_CONFIG  # a multimodal wrapper: the language model's settings live there
        if text:
            return {**family.tiny, text: {**family.tiny[text], **BYTE_LEVEL, "initializer_range": 0.02, **overrides}}
        return {**family.tiny, **BYTE_LEVEL, "initializer_range": 0.02, **overrides}

    def as_dict(self) -> dict:
        return {"family": self.family, **{k: list(v) if isinstance(v, tuple) else v for k, v in self.overrides}}


@dataclasses.dataclass(frozen=True)
class DataConfig:
    stdlib: bool = True            # the standard library's *.py files (sysconfig stdlib path)
    exclude_dirs: tuple = ("site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__")
    text: tuple = ()               # extra files/folders/globs, split the same way
    heldout_fraction: float = 0.05  # by a stable hash of each file's relative path
    heldout_always: tuple = ("difflib.py", "textwrap.py", "fractions.py")
    seq_len: int = 128
    eval_tokens: int = 65536       # held-out tokens evaluated (packed, from the held-out files in order)
    # the skills corpus (moejax.training.skills): shares of training bytes, "code" (the files above)
    # and skills, summing to one; empty = code only. Skill rows start at a document's start.
    mix: dict = dataclasses.field(default_factory=dict)   # {name: share}, sorted by name
    skill_bytes: int = 8_000_000   # size of the generated skills stream the rows are drawn from
    skill_eval_docs: int = 64      # held-out documents per skill for the learning curve (greedy exact match)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 1600                # ~10 min on 2 idle CPU cores, ~15 when shared (experiments/train_tiny.py)
    batch_size: int = 16
    micro_batches: int = 1           # the batch's gradient from this many slices, one after another
    #                                  (the same step, summed in another order: faster on a CPU)
    lr: float = 3e-3
    min_lr_ratio: float = 0.1        # cosine decay to lr * min_lr_ratio
    warmup_steps: int = 100
    decay_steps: int | None = None   # end of the cosine; None = steps (a resumed run with more steps
    #                                  then follows the longer schedule from where it is)
    weight_decay: float = 0.1        # matrices only (not norms or the router's bias)
    b1: float = 0.9
    b2: float = 0.95
    clip_norm: float = 1.0
    bias_update_rate: float = 1e-3   # aux-loss-free balancing: bias += rate * sign(mean_load - load)
    aux_loss_alpha: float | None = None  # null: 0 with a balance bias, 0.01 without (balance_loss_alpha)
    checkpoint_every: int = 200      # orbax checkpoints for resuming (and one at the end)
    keep_checkpoints: int = 2
    eval_every: int = 400            # held-out loss during training (0 = only at the end)
    eval_batch_size: int = 32
    rng_impl: str = "threefry2x32"   # PRNG of the initialisation; "rbg" initialises faster (tests)
    resume: bool = True              # false: delete <model.path>.orbax and start over
    overwrite: bool = False          # true: replace a model.path that is not this training's output


@dataclasses.dataclass(frozen=True)
class TrainTinyConfig:
    path: str = ""                  # where the HF checkpoint is written (model.path)
    seed: int = 0
    arch: ArchConfig = ArchConfig()
    data: DataConfig = DataConfig()
    train: TrainConfig = TrainConfig()
    mesh_data: int = 1
    mesh_expert: int = 1
    seeds: int = 1                  # seeds seed .. seed + seeds - 1, each a model at <path>/seed-<k> (seeds > 1)
    workers: int = 0                # processes training them at once, each on its own core; 0: one per core

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
        for name in ("seeds", "workers"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < (1 if name == "seeds" else 0):
                raise ConfigError(f"train_tiny: {name}={v!r}; expected an integer >= {1 if name == 'seeds' else 0}")
        if self.mesh_data * self.mesh_expert != 1:
            raise ConfigError(f"train_tiny: runs on one device; got mesh.data={self.mesh_data}, "
                              f"mesh.expert={self.mesh_expert} (use mesh=single)")
        a = self.model_config()  # the family's config class checks every arch key
        a.require_passes("training from scratch (train_tiny)")   # DeepSeek-V4's hash tables: not yet
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
        if not dc.stdlib and not dc.text and not dc.mix:
            raise ConfigError("train_tiny: no training text: data.stdlib=false and data.text=[] (name files)")
        if dc.mix:
            mix = check_mix(dict(dc.mix))
            if mix.get(CODE, 0) > 0 and not dc.stdlib and not dc.text:
                raise ConfigError(f"train_tiny: data.mix.{CODE}={mix[CODE]} but there is no code text "
                                  "(data.stdlib=false and data.text=[])")
            longest = longest_document([k for k, v in mix.items() if k != CODE and v > 0])
            if longest > dc.seq_len:
                raise ConfigError(f"train_tiny: a skills document can be {longest} bytes, longer than "
                                  f"data.seq_len={dc.seq_len}: raise data.seq_len")
            if dc.skill_bytes < dc.seq_len or dc.skill_eval_docs < 1:
                raise ConfigError(f"train_tiny: data.skill_bytes={dc.skill_bytes} must be >= data.seq_len and "
                                  f"data.skill_eval_docs={dc.skill_eval_docs} >= 1")
        if dc.eval_tokens < dc.seq_len:
            raise ConfigError(f"train_tiny: data.eval_tokens={dc.eval_tokens} is below one sequence "
                              f"(data.seq_len={dc.seq_len})")
        for name in ("steps", "batch_size", "checkpoint_every", "keep_checkpoints", "eval_batch_size"):
            if getattr(t, name) < 1:
                raise ConfigError(f"train_tiny: train.{name}={getattr(t, name)} must be >= 1")
        if t.micro_batches < 1 or t.batch_size % t.micro_batches:
            raise ConfigError(f"train_tiny: train.micro_batches={t.micro_batches} must be >= 1 and divide "
                              f"train.batch_size={t.batch_size}")
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

    def seed_configs(self) -> list["TrainTinyConfig"]:
        """One single-seed training per seed: seeds=1 is this one (at model.path); seeds=N > 1 are
        seeds seed .. seed + N - 1, seed k saved at <model.path>/seed-<k>."""
        if self.seeds == 1:
            return [self]
        return [dataclasses.replace(self, seed=k, seeds=1, workers=0, path=str(Path(self.path) / f"seed-{k}"))
                for k in range(self.seed, self.seed + self.seeds)]

    def model_config(self):
        """The family's typed config of the architecture (every key checked by the family's class)."""
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
        schedule end, checkpoint cadence, evaluation, initialisation PRNG, resume or micro-batching)."""
        t = dataclasses.asdict(self.train)
        for k in ("steps", "decay_steps", "checkpoint_every", "keep_checkpoints", "eval_every", "eval_batch_size",
                  "rng_impl", "resume", "overwrite", "micro_batches"):
            t.pop(k)
        dc = dataclasses.asdict(self.data)
        dc.pop("eval_tokens")
        return json.loads(json.dumps({"seed": self.seed, "arch": self.arch.as_dict(), "data": dc,
                                      "train": t}))

