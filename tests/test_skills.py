"""The skills corpus and its tasks: generators checked against Python's own arithmetic for
thousands of documents, held-out documents never in training, the mix's shares and refusals,
the task YAML scored by lm-eval on hand-written answers, the degeneration metrics on hand-made
outputs, and a short end to end run (train a few dozen steps, evaluate one skill task on two
variants) whose model transformers loads and lm-eval's own hf backend scores the same."""

import json
import os
import random
import re
from pathlib import Path

import numpy as np
import pytest

from moejax.errors import ConfigError
from moejax.evaluation.skills_tasks import (degeneration_metrics, distinct_n, distractors, loop_span, task_names,
                                 write_skills_tasks)
from moejax.training import skills as sk

N_DOCS = 3000


def answer_of(skill: str, prompt: str) -> str:
    """Each skill's answer, computed here from the prompt alone."""
    body = prompt[len(skill) + 1:-1]
    if skill == "add":
        a, b = body.split("+")
        return str(int(a) + int(b))
    if skill == "sort":
        return "".join(sorted(body))
    if skill == "rev":
        return body[::-1]
    if skill == "up":
        return body.upper()
    if skill == "kv":
        pairs, asked = prompt[len("kv "):-1].split(" ?")
        return dict(p.split("=") for p in pairs.split(" "))[asked]
    if skill == "close":
        pairs = {"(": ")", "[": "]", "{": "}", "<": ">"}
        stack = []
        for c in body:
            if c in pairs:
                stack.append(c)
            else:
                assert pairs[stack.pop()] == c   # a closer closes the innermost opener
        assert stack
        return "".join(pairs[c] for c in reversed(stack))
    raise AssertionError(skill)


@pytest.mark.parametrize("skill", list(sk.SKILLS))
def test_generators_answer_as_python_does_and_are_deterministic(skill):
    docs = sk.documents(skill, N_DOCS, seed=3)
    assert docs == sk.documents(skill, N_DOCS, seed=3)
    assert docs != sk.documents(skill, N_DOCS, seed=4)
    for prompt, answer in docs:
        assert prompt.startswith(skill + " ") and prompt.endswith("=")
        assert answer == answer_of(skill, prompt), prompt
        assert sk.TERMINATOR not in prompt + answer
        assert len(sk.text(prompt, answer).encode()) <= sk.SKILLS[skill].longest
        assert len(answer.encode()) <= sk.SKILLS[skill].answer_max
    assert max(len(a) for _, a in docs) == sk.SKILLS[skill].answer_max   # the bound is reached, not loose
    assert len({p for p, _ in docs}) > N_DOCS // 3   # varied, not a handful of prompts repeated


@pytest.mark.parametrize("skill", list(sk.SKILLS))
def test_no_heldout_document_occurs_in_training(skill):
    held = {p for p, _ in sk.documents(skill, 500, seed=0, split="heldout")}
    assert len(held) == 500 and all(sk.is_heldout(p) for p in held)
    stream, starts = sk.skill_stream({"code": 0.5, skill: 0.5}, 300_000, seed=0)
    lines = bytes(stream).decode().split(sk.TERMINATOR)[:-1]
    assert len(lines) == len(starts) > 1000
    trained = {line[:line.rindex("=") + 1] for line in lines}
    assert not trained & held


def test_stream_shares_follow_the_mix_and_rows_start_at_documents(tmp_path):
    mix = {"code": 0.4, "add": 0.3, "rev": 0.25, "up": 0.05}
    stream, starts = sk.skill_stream(mix, 400_000, seed=1)
    lines = bytes(stream).decode().split(sk.TERMINATOR)[:-1]
    size = {}
    for line in lines:
        size[line.split(" ")[0]] = size.get(line.split(" ")[0], 0) + len(line) + 1
    total = sum(size.values())
    for name in ("add", "rev", "up"):
        assert size[name] / total == pytest.approx(mix[name] / 0.6, abs=0.01)
    heads = {bytes(stream[s:s + 4]).decode() for s in starts}
    assert heads <= {"add ", "rev "} | {"up " + c for c in "abcdefghijklmnopqrstuvwxyz"}

    from moejax.training.config import TrainTinyConfig
    from moejax.training.corpus import build_corpus

    cfg = TrainTinyConfig.from_mapping(_settings(tmp_path / "m", mix=mix, skill_bytes=200_000))
    corpus = build_corpus(cfg)
    rows = np.concatenate([corpus.batch(0, s, 64, 48) for s in range(20)])
    assert np.array_equal(rows, np.concatenate([corpus.batch(0, s, 64, 48) for s in range(20)]))
    starts_skill = [re.match(rb"(add|rev|up) ", bytes(r[:4].astype(np.uint8))) is not None for r in rows]
    assert np.mean(starts_skill) == pytest.approx(0.6, abs=0.05)   # skill rows start at a document


