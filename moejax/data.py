"""Calibration data: local text (files, folders, globs) tokenised with the checkpoint's own
tokenizer, packed into sequences; or pre-tokenised ids from a .npy file.

Tokenizers: `tokenizer.json` (through the `tokenizers` package) when the checkpoint has one; a
tiktoken `tiktoken.model` (Kimi-K2, Moonlight; through the `tiktoken` package, the optional extra
`moejax[tiktoken]`) with the split pattern of Moonshot's tokenization_kimi.py; byte-level ids
(UTF-8 bytes) when the checkpoint has neither. Special tokens are never produced from text.

`write_byte_tokenizer(dir, model_max_length)` writes a Hugging Face tokenizer (tokenizer.json,
tokenizer_config.json, special_tokens_map.json) whose ids are the text's UTF-8 bytes, for the
byte-level models experiment=train_tiny trains, so transformers / lm-eval can read them; byte 0
(NUL) is the eos and pad token. For a checkpoint saved without one:

    python -m moejax.data write-tokenizer CKPT_DIR [--model-max-length N]

(N defaults to config.json's max_position_embeddings.)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import sysconfig
import warnings
from pathlib import Path

import numpy as np
from tokenizers import AddedToken, Tokenizer as HFTokenizer, decoders, models, pre_tokenizers

from moejax.errors import ConfigError
from moejax.hf.io.staging import text_inputs

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py", ".text")

# The pre-tokenisation pattern of Moonshot's tiktoken tokenizers (tokenization_kimi.py, also
# Moonlight's tokenization_moonshot.py): Han runs, cased words with contractions, 1-3 digits, ...
KIMI_PAT_STR = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])


def text_files(paths) -> list[Path]:
    """Files from paths that are files, folders (recursively, files ending in TEXT_SUFFIXES) or globs."""
    files = []
    for p in paths:
        p = str(p)
        matches = [Path(m) for m in text_inputs([p])]   # a glob's matches, or the path itself
        if not matches or not all(m.exists() for m in matches):
            raise ConfigError(f"calibration text {p}: no such file or folder")
        for m in matches:
            files += sorted(f for f in m.rglob("*") if f.is_file() and f.suffix in TEXT_SUFFIXES) if m.is_dir() else [m]
    if not files:
        raise ConfigError(f"calibration text {list(map(str, paths))}: no text files found "
                          f"(folders are searched for {', '.join(TEXT_SUFFIXES)})")
    return files


class NotUtf8Warning(UserWarning):
    """A text file read for calibration, training or tasks holds bytes that are not UTF-8."""


def read_text(path) -> str:
    """A text file as UTF-8, every undecodable byte sequence read as U+FFFD (so a stray Latin-1
    byte does not stop a long run), with a warning naming the file and how many sequences were
    replaced: the tokens then differ from the file's bytes, which a researcher must know."""
    raw = Path(path).read_bytes()
    text = raw.decode("utf-8", errors="replace")
    replaced = text.count("\ufffd") - raw.count("\ufffd".encode("utf-8"))
    if replaced:
        warnings.warn(f"{path}: {replaced} byte sequence(s) are not UTF-8 and were read as U+FFFD (the replacement "
                      "character); convert the file to UTF-8 to calibrate on its exact text", NotUtf8Warning,
                      stacklevel=2)
    return text


class Tokenizer:
    """encode(text) -> list[int]; `name` says which tokenizer it is (recorded in the sidecar). The
    calibration and training text's tokenizer: special tokens are never produced from text (module
    docstring). lm-eval's tasks use `moejax.evaluation.lm_eval.LmEvalTokenizer` instead, which
    follows transformers (special tokens added, decoding, BOS / EOS ids)."""

    def __init__(self, checkpoint_dir, vocab_size: int):
        checkpoint_dir = Path(checkpoint_dir)
        tok_json = checkpoint_dir / "tokenizer.json"
        if tok_json.is_file():
            from tokenizers import Tokenizer as HFTokenizer

            try:
                self._tok = HFTokenizer.from_file(str(tok_json))
            except Exception as e:  # the tokenizers package raises plain Exceptions
                raise ConfigError(f"{tok_json}: cannot be read as a tokenizer ({e})") from None
            # Special tokens are matched in the text unless this is set (tokenizer.json cannot store it).
            self._tok.encode_special_tokens = True
            self.name = f"tokenizer.json ({tok_json})"
            self.encode = lambda text: self._tok.encode(text, add_special_tokens=False).ids
        elif (checkpoint_dir / "tiktoken.model").is_file():
            model = checkpoint_dir / "tiktoken.model"
            try:
                import tiktoken
                from tiktoken.load import load_tiktoken_bpe
            except ImportError:
                raise ConfigError(f"{model}: reading it needs the tiktoken package "
                                  "(pip install 'moejax[tiktoken]'), or pass ids with --tokens FILE.npy") from None
            try:
                ranks = load_tiktoken_bpe(str(model))
            except Exception as e:  # tiktoken raises plain exceptions for malformed files
                raise ConfigError(f"{model}: cannot be read as a tiktoken BPE file ({e})") from None
            self._tok = tiktoken.Encoding(name=model.parent.name, pat_str=KIMI_PAT_STR, mergeable_ranks=ranks,
                                          special_tokens={})
            self.name = f"tiktoken.model ({model}, {len(ranks)} ranks, Kimi split pattern)"
            self.encode = self._tok.encode_ordinary
        else:
            if vocab_size < 256:
                raise ConfigError(f"{checkpoint_dir}: no tokenizer file, and byte-level ids need a vocabulary of at "
                                  f"least 256 (vocab_size={vocab_size})")
            self.name = "byte-level (no tokenizer file in the checkpoint)"
            self.encode = lambda text: list(text.encode("utf-8"))


