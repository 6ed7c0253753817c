"""Offline lm-eval tasks built from held-out Python files (by default the ones experiment=train_tiny
held out, named in the checkpoint's `moejax_tiny.json`), for judging a byte-level model before and
after pruning with lm-eval's harness, without a network or the Hugging Face Hub.

    python -m moejax.evaluation.tasks --model CKPT --out DIR        # held-out files from CKPT/moejax_tiny.json
    python -m moejax.evaluation.tasks --files a.py b.py --out DIR
    lm_eval --model hf --model_args pretrained=CKPT --include_path DIR --tasks stdlib_nextline,stdlib_mc,stdlib_ppl

`write_stdlib_tasks` writes, per task, `<task>.yaml` and `<task>.jsonl` (its documents, JSON lines;
the YAML points at the JSON by absolute path: `dataset_path: json`, `test_split: test`). The
folder appears complete or not at all (`staged_directory`). Everything is a pure function of the
files' text, the counts and the seed: two builds into the same folder are byte-identical.

Files are read as training read them (`moejax.data.byte_stream`: UTF-8, undecodable bytes
replaced, universal newlines) and cut into lines at "\\n" only. A "context" is a run of whole
lines (each ending with "\\n") right before a target line: as many as fit in max_context_bytes
UTF-8 bytes, at least MIN_CONTEXT_LINES. Target lines are non-blank, at most MAX_TARGET_BYTES
bytes, not comments, not inside a multi-line string (docstrings), and end with "\\n" in the file.

Position budget: every document fits in `max_positions` tokens (bytes), however lm-eval is
called. For a train_tiny checkpoint that is the length it was *trained* at (moejax_tiny.json's
config.data.seq_len, 128 by default), not max_position_embeddings (512): the model has never
seen longer windows and its perplexity at 512 positions is about 4x worse (measured: 17 vs 4.8
per byte). So, by default, contexts hold at most 128 - 41 = 87 bytes, and stdlib_ppl pieces at
most 127 bytes (504 of them, ~64 KB).

- stdlib_nextline (generate_until): {"context", "prefix", "target"}: the context ends with the
  start of the next line (`line_prefix`: its indentation and first word, "    return "); greedy
  generation until "\\n" (at most MAX_GEN_TOKS bytes) must reproduce the rest of that line
  exactly (exact_match), and chrF (character n-gram F-score, graded: the small tiny model seldom
  matches a whole rest of line exactly).
- stdlib_mc (multiple_choice): {"context", "choices", "answer"}: the true next line and 3
  distinct other lines of the same file (target-like lines, drawn at random), shuffled; each
  choice is the whole line with its indentation and its "\\n" (so a choice that is a prefix of
  another does not win by stopping early); target_delimiter "" (lm-eval scores context + choice).
  acc and acc_norm; chance is 0.25.
- stdlib_ppl (loglikelihood_rolling): {"text"}: whole files or pieces of files cut at line ends,
  at most min(PPL_CHUNK_BYTES, max_positions - 1) bytes each; word_perplexity, byte_perplexity,
  bits_per_byte (as lm-eval's wikitext task). lm-eval's hf backend scores the first window after the tokenizer's BOS or, with
  none (as the byte-level tokenizer), after its EOS token.

Every document also carries "file" (as given, or the record's relative name) and "line" (1-based
line number of the target, or of the chunk's first line).
"""

from __future__ import annotations

import argparse
import io
import json
import random
import sys
import tokenize
from pathlib import Path

import yaml

from moejax.data import read_text
from moejax.errors import ConfigError, MoejaxError
from moejax.hf.io.staging import check_apart, staged_directory

TASKS = ("stdlib_nextline", "stdlib_mc", "stdlib_ppl")
RECORD = "moejax_tiny.json"          # written by experiment=train_tiny next to the checkpoint
MAX_GEN_TOKS = 48
DEFAULT_MAX_CONTEXT_BYTES = 300      # the most, when the position budget allows it
DEFAULT_POSITIONS = 512              # position budget without a checkpoint to read it from
MAX_TARGET_BYTES = 40
MIN_CONTEXT_LINES = 3
PPL_CHUNK_BYTES = 4000               # the most; a smaller position budget gives shorter pieces
PPL_TOTAL_BYTES = 64000              # n_ppl=None: as many pieces as hold about this much text
N_CHOICES = 4