SMALL_ARCH = dict(hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=3,
                  num_attention_heads=2, num_key_value_heads=2, q_lora_rank=16, kv_lora_rank=16,
                  qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, n_routed_experts=8, num_experts_per_tok=2,
                  n_group=4, topk_group=2, max_position_embeddings=64)


def _settings(path, mix=None, steps=24, seq_len=48, **data):
    return {"path": str(path), "seed": 0, "arch": dict(SMALL_ARCH),
            "data": {"seq_len": seq_len, "eval_tokens": 1024, "heldout_always": ["textwrap.py"],
                     "mix": mix if mix is not None else {"code": 0.5, "up": 0.3, "close": 0.2},
                     "skill_eval_docs": 8, **data},
            "train": {"steps": steps, "batch_size": 8, "lr": 1e-2, "warmup_steps": 3, "checkpoint_every": 100,
                      "eval_every": 12, "rng_impl": "rbg"}}


@pytest.mark.parametrize("mix, match", [
    ({"code": 0.5, "divide": 0.5}, r"unknown text \['divide'\]"),
    ({"code": 1.2, "up": -0.2}, r"data.mix.up=-0.2"),
    ({"code": 0.5, "up": 0.4}, r"sum to 0.9"),
    ({"code": 0.5, "kv": 0.5}, r"40 bytes, longer than data.seq_len=32"),
])
def test_bad_mixes_are_refused_before_training(tmp_path, mix, match):
    from moejax.training.config import TrainTinyConfig

    with pytest.raises(ConfigError, match=match):
        TrainTinyConfig.from_mapping(_settings(tmp_path / "m", mix=mix, seq_len=32))
    s = _settings(tmp_path / "m", mix={"code": 0.5, "up": 0.5}, stdlib=False)
    with pytest.raises(ConfigError, match="no code text"):
        TrainTinyConfig.from_mapping(s)


@pytest.mark.parametrize("spec, match", [("css", "not NAME=SHARE"), ("code=0.5,poetry=0.5", "unknown text"),
                                         ("code=0.7,kv=0.2", "sum to 0.9"), ("train", "records no training mix")])
def test_bad_calibration_mixes_are_refused(spec, match):
    with pytest.raises(ConfigError, match=match):
        sk.calibration_mix(spec, None)


def test_calibration_mixes():
    assert sk.calibration_mix("code") == {"code": 1.0}
    assert set(sk.calibration_mix("skills")) == set(sk.SKILLS)
    assert sum(sk.calibration_mix("uniform").values()) == pytest.approx(1.0)
    assert sk.calibration_mix("code=0.25,kv=0.75") == {"code": 0.25, "kv": 0.75}
    assert sk.calibration_mix("train", {"code": 0.5, "up": 0.5}) == {"code": 0.5, "up": 0.5}
    docs = sk.calibration_documents({"code": 0.5, "kv": 0.5, "up": 0.25}, 4000, seed=0)
    held = {p for s in ("kv", "up") for p, _ in sk.documents(s, 2000, 0, "heldout")}
    kv = "".join(d for d in docs if d.startswith("kv "))
    assert 1500 < len(kv) < 2500 and all(d.endswith(sk.TERMINATOR) for d in docs)
    assert not {d[:d.rindex("=") + 1] for d in docs} & held
    assert [d[:2] for d in docs] != sorted(d[:2] for d in docs)        # the skills shuffled together


# --- degeneration metrics ---------------------------------------------------------------------