def pack(token_lists, seq_len: int, max_tokens: int | None = None) -> np.ndarray:
    """Concatenate documents and cut into [n_seq, seq_len] (the remainder shorter than a sequence is
    dropped); at most max_tokens tokens."""
    flat = np.fromiter((t for toks in token_lists for t in toks), dtype=np.int64)
    if max_tokens is not None:
        flat = flat[:max_tokens]
    n_seq = len(flat) // seq_len
    if n_seq == 0:
        raise ConfigError(f"calibration data has {len(flat)} tokens, fewer than one sequence of seq_len={seq_len}")
    return flat[: n_seq * seq_len].reshape(n_seq, seq_len).astype(np.int32)


def text_tokens(paths, tokenizer: Tokenizer, seq_len: int, max_tokens: int | None = None) -> np.ndarray:
    files = text_files(paths)
    docs = []
    for f in files:
        docs.append(tokenizer.encode(read_text(f)))
        if max_tokens is not None and sum(map(len, docs)) >= max_tokens:
            break
    return pack(docs, seq_len, max_tokens)


def npy_tokens(path, vocab_size: int, max_tokens: int | None = None) -> np.ndarray:
    """Pre-tokenised ids [n_seq, seq_len] from a .npy file, checked."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"tokens file {path}: no such file")
    try:
        ids = np.load(path, allow_pickle=False)
    except ValueError as e:
        raise ConfigError(f"tokens file {path}: not a numpy array file ({e})") from None
    if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer):
        raise ConfigError(f"tokens file {path}: expected an integer array [n_seq, seq_len], got {ids.dtype} {ids.shape}")
    if ids.size == 0:
        raise ConfigError(f"tokens file {path}: holds no tokens (shape {list(ids.shape)}); expected at least one "
                          "sequence [n_seq >= 1, seq_len >= 1]")
    if ids.min() < 0 or ids.max() >= vocab_size:
        raise ConfigError(f"tokens file {path}: ids must lie in [0, vocab_size={vocab_size}), "
                          f"got [{ids.min()}, {ids.max()}]")
    if max_tokens is not None:
        ids = ids[: max(1, max_tokens // ids.shape[1])]
    return ids.astype(np.int32)


# --- training text: the Python standard library, split by file into train and held-out ---------

STDLIB_EXCLUDE_DIRS = ("site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__")


def python_stdlib_root() -> Path:
    """The running Python's standard-library folder (sysconfig's "stdlib" path)."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_sources(root=None, exclude_dirs=STDLIB_EXCLUDE_DIRS) -> list[str]:
    """The standard library's *.py files as sorted POSIX paths relative to `root`, skipping any file
    under a folder named in exclude_dirs (third-party site-packages, the test suites)."""
    root = Path(root) if root is not None else python_stdlib_root()
    if not root.is_dir():
        raise ConfigError(f"standard library folder {root}: no such folder")
    skip = set(exclude_dirs)
    names = []
    for f in root.rglob("*.py"):
        rel = f.relative_to(root)
        if not skip.intersection(rel.parts[:-1]) and f.is_file():
            names.append(rel.as_posix())
    return sorted(names)


