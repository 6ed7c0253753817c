"""The byte-level Hugging Face tokenizer (moejax.data.write_byte_tokenizer) against transformers'
AutoTokenizer and the tokenizers package, which it did not write; and the offline lm-eval tasks
(moejax.evaluation.tasks): deterministic, their documents cut correctly from the source files, and
loaded by lm-eval's own TaskManager with the datasets library offline."""

import json
import os
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

from moejax.evaluation import tasks as et
from moejax.data import EOS_TOKEN, Tokenizer, _main as data_main, write_byte_tokenizer
from moejax.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
STDLIB = Path(sysconfig.get_paths()["stdlib"])
STDLIB_FILES = [STDLIB / "textwrap.py", STDLIB / "difflib.py"]

STRINGS = ["", "hello world", " leading space", "é", "→", "naïve → café 😀\n", "\tindented\ttabs\n",
           "line one\nline two\n", "windows\r\nline\r\n", "  def f(x):\n      return x  # ok\n",
           "<|endoftext|> [CLS] </s>", "日本語のテキスト"]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("bytetok")
    write_byte_tokenizer(d, 512)
    return d


@pytest.fixture(scope="module")
def auto_tokenizer(tok_dir):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(tok_dir))


# --- tokenizer ----------------------------------------------------------------------------------

def test_byte_tokenizer_ids_are_the_utf8_bytes(tok_dir, auto_tokenizer):
    from tokenizers import Tokenizer as HFTokenizer

    raw = HFTokenizer.from_file(str(tok_dir / "tokenizer.json"))
    ours = Tokenizer(tok_dir, 256)
    assert ours.name.startswith("tokenizer.json")
    for s in STRINGS:
        ids = list(s.encode("utf-8"))
        assert raw.encode(s).ids == ids, s
        assert raw.encode(s, add_special_tokens=False).ids == ids, s
        assert auto_tokenizer.encode(s) == ids, s                 # default add_special_tokens: no BOS/EOS
        assert auto_tokenizer(s)["input_ids"] == ids, s
        assert ours.encode(s) == ids, s
        assert auto_tokenizer.decode(ids) == s, s
        assert raw.decode(ids) == s, s


def test_the_eos_token_text_is_not_matched_in_text(tok_dir, auto_tokenizer):
    """The eos token's string is byte 0's ByteLevel character "Ā" (U+0100); the text "Ā" must still
    encode as its two UTF-8 bytes. transformers honours split_special_tokens from the config and
    moejax's Tokenizer sets encode_special_tokens; a bare tokenizers.Tokenizer.from_file does not
    (tokenizer.json cannot store the flag)."""
    s = "xĀy"
    ids = list(s.encode("utf-8"))
    assert EOS_TOKEN == "Ā"
    assert auto_tokenizer.encode(s) == ids
    assert Tokenizer(tok_dir, 256).encode(s) == ids
    assert auto_tokenizer.decode(ids) == s


