"""Offline lm-eval tasks on the skills corpus (moejax.training.skills), for judging what pruning
and merging do to abilities rather than to perplexity:

    python -m moejax.evaluation.skills_tasks --model CKPT --out DIR
    lm_eval --model hf --model_args pretrained=CKPT --include_path DIR --tasks skills_add,skills_add_mc

Per skill NAME (held-out documents only: their prompts never occur in training):

- skills_NAME (generate_until): {"prompt", "answer"}; greedy generation until the terminator
  "\\n", at most the skill's longest answer + 1 bytes; exact_match. Because the budget leaves room
  for one byte past any answer, a completion matches only when the model also *stopped* (emitted
  the terminator) right after the answer.
- skills_NAME_mc (multiple_choice): the true answer among four, each followed by the terminator;
  the three wrong ones plausible (`distractors`: one character changed to another of the answer's
  kind, two neighbours swapped, and for kv another value from the same line); acc. Chance 0.25.
- skills_NAME_ll (loglikelihood): the answer and terminator given the prompt; logprob (its
  log-likelihood in nats, mean over documents, with the standard error of a mean; no bootstrap)
  and acc (the answer is the greedy one).

And skills_degen (generate_until, no stop but the EOS token): open prompts, a third each of
held-out code (the start of a held-out file's line, with the lines before it), prose (the
standard library's LICENSE.txt) and skills prompts, each generated to DEGEN_BYTES bytes in all.
Metrics (`degeneration_metrics`, per run, averaged): loop, terminated, distinct_2, distinct_4.

Everything is a pure function of (n, seed, the held-out files): two builds are byte-identical.
"""

from __future__ import annotations

import argparse
import json
import random
import string
import sys
from pathlib import Path

import yaml

from moejax.data import python_stdlib_root, read_text
from moejax.errors import ConfigError, MoejaxError
from moejax.evaluation.tasks import _dumper as stdlib_dumper, heldout_files
from moejax.hf.io.staging import check_apart, staged_directory
from moejax.training.skills import SKILLS, TERMINATOR, documents

DEGEN_TASK = "skills_degen"
DEGEN_BYTES = 256          # prompt + generation, the skills model's trained context
DEGEN_PROMPT_BYTES = 64
LOOP_MIN_SHARE = 0.5       # a periodic tail covering more than this share of the output is a loop
N_CHOICES = 4


def skill_of(task: str) -> str | None:
    """The skill a skills task is about (skills_kv_mc -> kv), None for skills_degen and others."""
    parts = task.split("_")
    return parts[1] if task != DEGEN_TASK and parts[0] == "skills" and len(parts) > 1 and parts[1] in SKILLS \
        else None


def task_names(skills=None) -> list[str]:
    """Every task this module writes, for the named skills (default all)."""
    skills = list(SKILLS) if skills is None else list(skills)
    return [f"skills_{s}{suffix}" for s in skills for suffix in ("", "_mc", "_ll")] + [DEGEN_TASK]


# --- degeneration ------------------------------------------------------------------------------