def heldout_by_hash(name: str, fraction: float, salt: str = "moejax-heldout") -> bool:
    """Whether `name` falls in the held-out `fraction`: a stable hash (sha256 of salt and name, the
    same on every machine and Python version), not Python's randomised hash()."""
    digest = hashlib.sha256(f"{salt}:{name}".encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64 < fraction


def split_heldout(names, fraction: float, always=()) -> tuple[list[str], list[str]]:
    """(training names, held-out names), disjoint, each in the input's order except that the
    held-out list starts with the names of `always` that are present (in that order)."""
    names = list(names)
    present = set(names)
    fixed = [n for n in always if n in present]
    fixed_set = set(fixed)
    hashed = [n for n in names if n not in fixed_set and heldout_by_hash(n, fraction)]
    held = set(fixed) | set(hashed)
    return [n for n in names if n not in held], fixed + hashed


def byte_stream(files) -> np.ndarray:
    """The files' text as byte-level token ids (uint8), concatenated in order, read exactly as
    `text_tokens` reads them with a byte-level `Tokenizer` (UTF-8, undecodable bytes replaced, with a warning: `read_text`)."""
    parts = [np.frombuffer(read_text(f).encode("utf-8"), np.uint8)
             for f in files]
    return np.concatenate(parts) if parts else np.zeros((0,), np.uint8)


# --- a Hugging Face tokenizer for byte-level models: token id == UTF-8 byte value ---------------


def _gpt2_byte_chars() -> list[str]:
    """GPT-2's byte -> printable unicode character table (the one tokenizers' ByteLevel uses):
    printable Latin-1 bytes stand for themselves, the others map to chr(256 + n) in byte order."""
    keep = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    chars, n = [], 0
    for b in range(256):
        if b in keep:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + n))
            n += 1
    return chars


# Byte 0 (NUL, never in source text) is the eos and pad token, id 0. Its token string is byte 0's
# ByteLevel character, "\u0100" ("Ā"): an added token must be a vocabulary entry to keep its id.
EOS_TOKEN = _gpt2_byte_chars()[0]


def byte_tokenizer():
    """A `tokenizers.Tokenizer` mapping text to its UTF-8 bytes (id b for byte b), no BOS, no
    post-processor; EOS_TOKEN (id 0) is a special added token, so decode(skip_special_tokens=True)
    drops it. Its `encode_special_tokens` is set (the text "Ā" encodes as its bytes 196, 128, not
    as id 0), but tokenizer.json does not store that flag: readers set it themselves
    (`split_special_tokens` in tokenizer_config.json for transformers; `Tokenizer` here)."""
    vocab = {c: b for b, c in enumerate(_gpt2_byte_chars())}
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(EOS_TOKEN, special=True, normalized=False)])
    tok.encode_special_tokens = True
    if tok.token_to_id(EOS_TOKEN) != 0 or tok.get_vocab_size() != 256:
        raise AssertionError("byte tokenizer: the eos token did not land on id 0")
    return tok


def write_byte_tokenizer(out_dir, model_max_length: int) -> None:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json into `out_dir` (which
    must exist): a byte-level tokenizer (`byte_tokenizer`) that transformers' AutoTokenizer loads
    as a PreTrainedTokenizerFast with eos = pad = id 0 (byte 0, token string EOS_TOKEN) and no BOS;
    `split_special_tokens` keeps the text "Ā" from turning into the eos token."""
    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        raise ConfigError(f"write_byte_tokenizer: {out_dir}: no such folder")
    if isinstance(model_max_length, bool) or not isinstance(model_max_length, int) or model_max_length <= 0:
        raise ConfigError(f"write_byte_tokenizer: model_max_length must be a positive int, got {model_max_length!r}")
    byte_tokenizer().save(str(out_dir / "tokenizer.json"))
    eos = {"content": EOS_TOKEN, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
           "special": True}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS_TOKEN, "pad_token": EOS_TOKEN,
              "bos_token": None, "add_bos_token": False, "add_eos_token": False,
              "model_max_length": model_max_length, "clean_up_tokenization_spaces": False,
              "split_special_tokens": True, "added_tokens_decoder": {"0": eos}}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    special = {"eos_token": eos, "pad_token": eos}
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n", encoding="utf-8")


def _main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moejax.data", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    w = sub.add_parser("write-tokenizer", help="write a byte-level Hugging Face tokenizer into a checkpoint folder")
    w.add_argument("checkpoint", type=Path)
    w.add_argument("--model-max-length", type=int, default=None,
                   help="default: config.json's max_position_embeddings")
    args = parser.parse_args(argv)
    try:
        n = args.model_max_length
        if n is None:
            config = args.checkpoint / "config.json"
            try:
                n = json.loads(config.read_text(encoding="utf-8"))["max_position_embeddings"]
            except (OSError, ValueError, KeyError) as e:
                raise ConfigError(f"{config}: cannot read max_position_embeddings ({e}); "
                                  "pass --model-max-length") from None
        write_byte_tokenizer(args.checkpoint, n)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote tokenizer.json, tokenizer_config.json, special_tokens_map.json into {args.checkpoint} "
          f"(byte-level, eos = pad = id 0, model_max_length {n})")
    return 0


if __name__ == "__main__":
    sys.exit(_main())