def heldout_files(checkpoint) -> list[tuple[str, Path]]:
    """(name, path) of the held-out files named in `checkpoint/moejax_tiny.json` ("stdlib_root" +
    "heldout")."""
    record_path = Path(checkpoint) / RECORD
    if not record_path.is_file():
        raise ConfigError(f"{record_path}: no such file (written by experiment=train_tiny next to the "
                          "checkpoint; it names the held-out files); pass the files instead (--files)")
    try:
        record = json.loads(record_path.read_text(encoding="utf-8"))
        root, names = Path(record["stdlib_root"]), list(record["heldout"])
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{record_path}: expected keys 'stdlib_root' and 'heldout' ({e})") from None
    if not names:
        raise ConfigError(f"{record_path}: 'heldout' names no files")
    return [(n, root / n) for n in names]


def _read_lines(path: Path) -> list[str]:
    """The file's lines, each with its "\\n" (the last one may lack it), read as training reads."""
    try:
        text = read_text(path)
    except OSError as e:
        raise ConfigError(f"held-out file {path}: cannot be read ({e})") from None
    lines = text.split("\n")
    return [l + "\n" for l in lines[:-1]] + ([lines[-1]] if lines[-1] else [])


def _string_rows(lines: list[str]) -> set[int]:
    """0-based indices of lines inside multi-line strings: every line after the string's first,
    and its first too when the line starts with the string (a docstring's opening). Empty when the
    file does not tokenize."""
    rows = set()
    try:
        for tok in tokenize.generate_tokens(io.StringIO("".join(lines)).readline):
            (r0, c0), (r1, _) = tok.start, tok.end
            if tok.type == tokenize.STRING and r1 > r0:
                first = 0 if lines[r0 - 1][:c0].strip() == "" else 1
                rows.update(range(r0 - 1 + first, r1))
    except (tokenize.TokenError, SyntaxError, IndentationError, ValueError):
        return set()
    return rows


def _target_like(line: str) -> bool:
    """A line a small byte-level model can be asked to produce: ends with "\\n", non-blank, short,
    not a comment, and harmless to lm-eval's templating (which turns "[...]" into a list)."""
    body = line[:-1]
    stripped = body.strip()
    return (line.endswith("\n") and bool(stripped) and len(body.encode("utf-8")) <= MAX_TARGET_BYTES
            and not stripped.startswith("#") and "\x00" not in body and "\r" not in body
            and not (body.startswith("[") and body.endswith("]")) and not body.isdigit())


def _context_start(lines: list[str], i: int, max_context_bytes: int) -> int | None:
    """First line of the longest run of whole lines ending right before line i that fits in
    max_context_bytes bytes; None when fewer than MIN_CONTEXT_LINES fit."""
    j, size = i, 0
    while j > 0:
        n = len(lines[j - 1].encode("utf-8"))
        if size + n > max_context_bytes or "\x00" in lines[j - 1]:
            break
        size += n
        j -= 1
    return j if i - j >= MIN_CONTEXT_LINES else None


class _File:
    def __init__(self, name: str, path: Path, max_context_bytes: int):
        self.name, self.lines = name, _read_lines(path)
        in_string = _string_rows(self.lines)
        self.target_like = [i for i, l in enumerate(self.lines) if i not in in_string and _target_like(l)]
        self.targets = [(i, j) for i in self.target_like
                        if (j := _context_start(self.lines, i, max_context_bytes)) is not None]


def line_prefix(line: str) -> str | None:
    """The start of a line the stdlib_nextline prompt gives away: its indentation and first word
    with the space after it ("    return "), or up to its first "(" ("    foo("); None when that
    leaves nothing to complete. A byte-level model this small cannot guess a whole new line
    (measured: greedy decoding reproduces none of 3,053 candidate lines exactly), but it can
    complete one it has seen begin."""
    body = line[:-1] if line.endswith("\n") else line
    indent = len(body) - len(body.lstrip())
    rest = body[indent:]
    for sep in (" ", "("):
        cut = rest.find(sep)
        if cut >= 1 and rest[cut + 1:].strip():
            return body[:indent + cut + 1]
    return None