def test_degeneration_metrics_on_hand_made_outputs():
    loop = "x = f(" + "ab, " * 40
    m = degeneration_metrics(loop)
    assert m["loop"] == 1.0 and m["terminated"] == 0.0 and m["distinct_4"] < 0.1
    prose = "The quick brown fox jumps over the lazy dog.\nThen it sleeps in the sun all day long."
    m = degeneration_metrics(prose)
    assert m["loop"] == 0.0 and m["terminated"] == 1.0 and m["distinct_2"] > 0.7
    stop = "42\n"                                          # an early, clean stop
    assert degeneration_metrics(stop) == {"loop": 0.0, "terminated": 1.0, "distinct_2": 1.0, "distinct_4": 1.0}
    half = "abcdefghijklmnopqrstuvwxyz" + "zq" * 12         # a periodic tail of 24 of 50: not more than half
    assert loop_span(half) == 24 and degeneration_metrics(half)["loop"] == 0.0
    assert degeneration_metrics(half + "zq")["loop"] == 0.0   # 26 of 52: exactly half is not a loop
    assert degeneration_metrics(half + "zqzq")["loop"] == 1.0
    assert loop_span("aaaa") == 4 and loop_span("abcd") == 0
    assert distinct_n("abab", 2) == pytest.approx(2 / 3)


@pytest.mark.parametrize("skill", list(sk.SKILLS))
def test_distractors_are_distinct_wrong_and_close(skill):
    rng = random.Random(0)
    for prompt, answer in sk.documents(skill, 300, 0, "heldout"):
        wrong = distractors(skill, prompt, answer, rng)
        assert len(wrong) == 3 == len(set(wrong)) and answer not in wrong
        for w in wrong:
            assert len(w) == len(answer) or skill == "kv"
            if skill != "kv":   # one character changed, or two neighbours swapped
                diff = [i for i, (a, b) in enumerate(zip(w, answer)) if a != b]
                assert len(diff) == 1 or (len(diff) == 2 and diff[1] == diff[0] + 1
                                          and w[diff[0]] == answer[diff[1]] and w[diff[1]] == answer[diff[0]])


# --- the routing table (moejax.evaluation.routing_table) ----------------------------------------

def test_experts_for_mass_is_the_fewest_experts_holding_the_mass():
    """Against exact fractions: the fewest experts (largest shares first) whose shares add up to at
    least `mass` of the total, on shares that reach 90% exactly at an expert (e.g. ten of 10%:
    nine experts, where float sums fall 1e-16 short), just below and just above it."""
    from fractions import Fraction

    from moejax.evaluation.routing_table import experts_for_mass

    def fewest(counts, mass):
        need, held = Fraction(str(mass)) * sum(counts), 0
        for n, c in enumerate(sorted(counts, reverse=True), 1):
            held += c
            if held >= need:
                return n

    cases = [([10] * 10, 0.9, 9), ([50, 40, 10], 0.9, 2), ([50, 39, 11], 0.9, 3), ([5, 15, 50, 30], 0.9, 3),
             ([0, 0, 7, 0], 0.9, 1), ([91, 3, 3, 3], 0.9, 1), ([89, 4, 4, 3], 0.9, 2), ([1, 1, 1, 1], 1.0, 4),
             ([3, 1, 2, 2], 0.5, 2)]
    rng = np.random.default_rng(0)
    for _ in range(300):
        counts = rng.integers(0, 12, size=int(rng.integers(1, 12)))
        counts[rng.integers(len(counts))] += 1                       # a non-empty layer
        cases.append((counts.tolist(), float(rng.choice([0.5, 0.9, 0.25, 1.0])), None))
    seen_exact = 0
    for counts, mass, want in cases:
        ref = fewest(counts, mass)
        assert want is None or ref == want, (counts, mass)
        shares = np.asarray(counts, np.float64) / sum(counts)
        assert experts_for_mass(shares, mass) == ref, (counts, mass)
        assert experts_for_mass(np.asarray(counts, np.float64), mass) == ref, (counts, mass)  # unnormalised
        seen_exact += Fraction(sum(sorted(counts, reverse=True)[:ref]), sum(counts)) == Fraction(str(mass))
    assert seen_exact > 20


