"""train_tiny's corpus: the Python standard library's sources (and any `data.text` files) as
bytes, split by file into training and held-out files (moejax.data.split_heldout), and the
training batches, each a pure function of (seed, step) so a resumed run sees the same ones."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from moejax.data import byte_stream, python_stdlib_root, split_heldout, stdlib_sources, text_files
from moejax.errors import ConfigError
from moejax.training.config import TrainTinyConfig
from moejax.training.skills import CODE, skill_stream


@dataclasses.dataclass
class Corpus:
    root: Path                      # the standard library folder (names below are relative to it)
    train: list                     # training file names (stdlib-relative, or absolute for data.text)
    heldout: list
    train_tokens: np.ndarray        # uint8 byte stream of the training files
    heldout_ids: np.ndarray         # int32 [n_seq, seq_len], the held-out files packed in order
    skills: np.ndarray | None = None        # uint8 stream of skills documents (data.mix), or None
    skill_starts: np.ndarray | None = None  # int64 start offset of each skills document in it
    code_share: float = 1.0                 # share of training rows (and so bytes) drawn from the code

    def batch(self, seed: int, step: int, batch: int, seq_len: int) -> np.ndarray:
        """Training batch `step`: code rows as `train_batch`, and with a skills mix, each row drawn
        from the skills stream with probability 1 - code_share, starting at a document's start
        (so a prompt is seen from its first byte, as at evaluation). A pure function of (seed, step)."""
        if self.skills is None:
            return train_batch(self.train_tokens, seed, step, batch, seq_len)
        return mixed_batch(self, seed, step, batch, seq_len)


def _resolve(root: Path, name: str) -> Path:
    p = Path(name)
    return p if p.is_absolute() else root / p


def build_corpus(cfg: TrainTinyConfig) -> Corpus:
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
    if len(stream) < cfg.data.seq_len + 1 and dc.mix.get(CODE, 1.0) > 0:   # (code-free mixes need no code)
        raise ConfigError(f"train_tiny: the training files hold {len(stream)} bytes, fewer than one "
                          f"sequence (data.seq_len={dc.seq_len})")
    held = byte_stream([_resolve(root, n) for n in heldout])[: dc.eval_tokens]
    n_seq = len(held) // dc.seq_len
    if n_seq == 0:
        raise ConfigError(f"train_tiny: the held-out files hold {len(held)} bytes, fewer than one sequence "
                          f"(data.seq_len={dc.seq_len})")
    ids = held[: n_seq * dc.seq_len].reshape(n_seq, dc.seq_len).astype(np.int32)
    if not dc.mix:
        return Corpus(root, train, heldout, stream, ids)

    skills, starts = skill_stream(dc.mix, dc.skill_bytes, cfg.seed)
    usable = starts[starts + dc.seq_len <= len(skills)]
    return Corpus(root, train, heldout, stream, ids, skills, usable, dc.mix.get(CODE, 0.0))


def train_batch(stream: np.ndarray, seed: int, step: int, batch: int, seq_len: int) -> np.ndarray:
    """Batch `step` (0-based): random windows of the training stream, a pure function of (seed, step)."""
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(stream) - seq_len + 1, size=batch)
    return stream[starts[:, None] + np.arange(seq_len)].astype(np.int32)



def mixed_batch(corpus: Corpus, seed: int, step: int, batch: int, seq_len: int) -> np.ndarray:
    """A batch of code windows and skills windows (Corpus.batch), a pure function of (seed, step)."""
    rng = np.random.default_rng([seed, step, 1])
    from_code = rng.random(batch) < corpus.code_share
    rows = np.empty((batch, seq_len), np.int32)
    n_code = int(from_code.sum())
    if n_code:
        rows[from_code] = train_batch(corpus.train_tokens, seed, step, n_code, seq_len)
    if n_code < batch:
        starts = corpus.skill_starts[rng.integers(0, len(corpus.skill_starts), size=batch - n_code)]
        rows[~from_code] = corpus.skills[starts[:, None] + np.arange(seq_len)]
    return rows