def _nextline_docs(files: list[_File], n: int, rng: random.Random) -> list[dict]:
    cands = [(f, i, j, p) for f in files for i, j in f.targets if (p := line_prefix(f.lines[i])) is not None]
    picked = sorted(rng.sample(range(len(cands)), min(n, len(cands))))
    return [{"context": "".join(f.lines[j:i]) + p, "prefix": p, "target": f.lines[i][len(p):-1], "file": f.name,
             "line": i + 1} for f, i, j, p in (cands[k] for k in picked)]


def _mc_docs(files: list[_File], n: int, rng: random.Random) -> list[dict]:
    cands = [(f, i, j) for f in files for i, j in f.targets]
    order = list(range(len(cands)))
    rng.shuffle(order)
    docs = []
    for k in order:                       # in random order until n documents have 3 distractors
        if len(docs) == n:
            break
        f, i, j = cands[k]
        answer = f.lines[i]
        others = sorted({f.lines[m] for m in f.target_like} - {answer})
        if len(others) < N_CHOICES - 1:
            continue
        choices = [answer] + rng.sample(others, N_CHOICES - 1)
        rng.shuffle(choices)
        docs.append({"context": "".join(f.lines[j:i]), "choices": choices, "answer": choices.index(answer),
                     "file": f.name, "line": i + 1, "_key": k})
    docs.sort(key=lambda d: d.pop("_key"))
    return docs


def _chunks(f: _File, max_bytes: int) -> list[tuple[int, str]]:
    """(first line index, text): runs of whole lines of at most max_bytes bytes; a longer line is
    cut at character boundaries."""
    out, start, buf, size = [], 0, [], 0
    for i, line in enumerate(f.lines):
        n = len(line.encode("utf-8"))
        if buf and size + n > max_bytes:
            out.append((start, "".join(buf)))
            buf, size = [], 0
        if not buf:
            start = i
        while n > max_bytes:              # a single line longer than a chunk
            piece = line.encode("utf-8")[:max_bytes].decode("utf-8", errors="ignore")
            out.append((i, piece))
            line = line[len(piece):]
            n = len(line.encode("utf-8"))
        buf.append(line)
        size += n
    if buf:
        out.append((start, "".join(buf)))
    return [(s, t) for s, t in out if t.strip() and "\x00" not in t and not (t.startswith("[") and t.endswith("]"))]


def _ppl_docs(files: list[_File], n: int, chunk_bytes: int, rng: random.Random) -> list[dict]:
    cands = [(f, s, t) for f in files for s, t in _chunks(f, chunk_bytes)]
    picked = sorted(rng.sample(range(len(cands)), min(n, len(cands))))
    return [{"text": t, "file": f.name, "line": s + 1} for f, s, t in (cands[k] for k in picked)]


def _task_config(task: str, data_file: Path) -> dict:
    head = {"task": task, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(data_file)}},
            "test_split": "test"}
    mean = {"aggregation": "mean", "higher_is_better": True}
    if task == "stdlib_nextline":
        body = {"output_type": "generate_until", "doc_to_text": "{{context}}", "doc_to_target": "{{target}}",
                "target_delimiter": "",
                "generation_kwargs": {"until": ["\n"], "max_gen_toks": MAX_GEN_TOKS, "do_sample": False},
                "metric_list": [{"metric": "exact_match", **mean},
                                # graded: character n-gram F-score of the completions (sacrebleu's chrF,
                                # corpus level), which separates models that rarely match exactly
                                {"metric": "chrf", "aggregation": "chrf", "higher_is_better": True}]}
    elif task == "stdlib_mc":
        body = {"output_type": "multiple_choice", "doc_to_text": "{{context}}", "doc_to_choice": "{{choices}}",
                "doc_to_target": "{{answer}}", "target_delimiter": "",
                "metric_list": [{"metric": "acc", **mean}, {"metric": "acc_norm", **mean}]}
    else:
        body = {"output_type": "loglikelihood_rolling", "doc_to_text": "", "doc_to_target": "{{text}}",
                "metric_list": [{"metric": m, "aggregation": agg, "higher_is_better": False}
                                for m, agg in (("word_perplexity", "weighted_perplexity"),
                                               ("byte_perplexity", "weighted_perplexity"),
                                               ("bits_per_byte", "bits_per_byte"))]}
    return {**head, **body, "metadata": {"version": 1.0}}