def loop_span(text: str) -> int:
    """Length of the longest tail of `text` that repeats with some period p, each character equal
    to the one p before it, spanning at least two periods (a generation stuck in a loop repeats
    to its end)."""
    n, best = len(text), 0
    for p in range(1, n // 2 + 1):
        i = n - 1
        while i - p >= 0 and text[i] == text[i - p]:
            i -= 1
        span = n - 1 - i + p          # the tail text[i+1-p:] is p-periodic
        if span >= 2 * p:
            best = max(best, span)
    return best


def distinct_n(text: str, n: int) -> float:
    """Distinct character n-grams over all n-grams of the text (1.0 for text shorter than n + 1)."""
    grams = [text[i:i + n] for i in range(len(text) - n + 1)]
    return len(set(grams)) / len(grams) if len(grams) > 1 else 1.0


def degeneration_metrics(output: str) -> dict:
    """The metrics of one generation (its continuation only):
    - loop: 1 when a periodic tail (`loop_span`) covers more than LOOP_MIN_SHARE of the output;
    - terminated: 1 when the output emits the terminator "\\n" (ends its first line: for a skills
      prompt, the end of the answer; a model stuck in a loop inside a line never does);
    - distinct_2, distinct_4: distinct character 2- and 4-grams over all of them."""
    return {"loop": float(len(output) > 0 and loop_span(output) > LOOP_MIN_SHARE * len(output)),
            "terminated": float(TERMINATOR in output),
            "distinct_2": distinct_n(output, 2), "distinct_4": distinct_n(output, 4)}


def process_degeneration(doc, results) -> dict:
    """lm-eval's process_results for skills_degen (results: the one generated string)."""
    return degeneration_metrics(results[0])


def process_loglikelihood(doc, results) -> dict:
    """lm-eval's process_results for skills_NAME_ll (results: one (log-likelihood, is_greedy))."""
    ll, greedy = results[0]
    return {"logprob": float(ll), "acc": float(greedy)}


# --- multiple-choice distractors ----------------------------------------------------------------

def _kind(c: str) -> str:
    for chars in (string.digits, string.ascii_lowercase, string.ascii_uppercase, ")]}>"):
        if c in chars:
            return chars
    return c


def distractors(skill: str, prompt: str, answer: str, rng: random.Random, n: int = N_CHOICES - 1) -> list[str]:
    """n distinct wrong answers close to the true one: the first a likely confusion (for kv the
    value of another key of the same line, else two different neighbours swapped), the rest drawn
    from every answer with one character changed to another of its kind (digit, lower- or
    upper-case letter, closer) and every such swap."""
    changed = {answer[:i] + o + answer[i + 1:] for i, c in enumerate(answer) for o in _kind(c) if o != c}
    swapped = {answer[:i] + answer[i + 1] + answer[i] + answer[i + 2:] for i in range(len(answer) - 1)
               if answer[i] != answer[i + 1]}
    likely = swapped
    if skill == "kv":
        likely = {pair.split("=", 1)[1] for pair in prompt[len("kv "):prompt.rindex(" ?")].split(" ")}
    likely, pool = sorted(likely - {answer}), sorted((changed | swapped) - {answer})
    picked = [rng.choice(likely)] if likely else []
    picked += rng.sample([c for c in pool if c not in picked], n - len(picked))
    return picked


# --- documents ----------------------------------------------------------------------------------

def _docs(skill: str, n: int, seed: int, rng: random.Random, mc: bool) -> list[dict]:
    out = []
    for prompt, answer in documents(skill, n, seed, "heldout"):
        doc = {"prompt": prompt, "answer": answer}
        if mc:
            choices = [answer] + distractors(skill, prompt, answer, rng)
            rng.shuffle(choices)
            doc = {"prompt": prompt, "choices": [c + TERMINATOR for c in choices], "answer": choices.index(answer)}
        out.append(doc)
    return out


def _degen_docs(n: int, seed: int, code_files, prose_file) -> list[dict]:
    """n open prompts: code, prose and skills in turn (each at most DEGEN_PROMPT_BYTES bytes)."""
    rng = random.Random(f"{seed}:{DEGEN_TASK}")
    code = []
    for path in code_files:
        text = read_text(path)
        starts = [i + 1 for i, c in enumerate(text) if c == "\n" and text[i + 1:i + 5] in ("def ", "clas", "    ")]
        code += [text[max(0, s - DEGEN_PROMPT_BYTES + 16):s + 16] for s in starts if s > 0]
    prose = []
    if prose_file is not None and Path(prose_file).is_file():
        words = read_text(prose_file).split()
        prose = [" ".join(words[i:i + 10])[:DEGEN_PROMPT_BYTES] for i in range(0, len(words) - 10, 7)]
    skills = [p for s in SKILLS for p, _ in documents(s, n, seed + 1, "heldout")]
    pools = [("code", code), ("prose", prose), ("skills", skills)]
    pools = [(k, sorted(set(p))) for k, p in pools if p]
    docs = []
    for i in range(n):
        kind, pool = pools[i % len(pools)]
        prompt = pool[rng.randrange(len(pool))]
        prompt = prompt.encode("utf-8")[:DEGEN_PROMPT_BYTES].decode("utf-8", errors="ignore")
        docs.append({"prompt": prompt, "kind": kind})
    return docs


METRICS_MODULE = "skills_metrics"   # the shim written beside the YAML files, for lm-eval's !function


class _Function(str):
    """A process_results hook, dumped as lm-eval's `!function skills_metrics.NAME` tag."""


def _dumper():
    dumper = stdlib_dumper()
    dumper.add_representer(_Function, lambda d, f: d.represent_scalar("!function", f"{METRICS_MODULE}.{f}"))
    return dumper


def _config(task: str, data_file: Path, skill: str | None) -> dict:
    head = {"task": task, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(data_file)}},
            "test_split": "test", "doc_to_text": "{{prompt}}", "target_delimiter": ""}
    mean = {"aggregation": "mean", "higher_is_better": True}
    if skill is None:
        body = {"output_type": "generate_until", "doc_to_target": "",
                "generation_kwargs": {"until": [], "max_gen_toks": DEGEN_BYTES - DEGEN_PROMPT_BYTES,
                                      "do_sample": False},
                "process_results": _Function("process_degeneration"),
                "metric_list": [{"metric": "loop", "aggregation": "mean", "higher_is_better": False},
                                {"metric": "terminated", **mean}, {"metric": "distinct_2", **mean},
                                {"metric": "distinct_4", **mean}]}
    elif task.endswith("_mc"):
        body = {"output_type": "multiple_choice", "doc_to_choice": "{{choices}}", "doc_to_target": "{{answer}}",
                "metric_list": [{"metric": "acc", **mean}]}
    elif task.endswith("_ll"):
        body = {"output_type": "loglikelihood", "doc_to_target": "{{answer}}" + TERMINATOR,
                "process_results": _Function("process_loglikelihood"),
                "metric_list": [{"metric": "logprob", **mean}, {"metric": "acc", **mean}]}
    else:
        body = {"output_type": "generate_until", "doc_to_target": "{{answer}}",
                "generation_kwargs": {"until": [TERMINATOR], "max_gen_toks": SKILLS[skill].answer_max + 1,
                                      "do_sample": False},
                "metric_list": [{"metric": "exact_match", **mean}]}
    return {**head, **body, "metadata": {"version": 1.0}}