class _BytesRouted:
    """A stand-in for the model routing_shares runs (its call and output: {MoE layer: Routing},
    tokens flattened batch-major): MoE layer 1 sends byte b to experts b % 8 and (b + 3) % 8, layer
    3 to b // 32 and (b // 32 + 1 + b % 7) % 8. It routes padding too, as the model does (byte 0)."""

    config = type("Config", (), {"n_experts": 8})()

    def __init__(self):
        self.calls = []

    @staticmethod
    def experts(layer, b):
        b = np.asarray(b)
        return np.stack([b % 8, (b + 3) % 8] if layer == 1 else [b // 32, (b // 32 + 1 + b % 7) % 8], -1)

    def __call__(self, ids_BS, mask_BS, return_routing=False, forward_only=False):
        import jax.numpy as jnp

        from moejax.moe.routing import Routing

        assert return_routing and forward_only
        self.calls.append((np.asarray(ids_BS), np.asarray(mask_BS)))
        flat = np.asarray(ids_BS).reshape(-1)
        routing = {l: Routing(jnp.asarray(self.experts(l, flat), jnp.int32), jnp.ones((len(flat), 2)), None)
                   for l in (3, 1)}                                    # not in layer order
        return type("Out", (), {"routing": routing})()


def test_routing_shares_count_each_texts_bytes_once_and_no_padding():
    """routing_shares against a count of each text's own UTF-8 bytes (numpy): rows of seq_len in
    batches, the last row padded with byte 0, which the model routes but the table must not count."""
    from moejax.evaluation.routing_table import routing_rows, routing_shares

    texts = {"kv": "kv a1=b2 ?a1=b2\n" * 3 + "é€", "code": "def f(x):\n    return x\n"[:20]}   # 53 and 20 bytes
    model = _BytesRouted()
    got = routing_shares(model, texts, seq_len=7, batch=3)
    assert list(got) == ["kv", "code"]
    for name, text in texts.items():
        b = np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int64)
        want = np.stack([np.bincount(model.experts(l, b).ravel(), minlength=8) for l in (1, 3)]) / (2 * len(b))
        np.testing.assert_allclose(got[name], want, rtol=0, atol=1e-15, err_msg=name)
    rows = [r for call in model.calls for r in call[1]]
    assert len(model.calls) == 3 + 1 and sum(map(np.sum, rows)) == 53 + 20   # kv: 8 rows in 3 batches; code: 3 rows
    table = routing_rows(got, [1, 3])
    need = {(r["task"], r["layer"]): r["value"] for r in table if r["metric"] == "experts_for_90"}
    assert len(table) == 2 * 2 * (8 + 1) and set(need) == {("kv", 1), ("kv", 3), ("code", 1), ("code", 3)}


# --- the tasks, scored by lm-eval ------------------------------------------------------------

HAND = [("add 2+2=", "4"), ("add 10+5=", "15"), ("add 99+1=", "100"), ("add 7+8=", "15")]


def generating_lm(generate):
    """An lm-eval model that only generates: generate_until is `generate(requests)`; a
    log-likelihood request fails the test."""
    from lm_eval.api.model import LM

    class Generates(LM):
        def loglikelihood(self, requests):
            raise AssertionError("a log-likelihood request")

        def loglikelihood_rolling(self, requests):
            raise AssertionError("a rolling log-likelihood request")

        def generate_until(self, requests):
            return generate(requests)

    return Generates()


class ScriptedLM:
    """An lm-eval model answering from a table: right for the first `n_right` documents."""

    def __new__(cls, right: set):
        from lm_eval.api.model import LM

        class _LM(LM):
            def loglikelihood(self, requests):
                out = []
                for r in requests:
                    context, continuation = r.args
                    truth = answer_of("add", context) + "\n"
                    good = continuation == truth
                    out.append((0.0 if good == (context in right) else -1.0, good))
                return out

            def loglikelihood_rolling(self, requests):
                return [0.0 for _ in requests]

            def generate_until(self, requests):
                return [answer_of("add", r.args[0]) if r.args[0] in right else "12" for r in requests]

        return _LM()


def test_task_yaml_scores_hand_written_documents_exactly(tmp_path):
    import lm_eval
    from lm_eval.tasks import TaskManager

    os.environ["HF_DATASETS_CACHE"] = str(tmp_path / "datasets")
    out = write_skills_tasks(tmp_path / "tasks", skills=["add"], n=4, n_mc=4, n_ll=4, n_degen=3, seed=0)
    rng = random.Random(1)
    gen = [{"prompt": p, "answer": a} for p, a in HAND]
    mc = []
    for p, a in HAND:
        choices = [a] + distractors("add", p, a, rng)
        mc.append({"prompt": p, "choices": [c + "\n" for c in choices], "answer": 0})
    for name, docs in (("skills_add", gen), ("skills_add_mc", mc), ("skills_add_ll", gen)):
        (out / f"{name}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    right = {HAND[0][0], HAND[2][0], HAND[3][0]}
    res = lm_eval.simple_evaluate(model=ScriptedLM(right), tasks=["skills_add", "skills_add_mc", "skills_add_ll"],
                                  task_manager=TaskManager(include_path=str(out), include_defaults=False),
                                  bootstrap_iters=10)["results"]   # means: closed-form standard errors
    assert res["skills_add"]["exact_match,none"] == 0.75
    assert res["skills_add_mc"]["acc,none"] == 0.75
    assert res["skills_add_ll"]["acc,none"] == 1.0                  # every answer is the greedy one here
    assert res["skills_add_ll"]["logprob,none"] == pytest.approx(-0.25)
    assert res["skills_add_ll"]["logprob_stderr,none"] == pytest.approx(0.25)   # std of (0,0,0,-1)/sqrt(4), ddof 1


def test_generation_budget_scores_an_answer_that_never_stops_as_wrong(tmp_path):
    """Each skill's generation task, scored by lm-eval, on two documents with the skill's longest
    answer (the longest of 3,000 draws, its answer_max): a model that writes the answer and goes on
    without the terminator is wrong, one that writes it and stops is right (exact_match 0.5). The
    stand-in writes bytes as greedy generation does under the request's max_gen_toks, then cuts at
    its `until`, as lm-eval's backends do; a budget of the answer's length alone would cut the
    runaway output to exactly the answer."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    os.environ["HF_DATASETS_CACHE"] = str(tmp_path / "datasets")
    skills = list(sk.SKILLS)
    out = write_skills_tasks(tmp_path / "tasks", skills=skills, n=2, n_mc=2, n_ll=2, n_degen=3)
    runaway, answers = set(), {}
    for skill in skills:
        docs = sk.documents(skill, N_DOCS, 5)
        longest = max(len(a) for _, a in docs)
        assert longest == sk.SKILLS[skill].answer_max, skill
        pair = [(p, a) for p, a in docs if len(a) == longest][:2]
        runaway.add(pair[0][0])
        answers.update(pair)
        (out / f"skills_{skill}.jsonl").write_text("".join(json.dumps({"prompt": p, "answer": a}) + "\n"
                                                          for p, a in pair))

    def writes(requests):
        outs = []
        for r in requests:
            context, kw = r.args
            answer = answers[context]
            text = (answer * 4 if context in runaway else answer + "\n" + answer)[:kw["max_gen_toks"]]
            for stop in kw["until"]:
                text = text.split(stop)[0]
            outs.append(text)
        return outs

    res = lm_eval.simple_evaluate(model=generating_lm(writes), tasks=[f"skills_{s}" for s in skills], bootstrap_iters=0,
                                  task_manager=TaskManager(include_path=str(out), include_defaults=False))["results"]
    assert {s: res[f"skills_{s}"]["exact_match,none"] for s in skills} == {s: 0.5 for s in skills}


def test_kv_multiple_choice_offers_another_value_of_the_same_line(tmp_path):
    """kv's first distractor is the value of another key defined in the same prompt (the likely
    confusion), whenever the line has a value other than the answer; and the written
    skills_kv_mc documents offer one among their choices."""
    def other_values(prompt, answer):
        return set(re.findall(r"[a-z]\d=([a-z]\d)", prompt.split("?")[0])) - {answer}

    rng = random.Random(0)
    checked = 0
    for prompt, answer in sk.documents("kv", 300, 0, "heldout"):
        others = other_values(prompt, answer)
        wrong = distractors("kv", prompt, answer, rng)
        if others:
            assert wrong[0] in others, (prompt, answer, wrong)
            checked += 1
    assert checked > 290
    out = write_skills_tasks(tmp_path / "tasks", skills=["kv"], n=2, n_mc=40, n_ll=2, n_degen=3)
    docs = [json.loads(line) for line in (out / "skills_kv_mc.jsonl").read_text().splitlines()]
    assert len(docs) == 40
    for d in docs:
        choices = [c[:-1] for c in d["choices"]]
        answer = choices[d["answer"]]
        assert answer == answer_of("kv", d["prompt"])
        assert set(choices) & other_values(d["prompt"], answer), d


def test_degeneration_task_runs_its_metrics_through_lm_eval(tmp_path):
    import lm_eval
    from lm_eval.tasks import TaskManager

    os.environ["HF_DATASETS_CACHE"] = str(tmp_path / "datasets")
    stdlib = Path(__import__("sysconfig").get_paths()["stdlib"])
    out = write_skills_tasks(tmp_path / "tasks", skills=["up"], n=2, n_mc=2, n_ll=2, n_degen=6,
                             code_files=[stdlib / "textwrap.py"], prose_file=stdlib / "LICENSE.txt")
    docs = [json.loads(l) for l in (out / "skills_degen.jsonl").read_text().splitlines()]
    assert [d["kind"] for d in docs] == ["code", "prose", "skills"] * 2 or \
        [d["kind"] for d in docs] == ["code", "skills"] * 3   # no LICENSE.txt in this Python
    assert all(len(d["prompt"].encode()) <= 64 for d in docs)

    def loops(requests):
        assert all(r.args[1]["max_gen_toks"] == 192 for r in requests)
        return ["ab" * 96 if i % 2 else "fine words\nmore" for i, _ in enumerate(requests)]

    res = lm_eval.simple_evaluate(model=generating_lm(loops), tasks=["skills_degen"], bootstrap_iters=0,
                                  task_manager=TaskManager(include_path=str(out), include_defaults=False))
    r = res["results"]["skills_degen"]
    assert r["loop,none"] == 0.5 and r["terminated,none"] == 0.5


def test_task_builds_are_byte_identical_and_named(tmp_path):
    a = write_skills_tasks(tmp_path / "a", n=5, n_mc=5, n_ll=5, n_degen=3)
    b = write_skills_tasks(tmp_path / "b", n=5, n_mc=5, n_ll=5, n_degen=3)
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    assert {n[:-5] for n in names if n.endswith(".yaml")} == set(task_names())
    for n in names:
        assert (a / n).read_text().replace(str(a), "") == (b / n).read_text().replace(str(b), "")
    with pytest.raises(ConfigError, match="unknown skill"):
        write_skills_tasks(tmp_path / "c", skills=["divide"])


# --- end to end: a short training run, then eval_tasks on one skill task -------------------------

@pytest.fixture(scope="module")
def skills_model(tmp_path_factory):
    from moejax.experiments import train_tiny as tt

    root = tmp_path_factory.mktemp("skills")
    cfg = tt.Config.from_mapping(_settings(root / "model", skill_bytes=100_000))
    df, _ = tt.run(cfg)
    return root / "model", df


def test_training_records_a_per_skill_learning_curve(skills_model):
    path, df = skills_model
    curve = df[df.metric == "skill_exact_match"]
    assert set(curve.skill) == {"up", "close"} and sorted(set(curve.step)) == [12, 24]
    assert curve.value.between(0, 1).all()
    record = json.loads((path / "moejax_tiny.json").read_text())
    assert set(record["skills_exact_match"]) == {"up", "close"}
    assert dict(record["config"]["data"]["mix"]) == {"code": 0.5, "up": 0.3, "close": 0.2}


@pytest.fixture(scope="module")
def eval_run(skills_model, tmp_path_factory):
    from moejax.experiments.runner import run_job

    path, _ = skills_model
    tmp_path = tmp_path_factory.mktemp("eval_skills")
    os.environ["HF_DATASETS_CACHE"] = str(tmp_path / "datasets")
    cfg = {"name": "eval_tasks", "model": {"path": str(path)}, "keep": [4], "scores": ["frequency", "reap"],
           "tasks": ["skills_up", "skills_up_mc"], "calibration": "code=0.5,up=0.5",
           "lm_eval": {"n_skill": 6, "n_skill_mc": 4, "eval_batch_size": 8, "bootstrap_iters": 0, "routing_docs": 10},
           "data": {"seq_len": 48, "calib_tokens": 480, "heldout_tokens": 96, "batch_size": 4}}
    run_job(cfg, tmp_path / "job")
    return tmp_path / "job"


def test_eval_tasks_on_the_skills_model_end_to_end(eval_run):
    import pandas as pd

    df = pd.read_parquet(eval_run / "results.parquet")
    tasks = df[df.task.isin(["skills_up", "skills_up_mc"])]
    variants = tasks.groupby(["method", "form", "keep"], dropna=False).task.nunique()
    assert len(variants) == 3 and (variants == 2).all()        # unpruned + 2 scores at one keep
    assert set(tasks.metric) == {"exact_match", "acc"}
    share = df[df.metric == "routing_share"]
    assert set(share.task) == {"up", "code"}
    sums = share.groupby(["task", "layer"]).value.sum()
    assert np.allclose(sums, 1.0) and len(sums) == 2 * 2          # two MoE layers
    need = df[df.metric == "experts_for_90"]
    assert need.value.between(1, 8).all()
    assert (eval_run / "tasks" / "skills" / "skills_up.yaml").is_file()


def test_notebook_code_runs_on_a_run(eval_run, tmp_path):
    import subprocess
    import sys

    import nbformat

    root = Path(__file__).resolve().parents[1]
    nb = nbformat.read(root / "experiments" / "skills" / "skills.ipynb", as_version=4)
    code = "\n\n".join(c.source for c in nb.cells if c.cell_type == "code")
    env = {**os.environ, "PYTHONPATH": str(root), "MPLBACKEND": "Agg", "MOEJAX_SKILLS_RESULTS": str(eval_run),
           "MOEJAX_SKILLS_FIGURES": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    for name in ("skills_exact_match.png", "skills_mc_vs_generation.png", "skills_routing.png"):
        assert (tmp_path / name).stat().st_size > 5_000


def test_bad_eval_settings_are_refused_before_calibration(skills_model, tmp_path):
    from moejax.experiments.eval_tasks import EvalTasksConfig

    path, _ = skills_model
    base = {"path": str(path), "keep": (4,), "scores": ("frequency",), "seq_len": 48}
    with pytest.raises(ConfigError, match="unknown text"):
        EvalTasksConfig.from_mapping({**base, "tasks": ("skills_up",), "calibration": "code=0.5,poems=0.5"})
    with pytest.raises(ConfigError, match="256 bytes, longer than the model's 48 positions"):
        EvalTasksConfig.from_mapping({**base, "tasks": ("skills_degen",)})


def test_skills_model_equals_hf_backend_unpruned_and_pruned(skills_model, tmp_path):
    """lm-eval's own hf backend and the moejax backend give the same skills-task numbers on the
    skills model, unpruned and pruned by `moejax prune` (a checkpoint on disk)."""
    pytest.importorskip("transformers")
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from moejax.cli import main as cli
    from moejax.evaluation.lm_eval import MoejaxLM

    path, _ = skills_model
    os.environ["HF_DATASETS_CACHE"] = str(tmp_path / "datasets")
    tasks = write_skills_tasks(tmp_path / "tasks", skills=["up", "close"], n=6, n_mc=4, n_ll=4, n_degen=2)
    pruned = tmp_path / "pruned"
    assert cli(["prune", str(path), str(pruned), "--keep", "4", "--score", "l1", "--collapse-groups"]) == 0
    names = ["skills_up", "skills_up_mc", "skills_close", "skills_close_ll"]   # every output type
    tm = TaskManager(include_path=str(tasks), include_defaults=False)
    for ckpt in (path, pruned):
        hf = lm_eval.simple_evaluate(model=HFLM(pretrained=str(ckpt), dtype="float32", batch_size=4, device="cpu"),
                                     tasks=names, task_manager=tm, bootstrap_iters=0)["results"]
        mj = lm_eval.simple_evaluate(model=MoejaxLM(pretrained=str(ckpt), dtype="float32", batch_size=4),
                                     tasks=names, task_manager=tm, bootstrap_iters=0)["results"]
        for task in names:
            for metric, value in hf[task].items():
                if re.fullmatch(r"(exact_match|acc|logprob),none", metric):
                    assert mj[task][metric] == pytest.approx(value, rel=1e-5, abs=1e-6), (ckpt, task, metric)
