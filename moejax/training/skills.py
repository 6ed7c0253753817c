"""The skills corpus: procedurally generated, seeded documents for six computations a byte-level
model can learn exactly, mixed with the standard library's code at skewed shares, so that a tiny
model has abilities that pruning can break (some of them rare, as rare abilities are in a real
model's data).

Every document is one line: a prompt that names the skill, its answer, and the terminator "\\n"
(TERMINATOR), which the model must learn to emit:

| skill   | computation                                   | example                        |
|---------|-----------------------------------------------|--------------------------------|
| add     | sum of two numbers, 0..999 (carries)          | `add 417+589=1006`             |
| sort    | 4-7 digits in ascending order                 | `sort 5282=2258`               |
| rev     | a 3-6 letter string reversed                  | `rev kxqbt=tbqxk`              |
| kv      | the value of a key defined earlier (recall)   | `kv c3=x7 k9=b2 q1=f4 ?k9=b2`  |
| close   | the closers of the still-open brackets (stack)| `close ([]{(=)})`              |
| up      | a 3-8 letter word in upper case               | `up hello=HELLO`               |

Held-out documents never occur in training: a document is held out when a stable hash of its
prompt falls in HELDOUT_FRACTION (crc32, the same on every machine); training draws reject those
prompts and held-out draws keep only them. Everything is a pure function of (skill, seed, split).

The mix (`data.mix` of train_tiny): shares of training *bytes*, `code` (the standard library and
any `data.text` files) plus skills, summing to one; `DEFAULT_MIX` keeps `kv`, `close` and `up` at
5% of training bytes on purpose.
"""

from __future__ import annotations

import dataclasses
import random
import string
import zlib
from typing import Callable

import numpy as np

from moejax.errors import ConfigError

TERMINATOR = "\n"
HELDOUT_FRACTION = 0.1
CODE = "code"   # the mix's name for the standard library (and data.text) bytes

DEFAULT_MIX = {"code": 0.5, "add": 0.12, "sort": 0.1, "rev": 0.13, "kv": 0.05, "close": 0.05, "up": 0.05}
RARE_SHARE = 0.05                # skills at or below this share of training bytes are "rare"


@dataclasses.dataclass(frozen=True)
class Skill:
    """One computation: `draw(rng) -> (prompt, answer)`; the document is prompt + answer + "\\n"."""

    name: str
    draw: Callable[[random.Random], tuple[str, str]]
    summary: str
    longest: int     # bytes of the longest document it can draw, terminator included
    answer_max: int  # bytes of the longest answer it can draw (terminator excluded)


def _add(rng):
    a, b = rng.randrange(1000), rng.randrange(1000)
    return f"add {a}+{b}=", str(a + b)


def _sort(rng):
    digits = "".join(rng.choice(string.digits) for _ in range(rng.randint(4, 7)))
    return f"sort {digits}=", "".join(sorted(digits))


def _rev(rng):
    word = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 6)))
    return f"rev {word}=", word[::-1]


def _kv(rng):
    keys = rng.sample([c + d for c in string.ascii_lowercase for d in string.digits], rng.randint(3, 5))
    values = [rng.choice(string.ascii_lowercase) + rng.choice(string.digits) for _ in keys]
    asked = rng.randrange(len(keys))
    pairs = " ".join(f"{k}={v}" for k, v in zip(keys, values))
    return f"kv {pairs} ?{keys[asked]}=", values[asked]


OPENERS, CLOSERS = "([{<", ")]}>"


def _close(rng):
    """A bracket string with some pairs already closed; the answer closes what is still open."""
    text, stack = [], []
    n = rng.randint(2, 8)
    while len(text) < n or not stack:
        if stack and rng.random() < 0.3:
            text.append(CLOSERS[OPENERS.index(stack.pop())])
        else:
            stack.append(rng.choice(OPENERS))
            text.append(stack[-1])
    return f"close {''.join(text)}=", "".join(CLOSERS[OPENERS.index(o)] for o in reversed(stack))


def _up(rng):
    word = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 8)))
    return f"up {word}=", word.upper()


SKILLS = {s.name: s for s in (
    Skill("add", _add, "the sum of two numbers below 1000", len("add 999+999=1998\n"), 4),
    Skill("sort", _sort, "4-7 digits sorted ascending", len("sort =\n") + 14, 7),
    Skill("rev", _rev, "a 3-6 letter string reversed", len("rev =\n") + 12, 6),
    Skill("kv", _kv, "recall the value of a key defined earlier in the line", len("kv  ?=\n") + 5 * 6 - 1 + 2 + 2, 2),
    Skill("close", _close, "close the brackets still open, innermost first", len("close =\n") + 2 * 8, 8),
    Skill("up", _up, "a 3-8 letter word in upper case", len("up =\n") + 16, 8),
)}


def longest_document(names) -> int:
    """Bytes of the longest document any of the named skills can draw (0 for none)."""
    return max((SKILLS[n].longest for n in names), default=0)


def is_heldout(prompt: str) -> bool:
    """Whether a prompt belongs to the held-out split (stable crc32 of its UTF-8 bytes)."""
    return zlib.crc32(prompt.encode("utf-8")) % 1000 < HELDOUT_FRACTION * 1000