def _dumper():
    class Dumper(yaml.SafeDumper):
        """Strings with control characters (the "\\n" stop sequence) as double-quoted escapes."""

    def str_repr(dumper, s):
        style = '"' if any(c < " " for c in s) else None
        return dumper.represent_scalar("tag:yaml.org,2002:str", s, style=style)

    Dumper.add_representer(str, str_repr)
    return Dumper


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: cannot be read as JSON ({e})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def position_budget(checkpoint=None) -> tuple[int, str]:
    """(positions, where from): how many tokens a document may span. A train_tiny checkpoint is
    trained on windows of data.seq_len bytes (its moejax_tiny.json) and is no good beyond them,
    whatever max_position_embeddings says; otherwise config.json's max_position_embeddings; else
    DEFAULT_POSITIONS."""
    if checkpoint is not None:
        record = Path(checkpoint) / RECORD
        if record.is_file():  # a record without the training length (not train_tiny's) says nothing
            seq_len = (_read_json(record).get("config") or {}).get("data", {}).get("seq_len")
            if isinstance(seq_len, int) and seq_len > 0:
                return seq_len, f"{record}: config.data.seq_len (the length it was trained at)"
        config = Path(checkpoint) / "config.json"
        if config.is_file():
            n = _read_json(config).get("max_position_embeddings")
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ConfigError(f"{config}: max_position_embeddings={n!r}; expected a positive integer")
            return n, f"{config}: max_position_embeddings"
    return DEFAULT_POSITIONS, "the default"