def test_byte_tokenizer_special_tokens(tok_dir, auto_tokenizer):
    t = auto_tokenizer
    assert t.eos_token_id == 0 and t.pad_token_id == 0
    assert t.bos_token_id is None and t.bos_token is None
    assert len(t) == 256 and t.all_special_ids == [0]
    assert t.model_max_length == 512
    assert t.decode([104, 105, 0, 0], skip_special_tokens=True) == "hi"
    assert t.decode([0]) == "\x00"                                   # id 0 is byte 0
    batch = t(["ab", "abcd"], padding=True)
    assert batch["input_ids"][0] == [97, 98, 0, 0] and batch["attention_mask"][0] == [1, 1, 0, 0]
    config = json.loads((tok_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert config["add_bos_token"] is False and config["add_eos_token"] is False


def test_write_tokenizer_command(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 96}))
    assert data_main(["write-tokenizer", str(tmp_path)]) == 0
    assert "wrote tokenizer.json" in capsys.readouterr().out
    config = json.loads((tmp_path / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert config["model_max_length"] == 96
    assert Tokenizer(tmp_path, 256).encode("é\n") == [195, 169, 10]
    assert data_main(["write-tokenizer", str(tmp_path / "missing"), "--model-max-length", "8"]) == 2
    assert "no such folder" in capsys.readouterr().err


def test_train_tiny_config_has_byte_token_ids():
    from moejax.training.config import ArchConfig

    d = ArchConfig().hf_dict()
    assert (d["eos_token_id"], d["pad_token_id"], d["bos_token_id"]) == (0, 0, None)
    transformers = pytest.importorskip("transformers")
    cfg = transformers.DeepseekV3Config(**d)
    assert (cfg.eos_token_id, cfg.pad_token_id, cfg.bos_token_id) == (0, 0, None)


# --- tasks --------------------------------------------------------------------------------------

SMALL = dict(n_nextline=30, n_mc=25, n_ppl=5)


def source_lines(path):
    text = Path(path).read_text(encoding="utf-8", errors="replace")
    parts = text.split("\n")
    return [p + "\n" for p in parts[:-1]] + ([parts[-1]] if parts[-1] else [])


def read_docs(folder, task):
    return [json.loads(l) for l in (Path(folder) / f"{task}.jsonl").read_text(encoding="utf-8").splitlines()]


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    return et.write_stdlib_tasks(tmp_path_factory.mktemp("tasks") / "out", STDLIB_FILES, **SMALL)


def test_tasks_are_deterministic(tasks, tmp_path):
    again = et.write_stdlib_tasks(tasks, STDLIB_FILES, **SMALL)           # same folder, replaced
    assert again == tasks
    elsewhere = et.write_stdlib_tasks(tmp_path / "b", STDLIB_FILES, **SMALL)
    names = sorted(p.name for p in tasks.iterdir())
    assert names == sorted(p.name for p in elsewhere.iterdir()) == sorted(
        f"{t}.{ext}" for t in et.TASKS for ext in ("yaml", "jsonl"))
    for name in names:
        a, b = (tasks / name).read_text(encoding="utf-8"), (elsewhere / name).read_text(encoding="utf-8")
        assert a == b.replace(str(elsewhere), str(tasks)), name         # only the JSON's path differs
    other_seed = et.write_stdlib_tasks(tmp_path / "c", STDLIB_FILES, seed=1, **SMALL)
    assert read_docs(other_seed, "stdlib_mc") != read_docs(tasks, "stdlib_mc")
    assert not list(tmp_path.glob(".*tmp*"))                              # no staging folder left


def test_nextline_docs_are_cut_from_the_source(tasks):
    docs = read_docs(tasks, "stdlib_nextline")
    assert len(docs) == SMALL["n_nextline"]
    for d in docs:
        lines = source_lines(d["file"])
        i = d["line"] - 1
        assert lines[i] == d["prefix"] + d["target"] + "\n" and d["prefix"] == et.line_prefix(lines[i])
        assert d["context"].endswith("\n" + d["prefix"]) and d["prefix"].strip() and d["target"].strip()
        whole = d["context"][:-len(d["prefix"])]
        ctx_lines = whole.splitlines(keepends=True)
        assert len(ctx_lines) >= et.MIN_CONTEXT_LINES
        assert "".join(lines[i - len(ctx_lines): i]) == whole, ctx_lines
        assert len(whole.encode("utf-8")) <= et.DEFAULT_MAX_CONTEXT_BYTES
        assert len(d["context"].encode("utf-8")) + et.MAX_GEN_TOKS < 512
        t = d["target"]
        assert t.strip() and not t.strip().startswith("#") and len(t.encode("utf-8")) <= et.MAX_TARGET_BYTES
    assert len({(d["file"], d["line"]) for d in docs}) == len(docs)


def test_mc_answer_is_the_line_after_the_context(tasks):
    docs = read_docs(tasks, "stdlib_mc")
    assert len(docs) == SMALL["n_mc"]
    answers = []
    for d in docs:
        lines = source_lines(d["file"])
        i = d["line"] - 1
        assert d["choices"][d["answer"]] == lines[i]                      # the whole line: indentation and "\n"
        n_ctx = len(d["context"].split("\n")) - 1
        assert n_ctx >= et.MIN_CONTEXT_LINES and "".join(lines[i - n_ctx: i]) == d["context"]
        assert len(d["choices"]) == 4 == len(set(d["choices"]))
        file_lines = set(lines)
        assert all(c in file_lines and c.strip() and c.endswith("\n") for c in d["choices"])
        assert len(d["context"].encode("utf-8")) + max(len(c.encode("utf-8")) for c in d["choices"]) < 512
        answers.append(d["answer"])
    assert len(set(answers)) > 1                                          # shuffled, not always first


def test_ppl_docs_are_pieces_of_the_files(tasks):
    docs = read_docs(tasks, "stdlib_ppl")
    assert len(docs) == SMALL["n_ppl"]
    for d in docs:
        lines = source_lines(d["file"])
        assert "".join(lines[d["line"] - 1:]).startswith(d["text"])
        assert 0 < len(d["text"].encode("utf-8")) <= et.PPL_CHUNK_BYTES


def test_targets_skip_comments_docstrings_and_list_literals(tmp_path):
    body = ['"""Module docstring.', "", "Second paragraph of prose.", '"""', "import os", "",
            "def f(x):", '    """Docstring', "    inside_docstring = 1", '    """', "    # a comment",
            "    y = [x]", "[1, 2]", "    return 'é→'", "x = 'Ā'"]
    body += [f"v{i} = {i}" for i in range(40)]
    src = tmp_path / "mod.py"
    src.write_text("\n".join(body) + "\n", encoding="utf-8")
    out = et.write_stdlib_tasks(tmp_path / "t", [src], n_nextline=1000, n_mc=1000, n_ppl=3, max_positions=1024)
    targets = {d["prefix"] + d["target"] for d in read_docs(out, "stdlib_nextline")}
    assert {"    y = [x]", "    return 'é→'", "x = 'Ā'", "v39 = 39"} <= targets
    assert not targets & {"Second paragraph of prose.", "    inside_docstring = 1", "    # a comment", "[1, 2]",
                          '"""', '    """', '"""Module docstring.'}
    assert len(read_docs(out, "stdlib_ppl")) == 1                         # the whole (small) file: < 1023 bytes
    assert read_docs(out, "stdlib_ppl")[0]["text"] == src.read_text(encoding="utf-8")


def test_files_from_the_checkpoint_record(tmp_path):
    root, ckpt = tmp_path / "lib", tmp_path / "ckpt"
    (root / "pkg").mkdir(parents=True)
    ckpt.mkdir()
    code = textwrap.dedent("""\
        import sys


        def main(argv):
            total = 0
            for arg in argv:
                total += int(arg)
            return total


        if __name__ == "__main__":
            print(main(sys.argv[1:]))
        """)
    (root / "pkg" / "a.py").write_text(code)
    with pytest.raises(ConfigError, match=r"moejax_tiny\.json: no such file"):
        et.write_stdlib_tasks(tmp_path / "t", checkpoint=ckpt)
    (ckpt / "moejax_tiny.json").write_text(json.dumps({"stdlib_root": str(root), "train": [],
                                                       "heldout": ["pkg/a.py"]}))
    out = et.write_stdlib_tasks(tmp_path / "t", checkpoint=ckpt, n_nextline=3, n_mc=2, n_ppl=1)
    docs = read_docs(out, "stdlib_nextline")
    assert len(docs) == 3 and {d["file"] for d in docs} == {"pkg/a.py"}
    (ckpt / "config.json").write_text(json.dumps({"max_position_embeddings": 128}))
    with pytest.raises(ConfigError, match=r"max_positions=128 \(.*config\.json: max_position_embeddings\)"):
        et.write_stdlib_tasks(tmp_path / "t", checkpoint=ckpt, max_context_bytes=300)
    with pytest.raises(ConfigError, match="pass files or a checkpoint"):
        et.write_stdlib_tasks(tmp_path / "t")


def test_command_line(tmp_path, capsys):
    out = tmp_path / "cli"
    assert et._main(["--files", *map(str, STDLIB_FILES[:1]), "--out", str(out), "--n-nextline", "5",
                     "--n-mc", "4", "--n-ppl", "2"]) == 0
    printed = capsys.readouterr().out
    assert all(t in printed for t in et.TASKS) and str(out) in printed
    assert len(read_docs(out, "stdlib_mc")) == 4
    assert et._main(["--model", str(tmp_path / "nowhere"), "--out", str(tmp_path / "x")]) == 2
    assert "moejax_tiny.json" in capsys.readouterr().err


LM_EVAL_LOAD = """
import json, sys
from lm_eval.tasks import TaskManager, get_task_dict
tm = TaskManager(include_path=sys.argv[1], include_defaults=False)
d = get_task_dict(sys.argv[2].split(","), tm)
out = {}
for name, task in d.items():
    docs = list(task.test_docs())
    task.build_all_requests(limit=2, rank=0, world_size=1)
    doc = docs[0]
    out[name] = {"n": len(docs), "type": task.OUTPUT_TYPE, "text": task.doc_to_text(doc),
                 "target": task.doc_to_target(doc), "metrics": sorted(task._metric_fn_list),
                 "args": [list(i.args) if isinstance(i.args[-1], str) else [i.args[0]] for i in task.instances],
                 "choices": task.doc_to_choice(doc) if name == "stdlib_mc" else None}
print("RESULT" + json.dumps(out))
"""


def test_lm_eval_builds_the_tasks_offline(tasks, tmp_path):
    pytest.importorskip("lm_eval")
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"),
           "HF_DATASETS_CACHE": str(tmp_path / "hf" / "datasets")}
    r = subprocess.run([sys.executable, "-c", LM_EVAL_LOAD, str(tasks), ",".join(et.TASKS)], env=env,
                       capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.split("RESULT", 1)[1])
    assert {t: got[t]["n"] for t in et.TASKS} == {"stdlib_nextline": SMALL["n_nextline"], "stdlib_mc": SMALL["n_mc"],
                                                  "stdlib_ppl": SMALL["n_ppl"]}
    assert {t: got[t]["type"] for t in et.TASKS} == {"stdlib_nextline": "generate_until",
                                                     "stdlib_mc": "multiple_choice",
                                                     "stdlib_ppl": "loglikelihood_rolling"}
    assert got["stdlib_nextline"]["metrics"] == ["chrf", "exact_match"]
    assert got["stdlib_mc"]["metrics"] == ["acc", "acc_norm"]
    assert got["stdlib_ppl"]["metrics"] == ["bits_per_byte", "byte_perplexity", "word_perplexity"]

    nl, mc, ppl = (read_docs(tasks, t)[0] for t in et.TASKS)
    assert got["stdlib_nextline"]["text"] == nl["context"] and got["stdlib_nextline"]["target"] == nl["target"]
    assert got["stdlib_mc"]["text"] == mc["context"] and got["stdlib_mc"]["target"] == mc["answer"]
    assert got["stdlib_mc"]["choices"] == mc["choices"]
    # lm-eval's requests: context + "" + choice, exactly the source text
    assert [a[0] + a[1] for a in got["stdlib_mc"]["args"][:4]] == [mc["context"] + c for c in mc["choices"]]
    assert got["stdlib_nextline"]["args"][0] == [nl["context"]]          # generation starts right after the prefix
    assert got["stdlib_ppl"]["target"] == ppl["text"]


def test_documents_fit_the_length_the_model_was_trained_at(tmp_path):
    """A train_tiny model trained on 128-byte windows: contexts + answer line and ppl pieces stay
    within 128 positions, although config.json says 512."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({"max_position_embeddings": 512}))
    (ckpt / "moejax_tiny.json").write_text(json.dumps({
        "stdlib_root": str(STDLIB), "train": [], "heldout": ["textwrap.py", "difflib.py"],
        "config": {"data": {"seq_len": 128}}}))
    assert et.position_budget(ckpt)[0] == 128
    out = et.write_stdlib_tasks(tmp_path / "t", checkpoint=ckpt, n_nextline=50, n_mc=50)
    for d in read_docs(out, "stdlib_nextline"):
        assert len(d["context"].encode("utf-8")) + len(d["target"].encode("utf-8")) + 1 <= 128
    for d in read_docs(out, "stdlib_mc"):
        assert len(d["context"].encode("utf-8")) + max(len(c.encode("utf-8")) for c in d["choices"]) <= 128
    ppl = read_docs(out, "stdlib_ppl")
    assert all(len(d["text"].encode("utf-8")) <= 127 for d in ppl)
    assert len(ppl) == -(-et.PPL_TOTAL_BYTES // 127)                     # n_ppl=None: ~64 KB of text
    lines = source_lines(STDLIB / ppl[0]["file"])
    assert "".join(lines[ppl[0]["line"] - 1:]).startswith(ppl[0]["text"])