def write_skills_tasks(out_dir, *, skills=None, n: int = 100, n_mc: int = 50, n_ll: int = 50, n_degen: int = 48,
                       code_files=(), prose_file=None, seed: int = 0) -> Path:
    """Write every task of `task_names(skills)` (YAML + JSON lines, and the degeneration task's
    process_results shim) into out_dir (replaced, atomically) and return its path."""
    check_apart(out_dir, [*code_files, prose_file], "the tasks folder (--out, replaced)")
    skills = list(SKILLS) if skills is None else list(skills)
    unknown = [s for s in skills if s not in SKILLS]
    if unknown:
        raise ConfigError(f"skills tasks: unknown skill(s) {unknown}; the skills are {list(SKILLS)}")
    for key, v in (("n", n), ("n_mc", n_mc), ("n_ll", n_ll), ("n_degen", n_degen), ("seed", seed)):
        if isinstance(v, bool) or not isinstance(v, int) or v < (0 if key == "seed" else 1):
            raise ConfigError(f"skills tasks: {key}={v!r}; expected an integer >= {0 if key == 'seed' else 1}")
    docs = {}
    for s in skills:
        rng = random.Random(f"{seed}:skills_{s}_mc")
        docs[f"skills_{s}"] = (_docs(s, n, seed, rng, False), s)
        docs[f"skills_{s}_mc"] = (_docs(s, n_mc, seed, rng, True), s)
        docs[f"skills_{s}_ll"] = (_docs(s, n_ll, seed, rng, False), s)
    docs[DEGEN_TASK] = (_degen_docs(n_degen, seed, code_files, prose_file), None)

    out_dir = Path(out_dir).expanduser().absolute()
    dumper = _dumper()
    with staged_directory(out_dir, overwrite=True) as staging:
        for task, (ds, skill) in docs.items():
            data = "".join(json.dumps(d, ensure_ascii=False, sort_keys=True) + "\n" for d in ds)
            (staging / f"{task}.jsonl").write_text(data, encoding="utf-8")
            text = yaml.dump(_config(task, out_dir / f"{task}.jsonl", skill), Dumper=dumper, sort_keys=False,
                             allow_unicode=True, width=1000)
            (staging / f"{task}.yaml").write_text(text, encoding="utf-8")
        (staging / f"{METRICS_MODULE}.py").write_text(
            "from moejax.evaluation.skills_tasks import process_degeneration, process_loglikelihood  # noqa: F401  (lm-eval's !function)\n",
            encoding="utf-8")
    return out_dir


def default_sources(checkpoint) -> tuple[list[Path], Path | None]:
    """(held-out code files, prose file) for skills_degen: the files train_tiny held out (its
    moejax_tiny.json) and the standard library's LICENSE.txt."""
    code = [p for _, p in heldout_files(checkpoint)] if checkpoint is not None else []
    return code, python_stdlib_root() / "LICENSE.txt"


def _main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moejax.evaluation.skills_tasks",
                                     description="write the offline skills tasks (lm-eval YAML + JSON lines)")
    parser.add_argument("--model", type=Path, help="a train_tiny checkpoint (its held-out code for skills_degen)")
    parser.add_argument("--out", type=Path, required=True, help="folder to write (replaced)")
    parser.add_argument("--skills", nargs="+", default=None, help=f"default: all of {list(SKILLS)}")
    parser.add_argument("--n", type=int, default=100)
    parser.add_argument("--n-mc", type=int, default=50)
    parser.add_argument("--n-ll", type=int, default=50)
    parser.add_argument("--n-degen", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        check_apart(args.out, args.model, "the tasks folder (--out, replaced)")
        code, prose = default_sources(args.model)
        out = write_skills_tasks(args.out, skills=args.skills, n=args.n, n_mc=args.n_mc, n_ll=args.n_ll,
                                 n_degen=args.n_degen, code_files=code, prose_file=prose, seed=args.seed)
    except MoejaxError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    names = task_names(args.skills)
    print(f"tasks in {out}: lm_eval --include_path {out} --tasks {','.join(names)}")
    return 0


if __name__ == "__main__":
    sys.exit(_main())