def write_stdlib_tasks(out_dir, files=None, *, checkpoint=None, n_nextline: int = 200, n_mc: int = 200,
                       n_ppl: int | None = None, max_context_bytes: int | None = None,
                       max_positions: int | None = None, seed: int = 0) -> Path:
    """Write the TASKS (YAML + JSON lines each) into out_dir (replacing it) and return its path.

    files: paths of Python files; None reads the held-out files from `checkpoint/moejax_tiny.json`.
    n_*: documents per task (fewer when the files offer fewer); n_ppl=None: as many pieces as hold
    about PPL_TOTAL_BYTES bytes (16 pieces of 4,000 bytes with a 512-position budget).
    max_positions: tokens a document may span (default `position_budget(checkpoint)`: 128 for the
    default train_tiny model, trained on 128-byte windows). Every document stays within it however
    lm-eval is called: context + the longest possible answer line (MAX_TARGET_BYTES + "\\n"),
    and stdlib_ppl pieces of at most max_positions - 1 bytes (lm-eval puts the EOS token before
    the first window), so a rolling window never reaches an untrained position. A generation that
    runs past max_positions is already longer than any target, so already wrong.
    max_context_bytes: default min(DEFAULT_MAX_CONTEXT_BYTES, max_positions - MAX_TARGET_BYTES - 1)."""
    _Dumper = _dumper()
    if max_positions is None:
        max_positions, source = position_budget(checkpoint)
    else:
        source = "max_positions"
    answer_bytes = MAX_TARGET_BYTES + 1
    if max_context_bytes is None:
        max_context_bytes = min(DEFAULT_MAX_CONTEXT_BYTES, max_positions - answer_bytes)
    for key, v in (("n_nextline", n_nextline), ("n_mc", n_mc), ("n_ppl", n_ppl), ("seed", seed),
                   ("max_context_bytes", max_context_bytes), ("max_positions", max_positions)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            raise ConfigError(f"write_stdlib_tasks: {key}={v!r}; expected an int >= 0")
    if max_context_bytes + answer_bytes > max_positions or max_context_bytes < MIN_CONTEXT_LINES * 2:
        raise ConfigError(f"write_stdlib_tasks: max_context_bytes={max_context_bytes} + {answer_bytes} answer bytes "
                          f"does not fit max_positions={max_positions} ({source})")
    chunk_bytes = min(PPL_CHUNK_BYTES, max_positions - 1)
    if n_ppl is None:
        n_ppl = -(-PPL_TOTAL_BYTES // chunk_bytes)
    if files is None:
        if checkpoint is None:
            raise ConfigError("write_stdlib_tasks: pass files or a checkpoint with a moejax_tiny.json")
        named = heldout_files(checkpoint)
    else:
        named = [(str(p), Path(p)) for p in files]
        if not named:
            raise ConfigError("write_stdlib_tasks: files is empty")
    check_apart(out_dir, [checkpoint, *(path for _, path in named)], "the tasks folder (--out, replaced)")
    parsed = [_File(name, Path(path), max_context_bytes) for name, path in named]
    docs = {"stdlib_nextline": _nextline_docs(parsed, n_nextline, random.Random(f"{seed}:stdlib_nextline")),
            "stdlib_mc": _mc_docs(parsed, n_mc, random.Random(f"{seed}:stdlib_mc")),
            "stdlib_ppl": _ppl_docs(parsed, n_ppl, chunk_bytes, random.Random(f"{seed}:stdlib_ppl"))}
    for task, d in docs.items():
        if not d:
            raise ConfigError(f"write_stdlib_tasks: the files give no documents for {task} "
                              f"({len(parsed)} file(s): {[n for n, _ in named][:5]})")

    out_dir = Path(out_dir).expanduser().absolute()
    with staged_directory(out_dir, overwrite=True) as staging:
        for task in TASKS:
            data = "".join(json.dumps(doc, ensure_ascii=False, sort_keys=True) + "\n" for doc in docs[task])
            (staging / f"{task}.jsonl").write_text(data, encoding="utf-8")
            config = yaml.dump(_task_config(task, out_dir / f"{task}.jsonl"), Dumper=_Dumper, sort_keys=False,
                               allow_unicode=True, width=1000)
            (staging / f"{task}.yaml").write_text(config, encoding="utf-8")
    return out_dir


def _main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moejax.evaluation.tasks",
                                     description="write offline lm-eval tasks " + ", ".join(TASKS)
                                     + " built from held-out Python files")
    parser.add_argument("--model", type=Path, help="checkpoint folder with moejax_tiny.json (its held-out files)")
    parser.add_argument("--files", type=Path, nargs="+", help="Python files to build the tasks from")
    parser.add_argument("--out", type=Path, required=True, help="folder to write (replaced)")
    parser.add_argument("--n-nextline", type=int, default=200)
    parser.add_argument("--n-mc", type=int, default=200)
    parser.add_argument("--n-ppl", type=int, default=None,
                        help=f"default: as many pieces as hold about {PPL_TOTAL_BYTES} bytes")
    parser.add_argument("--max-context-bytes", type=int, default=None,
                        help=f"default: min({DEFAULT_MAX_CONTEXT_BYTES}, max positions - {MAX_TARGET_BYTES + 1})")
    parser.add_argument("--max-positions", type=int, default=None,
                        help="tokens a document may span (default: the checkpoint's training seq_len, "
                             f"else its max_position_embeddings, else {DEFAULT_POSITIONS})")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.model is None and args.files is None:
        parser.error("pass --model CKPT or --files FILE...")
    try:
        out = write_stdlib_tasks(args.out, args.files, checkpoint=args.model, n_nextline=args.n_nextline,
                                 n_mc=args.n_mc, n_ppl=args.n_ppl, max_context_bytes=args.max_context_bytes,
                                 max_positions=args.max_positions,
                                 seed=args.seed)
    except MoejaxError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    positions = args.max_positions or position_budget(args.model)[0]
    for task in TASKS:
        n = sum(1 for _ in open(out / f"{task}.jsonl", encoding="utf-8"))
        print(f"{task}\t{n} docs")
    print(f"position budget {positions} tokens ({'--max-positions' if args.max_positions else position_budget(args.model)[1]})")
    print(f"tasks in {out} (lm_eval --include_path {out} --tasks {','.join(TASKS)})")
    return 0


if __name__ == "__main__":
    sys.exit(_main())