def documents(skill: str, n: int, seed: int, split: str = "train") -> list[tuple[str, str]]:
    """n (prompt, answer) pairs of `skill` from the `split` ("train" or "heldout") side, a pure
    function of (skill, n, seed, split); held-out pairs are distinct prompts."""
    if skill not in SKILLS:
        raise ConfigError(f"unknown skill {skill!r}; the skills are {list(SKILLS)}")
    if split not in ("train", "heldout"):
        raise ConfigError(f"split={split!r}; expected 'train' or 'heldout'")
    rng = random.Random(f"moejax-skills:{skill}:{seed}:{split}")
    want_heldout = split == "heldout"
    out, seen = [], set()
    draw = SKILLS[skill].draw
    while len(out) < n:
        prompt, answer = draw(rng)
        if is_heldout(prompt) != want_heldout or (want_heldout and prompt in seen):
            continue
        seen.add(prompt)
        out.append((prompt, answer))
    return out


def text(prompt: str, answer: str) -> str:
    return prompt + answer + TERMINATOR


def check_mix(mix, where: str = "data.mix") -> dict:
    """The mix as {name: share}, refused by name when a name is unknown, a share is negative or not
    a number, or the shares do not sum to one."""
    if not isinstance(mix, dict) or not mix:
        raise ConfigError(f"{where}={mix!r}; expected a mapping of '{CODE}' and skills to shares of "
                          f"training bytes, e.g. {DEFAULT_MIX}")
    unknown = sorted(set(mix) - set(SKILLS) - {CODE})
    if unknown:
        raise ConfigError(f"{where} names unknown text {unknown}; known: {[CODE, *SKILLS]}")
    out = {}
    for k, v in mix.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
            raise ConfigError(f"{where}.{k}={v!r}; a share must be a number >= 0")
        out[k] = float(v)
    total = sum(out.values())
    if abs(total - 1.0) > 1e-6:
        how = (" (on the command line data.mix={code: 0.9, add: 0.1} replaces the whole mix, data.mix={code: 1.0} "
               "is code only; data.mix.add=0.12 changes one share, so change another to keep the sum)"
               if where == "data.mix" else "")
        raise ConfigError(f"{where} shares sum to {total:.6g}, not 1: {out}{how}")
    return out


def texts_of_bytes(skill: str, n_bytes: float, seed: int, estimate_seed: int) -> list[str]:
    """Training-split document texts of `skill` holding about n_bytes bytes: the count is n_bytes
    over the mean length of 200 documents drawn with `estimate_seed` (at least one document)."""
    mean = np.mean([len(text(*d)) for d in documents(skill, 200, estimate_seed)])
    return [text(*d) for d in documents(skill, max(1, int(n_bytes / mean)), seed)]


def skill_stream(mix: dict, n_bytes: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(uint8 bytes, int64 document starts): the skills' training documents, shuffled together,
    each skill's share of the bytes its share of the mix among the skills (about n_bytes in all)."""
    skills = {k: v for k, v in mix.items() if k != CODE and v > 0}
    total = sum(skills.values())
    docs = []
    for name, share in skills.items():
        docs += texts_of_bytes(name, n_bytes * share / total, seed, seed + 7919)
    random.Random(f"moejax-skills-shuffle:{seed}").shuffle(docs)
    data = "".join(docs).encode("utf-8")
    starts = np.cumsum([0] + [len(d) for d in docs[:-1]])
    return np.frombuffer(data, np.uint8), starts.astype(np.int64)


CALIBRATIONS = ("code", "skills", "uniform", "train")
# a mix as a `calibration=` override is written on a shell command line: '=' and ',' need Hydra's quotes
QUOTED_MIX = """'calibration="code=0.5,kv=0.5"' (single quotes for the shell, double quotes for Hydra)"""


def calibration_mix(spec: str, trained_mix: dict | None = None) -> dict:
    """The shares of calibration tokens a `calibration=` setting names:
    - "code": the code text only (the default: what calibration was before the skills corpus);
    - "skills": every skill at an equal share, no code;
    - "uniform": code and every skill at equal shares;
    - "train": the model's own training mix (`trained_mix`, from its moejax_tiny.json);
    - "NAME=SHARE,NAME=SHARE,...": any mix of code and skills (shares summing to one)."""
    if not isinstance(spec, str) or not spec:
        raise ConfigError(f"calibration={spec!r}; expected one of {list(CALIBRATIONS)} or a mix, "
                          f"{QUOTED_MIX}")
    if spec == "code":
        return {CODE: 1.0}
    if spec == "skills":
        return {k: 1.0 / len(SKILLS) for k in SKILLS}
    if spec == "uniform":
        return {k: 1.0 / (len(SKILLS) + 1) for k in (CODE, *SKILLS)}
    if spec == "train":
        if not trained_mix:
            raise ConfigError("calibration=train: the model records no training mix (data.mix in its "
                              f"moejax_tiny.json); name one: {QUOTED_MIX}")
        return check_mix(dict(trained_mix), "the model's data.mix")
    mix = {}
    for part in spec.split(","):
        name, sep, share = part.partition("=")
        try:
            mix[name.strip()] = float(share)
        except ValueError:
            raise ConfigError(f"calibration={spec!r}: {part!r} is not NAME=SHARE; expected one of "
                              f"{list(CALIBRATIONS)} or a mix, {QUOTED_MIX}") from None
        if not sep:
            raise ConfigError(f"calibration={spec!r}: {part!r} is not NAME=SHARE")
    return check_mix(mix, f"calibration={spec!r}")


def calibration_documents(mix: dict, n_bytes: int, seed: int) -> list[str]:
    """The skills' calibration documents, shuffled together: training-split documents (the model
    saw their kind, never the held-out ones), about mix[skill] * n_bytes bytes of each skill,
    drawn apart from the training stream's own draws (seed offset)."""
    docs = []
    for name, share in mix.items():
        if name != CODE and share > 0:
            docs += texts_of_bytes(name, share * n_bytes, seed + 104729, seed + 7919)
    random.Random(f"calibration:{seed}").shuffle(docs)
    return docs
