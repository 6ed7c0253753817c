"""The lm-eval backend `moejax` against lm-eval's own `hf` backend (transformers, torch CPU) on the
same tiny checkpoint and the same local tasks: per-request log-likelihoods, is_greedy flags,
generated strings and task metrics; variants applied as expert masks; errors before loading."""

import json
import sysconfig
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("lm_eval")

from hf_fixtures import lm_eval_setup, make_checkpoint  # noqa: E402

from moejax.data import write_byte_tokenizer  # noqa: E402
from moejax.errors import ConfigError  # noqa: E402
from moejax.evaluation.tasks import TASKS, write_stdlib_tasks  # noqa: E402

STDLIB = Path(sysconfig.get_paths()["stdlib"])


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return lm_eval_setup(tmp_path_factory.mktemp("lmeval"), seed=21, n_nextline=6, n_mc=8, n_ppl=2)


def evaluate(model, tasks_dir, tasks=TASKS):
    import lm_eval
    from lm_eval.tasks import TaskManager

    tm = TaskManager(include_path=str(tasks_dir), include_defaults=False)
    return lm_eval.simple_evaluate(model=model, tasks=list(tasks), task_manager=tm, bootstrap_iters=0,
                                   log_samples=True)


def responses(out, task):
    return [s["resps"] for s in sorted(out["samples"][task], key=lambda s: s["doc_id"])]


@pytest.fixture(scope="module")
def backends(setup):
    """lm-eval's `hf` backend and `moejax` on the same checkpoint (loaded once for the module)."""
    from lm_eval.models.huggingface import HFLM

    from moejax.evaluation.lm_eval import MoejaxLM

    ckpt, _ = setup
    return (HFLM(pretrained=str(ckpt), dtype="float32", batch_size=4, device="cpu"),
            MoejaxLM(pretrained=str(ckpt), dtype="float32", batch_size=4))


@pytest.fixture(scope="module")
def both(setup, backends):
    hf_lm, mj_lm = backends
    return evaluate(hf_lm, setup[1]), evaluate(mj_lm, setup[1])


def test_loglikelihoods_and_greedy_flags_equal_the_hf_backend(both):
    hf, mj = both
    for task in ("stdlib_mc", "stdlib_ppl"):
        want, got = responses(hf, task), responses(mj, task)
        assert len(want) == len(got) > 0
        for w_doc, g_doc in zip(want, got):
            for w, g in zip(w_doc, g_doc):
                w_ll = w[0][0] if task == "stdlib_mc" else w[0]
                g_ll = g[0][0] if task == "stdlib_mc" else g[0]
                assert abs(w_ll - g_ll) <= 1e-4 + 1e-6 * abs(w_ll), (task, w, g)
                if task == "stdlib_mc":
                    assert w[0][1] == g[0][1]


def test_greedy_flags_true_and_false_equal_the_hf_backend(backends):
    """Continuations made of the model's own greedy tokens (transformers' argmax), whole or cut,
    and the same with one token changed (first, middle or last): lm-eval's `hf` backend flags some
    True and some False, and moejax's flags and log-likelihoods equal its own, request by request.
    (On the tasks' text a random model's flags are all False, so a flag read at the wrong position
    would agree there.) Token-level requests, as lm-eval hands them to `_loglikelihood_tokens`."""
    import torch

    hf_lm, mj_lm = backends
    rng = np.random.default_rng(9)
    requests, expected = [], []
    for n_ctx in (3, 9, 17, 30, 41):
        ctx = rng.integers(1, 256, size=n_ctx).tolist()
        greedy = []
        with torch.no_grad():
            for _ in range(4):  # transformers' own argmax, one token at a time
                greedy.append(int(hf_lm.model(torch.tensor([ctx + greedy])).logits[0, -1].argmax()))
        for cont, is_greedy in ((greedy, True), (greedy[:1], True), (greedy[:2], True)):
            requests.append((ctx, cont))
            expected.append(is_greedy)
        for at in (0, 1, 3):  # one token changed: not greedy
            changed = list(greedy)
            changed[at] = (changed[at] + 1 + int(rng.integers(0, 254))) % 256
            requests.append((ctx, changed))
            expected.append(False)
    requests.append((requests[0][0], requests[0][1][1:]))  # greedy tokens one position early
    expected.append(None)
    token_requests = [(("", ""), ctx, cont) for ctx, cont in requests]
    token_requests += token_requests[4::3]   # repeated requests (moejax scores each pair once): answered each time
    expected += expected[4::3]
    want = hf_lm._loglikelihood_tokens(token_requests, disable_tqdm=True)
    got = mj_lm._loglikelihood_tokens(token_requests, disable_tqdm=True)
    flags = [w[1] for w in want]
    assert [f for f, e in zip(flags, expected) if e is not None] == [e for e in expected if e is not None]
    assert True in flags and False in flags
    assert [g[1] for g in got] == flags
    for (w_ll, _), (g_ll, _) in zip(want, got):
        assert abs(w_ll - g_ll) <= 1e-4 + 1e-6 * abs(w_ll), (w_ll, g_ll)


def test_generated_strings_equal_the_hf_backend(both):
    hf, mj = both
    want, got = responses(hf, "stdlib_nextline"), responses(mj, "stdlib_nextline")
    assert want == got
    assert any(r[0][0] for r in got)  # something was generated


def test_task_metrics_equal_the_hf_backend(both):
    hf, mj = both
    for task in TASKS:
        w, g = hf["results"][task], mj["results"][task]
        for metric, value in w.items():
            if metric.endswith(",none") and isinstance(value, float) and "stderr" not in metric:
                assert g[metric] == pytest.approx(value, rel=1e-5, abs=1e-6), (task, metric)


def test_variant_from_scores_changes_the_results_and_equals_explicit_masks(setup, tmp_path):
    import pandas as pd

    from moejax.evaluation.lm_eval import MoejaxLM

    ckpt, tasks = setup
    config = json.loads((ckpt / "config.json").read_text())
    E = config["n_routed_experts"]
    moe_layers = range(config["first_k_dense_replace"], config["num_hidden_layers"])
    rows = [{"layer": l, "expert": e, "score": "l1", "value": float((e * 7 + l) % E)} for l in moe_layers
            for e in range(E)]
    pd.DataFrame(rows).to_parquet(tmp_path / "scores.parquet")
    lm = MoejaxLM(pretrained=str(ckpt), batch_size=4, scores=str(tmp_path / "scores.parquet"), score="l1", keep=8)
    for l in moe_layers:   # the masks, converted once into the expert maps the forward takes
        want = np.zeros(E, bool)
        want[np.argsort(-np.array([(e * 7 + l) % E for e in range(E)]), kind="stable")[:8]] = True
        np.testing.assert_array_equal(np.asarray(lm.expert_variant[l].mask_E), want)
    pruned = evaluate(lm, tasks, ["stdlib_ppl"])
    full = evaluate(MoejaxLM(pretrained=str(ckpt), batch_size=4), tasks, ["stdlib_ppl"])
    assert responses(pruned, "stdlib_ppl") != responses(full, "stdlib_ppl")
    # the same kept sets from a pruning record give the same numbers
    record = {"layers": {str(l): {"n_experts": E, "kept": np.flatnonzero(np.asarray(lm.expert_variant[l].mask_E)).tolist()} for l in moe_layers}}
    (tmp_path / "pruning.json").write_text(json.dumps(record))
    again = evaluate(MoejaxLM(pretrained=str(ckpt), batch_size=4, pruning=str(tmp_path)), tasks, ["stdlib_ppl"])
    assert responses(again, "stdlib_ppl") == responses(pruned, "stdlib_ppl")


def test_invalid_variants_fail_before_the_model_is_loaded(setup, tmp_path, monkeypatch):
    import pandas as pd

    import moejax.evaluation.lm_eval
    from moejax.evaluation.lm_eval import MoejaxLM

    ckpt, _ = setup
    monkeypatch.setattr(moejax.evaluation.lm_eval, "load_pretrained", lambda *a, **k: pytest.fail("loaded the model"))
    pd.DataFrame([{"layer": 1, "expert": e, "score": "l1", "value": 1.0} for e in range(16)]).to_parquet(
        tmp_path / "s.parquet")
    with pytest.raises(ConfigError, match="no score 'reap'.*holds \\['l1'\\]"):
        MoejaxLM(pretrained=str(ckpt), scores=str(tmp_path / "s.parquet"), score="reap", keep=8)
    with pytest.raises(ConfigError, match="below top_k=4"):
        MoejaxLM(pretrained=str(ckpt), scores=str(tmp_path / "s.parquet"), score="l1", keep=2)
    with pytest.raises(ConfigError, match="missing \\[2\\]"):  # layer 2's scores are absent
        MoejaxLM(pretrained=str(ckpt), scores=str(tmp_path / "s.parquet"), score="l1", keep=8)
    with pytest.raises(ConfigError, match="no such pruning record"):
        MoejaxLM(pretrained=str(ckpt), pruning=str(tmp_path / "nothing.json"))
    with pytest.raises(ConfigError, match="scores=FILE, score=NAME and keep=N together"):
        MoejaxLM(pretrained=str(ckpt), score="l1")
    with pytest.raises(ConfigError, match="unknown model_args \\['kepp'\\]"):
        MoejaxLM(pretrained=str(ckpt), kepp=8)


def test_registered_and_built_from_model_args_strings(setup):
    from lm_eval.api.registry import get_model

    import moejax.evaluation.lm_eval  # noqa: F401  (registers)

    ckpt, _ = setup
    cls = get_model("moejax")
    assert cls is moejax.evaluation.lm_eval.MoejaxLM
    assert get_model("hf")  # registering did not replace lm-eval's own models
    lm = cls.create_from_arg_string(f"pretrained={ckpt},dtype=float32", {"batch_size": "2", "device": None})
    assert lm.batch_size == 2 and lm.max_length == 512 and lm.eot_token_id == 0


# Each family's byte-level checkpoint (vocab 256, eos = pad = byte 0, no BOS, 512 positions) from
# its TEST config, with these settings besides. GLM-5: layer 1 a "shared" indexer layer (it attends
# with layer 0's selection, threaded by the model's forward; as GLM-5.2's schedule has them). The
# DSA families: 32 indexer heads (TEST: 8), so that a key's index score is never exactly 0. With 8,
# a key every head scores <= 0 (ReLU) scores exactly 0 (probability 1/256 per query-key pair), and
# such exact ties at the top-k boundary are broken by torch.topk in an order of its own that moejax
# does not reproduce (moejax.models.dsa_indexer: ties go to the earliest key). Measured on
# stdlib_mc's 16 requests (contexts of up to 300 bytes, seed 22, 8 heads): 3 (DeepSeek-V3.2) and 1
# (GLM-5) log-likelihoods differed from the hf backend's by 2e-3 to 0.29, each in a request with such
# a tie, and transformers itself differed between its batch of 4 and each request alone by up to
# 1.6e-2 (its tie order depends on the row length); away from ties every request agreed within 3e-5.
LM_EVAL_FAMILIES = {
    "qwen3_moe": {},
    "gpt_oss": {},
    "qwen3_next": {},
    "qwen3_5_moe": {},
    "deepseek_v32": dict(index_n_heads=32),
    "glm_moe_dsa": dict(index_n_heads=32, indexer_types=["full", "shared", "full"]),
    "deepseek_v4": {},
}
# generate_until is compared where it is cheap; the gated-delta-rule families' 48 greedy tokens cost
# about 8 s more each on 2 cores (transformers' reference PyTorch delta rule, moejax's decode), and
# their generation is compared with transformers' in tests/test_families.py and test_qwen3_next.py
# (the lm-eval backend's generate_until is family-agnostic: moejax.inference.generate.Generator)
NOT_GENERATED = {"qwen3_next", "qwen3_5_moe"}
# DeepSeek-V4's compressors pool every column, left padding included, and rotate their entries at
# column positions (transformers' as moejax's), so a prompt's greedy continuation depends on its
# left padding: moejax's backend pads each prompt to a bucket, lm-eval's hf backend runs one request
# unpadded, and the strings may differ. Its generate_until is compared instead with transformers'
# `generate` on the ids and mask the backend hands its generator (tokens up to the row's stop).
PADDING_CHANGES_GENERATION = {"deepseek_v4"}


def byte_level_checkpoint(family, path, seed):
    """A byte-level checkpoint of `family` with its byte tokenizer (a multimodal wrapper, Qwen3.5-MoE:
    the language model's settings in its text_config); returns transformers' model."""
    from family_fixtures import FAMILIES, make_family_checkpoint

    ids = dict(eos_token_id=0, pad_token_id=0, bos_token_id=None)
    text = dict(vocab_size=256, max_position_embeddings=512, **ids, **LM_EVAL_FAMILIES[family])
    base = FAMILIES[family][1]
    overrides = dict(text_config={**base["text_config"], **text}, **ids) if "text_config" in base else text
    hf = make_family_checkpoint(family, path, seed=seed, **overrides)
    write_byte_tokenizer(path, 512)
    return hf


@pytest.mark.parametrize("family", list(LM_EVAL_FAMILIES))
def test_each_family_equals_the_hf_backend(family, tmp_path):
    """The backend is family-agnostic: on a byte-level checkpoint of each family (softmax and
    sigmoid routers; GQA, sliding-window and sink attention, linear attention (gated delta rule), MLA
    with the DSA indexer, GLM-5's shared indexer layers, DeepSeek-V4's compressed attention and
    hyper-connections) moejax gives lm-eval's `hf` backend's
    log-likelihoods and greedy flags on the multiple-choice task (lm-eval's hf backend right-pads
    these, so each row is its sequence alone for transformers too), greedy flags True on
    transformers' own greedy continuation and False with one token changed, and the same generated
    string on the next-line task (but NOT_GENERATED; one request: transformers left-pads a batch
    of generations, where the gated-delta-rule and DSA families are not exact; DeepSeek-V4:
    PADDING_CHANGES_GENERATION). Qwen3.5-MoE's
    checkpoint is a multimodal wrapper (Qwen3_5MoeForConditionalGeneration); lm-eval's hf backend
    loads it, as transformers' AutoModelForCausalLM does, as Qwen3_5MoeForCausalLM, its language
    model."""
    import torch
    from lm_eval.models.huggingface import HFLM

    from moejax.evaluation.lm_eval import MoejaxLM

    ckpt = tmp_path / family
    byte_level_checkpoint(family, ckpt, seed=22)
    # contexts of at most 80 bytes: every request (context + a line of at most 40) within one
    # compiled length (128), longer than the DSA index_topk and the gated delta rule's chunk (64)
    tasks = write_stdlib_tasks(tmp_path / "tasks", files=[STDLIB / "textwrap.py"], n_nextline=1, n_mc=4, n_ppl=1,
                               max_context_bytes=80)
    hf_lm = HFLM(pretrained=str(ckpt), dtype="float32", batch_size=4, device="cpu")
    mj_lm = MoejaxLM(pretrained=str(ckpt), dtype="float32", batch_size=4)
    names = ["stdlib_mc"] + ([] if family in NOT_GENERATED else ["stdlib_nextline"])
    calls, generator = [], mj_lm._generator

    def recorded(ids, mask, **kw):
        out = generator(ids, mask, **kw)
        calls.append((ids, mask, kw["max_new_tokens"], out))
        return out

    mj_lm._generator = recorded
    hf, mj = (evaluate(lm, tasks, names) for lm in (hf_lm, mj_lm))
    want, got = responses(hf, "stdlib_mc"), responses(mj, "stdlib_mc")
    assert len(want) == len(got) > 0
    for w_doc, g_doc in zip(want, got):
        for w, g in zip(w_doc, g_doc):
            assert abs(w[0][0] - g[0][0]) <= 1e-4 + 1e-6 * abs(w[0][0]) and w[0][1] == g[0][1], (w, g)
    # greedy flags True too: transformers' 3 greedy tokens after the task's longest request, whole
    # and with one token changed (within the task's compiled length: no new shape to compile)
    docs = [json.loads(line) for line in (tasks / "stdlib_mc.jsonl").read_text().splitlines()]
    ctx = max((mj_lm.tok_encode(d["context"] + c) for d in docs for c in d["choices"]), key=len)
    greedy = []
    with torch.no_grad():
        for _ in range(3):
            greedy.append(int(hf_lm.model(torch.tensor([ctx + greedy])).logits[0, -1].argmax()))
    changed = greedy[:2] + [(greedy[2] + 1) % 256]
    requests = [(("", ""), ctx, cont) for cont in (greedy, changed)]
    want = hf_lm._loglikelihood_tokens(requests, disable_tqdm=True)
    got = mj_lm._loglikelihood_tokens(requests, disable_tqdm=True)
    assert [w[1] for w in want] == [g[1] for g in got] == [True, False]
    for (w_ll, _), (g_ll, _) in zip(want, got):
        assert abs(w_ll - g_ll) <= 1e-4 + 1e-6 * abs(w_ll), (w_ll, g_ll)
    if family in PADDING_CHANGES_GENERATION:
        assert calls and responses(mj, "stdlib_nextline")[0][0][0]  # (something was generated)
        for ids, mask, n_new, out in calls:
            with torch.no_grad():
                want = hf_lm.model.generate(input_ids=torch.as_tensor(ids), attention_mask=torch.as_tensor(mask),
                                            max_new_tokens=n_new, do_sample=False, eos_token_id=None,
                                            pad_token_id=0).numpy()
            P = ids.shape[1]
            for row_out, row_want in zip(out[:, P:], want[:, P:]):   # pad (0) fills a row after its stop
                stop = int(np.argmax(row_out == 0)) if (row_out == 0).any() else n_new
                assert stop > 0
                np.testing.assert_array_equal(row_out[:stop], row_want[:stop])
    elif family not in NOT_GENERATED:
        want, got = responses(hf, "stdlib_nextline"), responses(mj, "stdlib_nextline")
        assert want == got and got[0][0][0], (want, got)  # (something was generated)


def test_a_merged_variant_equals_the_hf_backend_on_experts_replaced_in_place(setup, tmp_path):
    """A tied merge evaluated as a variant of the source (no checkpoint) equals lm-eval's hf backend
    on a checkpoint whose experts are replaced in place by their cluster's merged expert."""
    import jax.numpy as jnp
    from lm_eval.models.huggingface import HFLM

    from moejax.hf.model_io import load_pretrained, save_pretrained
    from moejax.evaluation.lm_eval import MoejaxLM
    from moejax.merging.calibration import merge_stats
    from moejax.merging.layer import merge_layer
    from moejax.merging.method import MergeContext, parse

    ckpt, tasks = setup
    model = load_pretrained(ckpt)
    calib = np.random.default_rng(3).integers(0, 256, size=(4, 32)).astype(np.int32)
    merges = {}
    for l, z in model.jitted()(jnp.asarray(calib), None, return_moe_inputs=True).moe_inputs.items():
        moe = model.model.layers[l].mlp
        merges[l] = merge_layer(parse("hc_smoe"), 6, MergeContext.of(merge_stats(moe, [z], [None])),
                                moe.expert_weights())
    lm = MoejaxLM(pretrained=str(ckpt), batch_size=4)
    merged = evaluate(lm.variant({l: m.expert_map("tied") for l, m in merges.items()}), tasks, ["stdlib_mc"])
    for l, m in merges.items():  # the same merge written into the experts themselves
        moe = model.model.layers[l].mlp
        for key, attr in (("gate", "experts_gate"), ("up", "experts_up"), ("down", "experts_down")):
            getattr(moe, attr)[...] = jnp.asarray(m.weights[key][m.labels_E])
    save_pretrained(model, tmp_path / "in_place")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (ckpt / name).is_file():
            (tmp_path / "in_place" / name).write_bytes((ckpt / name).read_bytes())
    hf = evaluate(HFLM(pretrained=str(tmp_path / "in_place"), dtype="float32", batch_size=4, device="cpu"), tasks,
                  ["stdlib_mc"])
    full = evaluate(lm, tasks, ["stdlib_mc"])
    got, want = responses(merged, "stdlib_mc"), responses(hf, "stdlib_mc")
    flat = lambda r: np.array([w[0][0] for doc in r for w in doc], np.float64)  # noqa: E731 - log-likelihoods
    assert len(flat(got)) == len(flat(want)) > 0
    np.testing.assert_allclose(flat(got), flat(want), atol=1e-4, rtol=1e-6)
    assert np.abs(flat(got) - flat(responses(full, "stdlib_mc"))).max() > 1e-2  # the merge changed the model


def test_settings_and_variants_below_top_k_fail_before_the_model_is_loaded(setup, monkeypatch):
    """model_args out of range, and a variant keeping fewer than top_k=4 experts in a layer (or 4
    that group-limited routing, 4 groups of 4 with 2 chosen, cannot always reach), are refused by
    name before loading; the same rule as the forward's (moejax.models.variant.check_variant)."""
    import moejax.evaluation.lm_eval
    from moejax.evaluation.lm_eval import MoejaxLM

    ckpt, _ = setup
    monkeypatch.setattr(moejax.evaluation.lm_eval, "load_pretrained", lambda *a, **k: pytest.fail("loaded the model"))
    for kw, match in [(dict(max_length=-5), r"max_length=-5; expected an integer >= 1 \(the context length"),
                      (dict(max_length="512x"), r"max_length='512x'; expected an integer >= 1"),
                      (dict(max_length=0), r"max_length=0; expected an integer >= 1"),
                      (dict(max_gen_toks=0), r"max_gen_toks=0; expected an integer >= 1"),
                      (dict(max_gen_toks="-3"), r"max_gen_toks=-3; expected an integer >= 1"),
                      (dict(batch_size="auto"), r"batch_size='auto'; expected an integer >= 1 \(compiled shapes"),
                      (dict(seed=2 ** 70), r"seed=1180591620717411303424; expected an integer in \[0, 2\*\*32\)")]:
        with pytest.raises(ConfigError, match="moejax lm-eval model: " + match):
            MoejaxLM(pretrained=str(ckpt), **kw)
    masks = np.ones((3, 16), bool)
    masks[2] = np.arange(16) < 3
    with pytest.raises(ConfigError, match=r"expert masks: layer 2: keeps 3 experts, below num_experts_per_tok=4"):
        MoejaxLM(pretrained=str(ckpt), variant=masks)
    masks[2] = np.isin(np.arange(16), [0, 4, 8, 12])  # one per group: a token's 2 groups hold 2
    with pytest.raises(ConfigError, match=r"layer 2: keeps \[1, 1, 1, 1\] experts per routing group.*only 2 kept"):
        MoejaxLM(pretrained=str(ckpt), variant=masks)


def test_variant_and_generation_settings_are_refused_before_any_request_runs(setup):
    """MoejaxLM.variant applies the same rule; generate_until refuses, before its first batch, a
    request that samples (do_sample=True) at a temperature <= 0 (lm-eval's hf backend: transformers
    refuses it; it was decoded greedily) or asks for max_gen_toks < 1."""
    from lm_eval.api.instance import Instance

    from moejax.evaluation.lm_eval import MoejaxLM
    from moejax.moe.expert_map import ExpertMap

    ckpt, _ = setup
    lm = MoejaxLM(pretrained=str(ckpt), batch_size=2)
    masks = np.ones((3, 16), bool)
    masks[1] = False
    with pytest.raises(ConfigError, match=r"expert masks: layer 1: keeps 0 experts, below num_experts_per_tok=4"):
        lm.variant(masks)
    with pytest.raises(ConfigError, match=r"variant: layer 2: keeps 2 experts, below num_experts_per_tok=4"):
        lm.variant({2: ExpertMap(np.arange(16) < 2)})
    lm._generator = lambda *a, **k: pytest.fail("generated before every request was checked")

    def request(i, **gen_kwargs):
        return Instance("generate_until", doc={}, arguments=("def f(x):", {"until": ["\n"], **gen_kwargs}), idx=i)

    for kwargs, match in [(dict(do_sample=True, temperature=-1), r"do_sample=True with temperature=-1.0; sampling "
                                                                 r"needs a temperature > 0"),
                          (dict(do_sample=True, temperature=0.0), r"do_sample=True with temperature=0.0"),
                          (dict(max_gen_toks=0), r"max_gen_toks=0 \(the task's generation kwargs"),
                          (dict(do_sample=True, temperature=0.5, top_p=2), r"top_p=2"),
                          (dict(temperature="hot"), r"generation kwargs .*'hot'")]:
        with pytest.raises(ConfigError, match=match):
            lm.generate_until([request(0), request(1, **kwargs)], disable_tqdm=True)


def test_moejax_lm_eval_refuses_a_task_list_and_model_args_in_one_line(setup, monkeypatch, capsys):
    """`moejax-lm-eval run`: an unknown or empty task list (lm-eval's refusal) and a model_arg
    moejax refuses end in one line and exit status 2, not a traceback, and before a model loads."""
    import sys

    import lm_eval.tasks

    import moejax.evaluation.lm_eval

    ckpt, tasks = setup
    monkeypatch.setattr(moejax.evaluation.lm_eval, "load_pretrained", lambda *a, **k: pytest.fail("loaded the model"))

    class Local(lm_eval.tasks.TaskManager):  # the local tasks only (indexing lm-eval's own takes ~20 s)
        def __init__(self, *a, **kw):
            super().__init__(include_path=str(tasks), include_defaults=False, metadata=kw.get("metadata"))

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", Local)
    for names, model_args, said in [("nope_task", "", "Tasks not found: nope_task"),
                                    ("", "", "No tasks specified"),
                                    ("stdlib_mc", ",max_length=-5", "moejax lm-eval model: max_length=-5; expected")]:
        monkeypatch.setattr(sys, "argv", ["moejax-lm-eval", "run", "--model", "moejax", "--model_args",
                                          f"pretrained={ckpt}{model_args}", "--tasks", names])
        with pytest.raises(SystemExit) as exit_:
            moejax.evaluation.lm_eval.cli()
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and f"moejax-lm-eval: error: {said}" in err and "Traceback" not in err, err


def qwen3_style_copy(ckpt, out):
    """The checkpoint with a Qwen3-style tokenizer: no BOS in tokenizer_config.json (bos_token:
    null, as the byte tokenizer writes it) while config.json names a bos_token_id (byte 1)."""
    out.mkdir()
    for file in ckpt.iterdir():
        if file.name != "config.json":
            (out / file.name).symlink_to(file)
    config = json.loads((ckpt / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(dict(config, bos_token_id=1)))
    assert json.loads((out / "tokenizer_config.json").read_text())["bos_token"] is None
    return out


def test_a_qwen3_style_tokenizer_is_conditioned_on_the_hf_backends_prefix_token(setup, backends, tmp_path):
    """bos_token null in tokenizer_config.json, a bos_token_id in config.json (Qwen3's files): the
    hf backend's prefix token is the EOS (transformers' tokenizer has no BOS), and moejax's is the
    same, so loglikelihood_rolling (wikitext-style perplexity: the first window is conditioned on it)
    and empty-context loglikelihoods equal the hf backend's; a custom prefix_token_id too."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from moejax.evaluation.lm_eval import MoejaxLM

    ckpt, _ = setup
    qwen = qwen3_style_copy(ckpt, tmp_path / "qwen3_style")
    text = (STDLIB / "textwrap.py").read_text()
    rolling = [Instance("loglikelihood_rolling", doc={}, arguments=(t,), idx=i)
               for i, t in enumerate([text[:200], text[1000:1700]])]  # the second: two windows of 512
    empty = [Instance("loglikelihood", doc={}, arguments=("", c), idx=i)
             for i, c in enumerate(["def f(x):", "import os"])]
    for kw in ({}, {"prefix_token_id": 7}):
        hf = HFLM(pretrained=str(qwen), dtype="float32", batch_size=4, device="cpu", **kw)
        mj = MoejaxLM(pretrained=str(qwen), dtype="float32", batch_size=4, model=backends[1].model,
                      **{k: str(v) for k, v in kw.items()})   # as lm-eval's model_args strings
        want = hf.loglikelihood_rolling(rolling, disable_tqdm=True) + [
            ll for ll, _ in hf.loglikelihood(empty, disable_tqdm=True)]
        got = mj.loglikelihood_rolling(rolling, disable_tqdm=True) + [
            ll for ll, _ in mj.loglikelihood(empty, disable_tqdm=True)]
        for w, g in zip(want, got, strict=True):
            assert abs(w - g) <= 1e-4 + 1e-6 * abs(w), (kw, want, got)
        assert mj.prefix_token_id == hf.prefix_token_id == kw.get("prefix_token_id", 0)  # (0: the eos)
    with pytest.raises(ConfigError, match=r"prefix_token_id=256; not a token id"):
        MoejaxLM(pretrained=str(qwen), model=backends[1].model, prefix_token_id=256)


@pytest.mark.parametrize("think_end_token", [None, "</think>", "35", 35])
def test_think_end_token_strips_the_reasoning_as_the_hf_backend(setup, backends, think_end_token):
    """think_end_token (text, or a token id: as lm-eval's model_args give "35" or 35) is accepted
    and the generations keep only what follows its last occurrence, then stop at the task's stop
    string: both backends' generate_until on the same generated tokens (each backend's generator
    replaced by one returning known tokens after the prompt: reasoning with stop strings inside it,
    the end text and the end token id ("#" = 35) twice, or neither) return the same strings."""
    import torch
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from moejax.evaluation.lm_eval import MoejaxLM

    ckpt, _ = setup
    generated = {  # the prompt's last byte -> the generated text (then eos = pad = byte 0)
        ord("a"): "let me # think\n\nabout</think># it\n\n 42\nmore",
        ord("b"): "x</think>y # z</think>  last #  answer\nrest",
        ord("c"): "no end token here\nsecond",
    }
    max_new = 64

    def forced(last: int) -> list[int]:
        ids = list(generated[int(last)].encode())
        return ids + [0] * (max_new - len(ids))

    def hf_generate(context, max_length, stop, **kwargs):
        return torch.cat([context, torch.tensor([forced(row[-1]) for row in context.tolist()])], dim=1)

    def mj_generate(ids, mask, max_new_tokens, **kwargs):
        assert max_new_tokens == max_new
        return np.concatenate([ids, np.array([forced(row[-1]) for row in ids])], axis=1)

    kw = {} if think_end_token is None else {"think_end_token": think_end_token}
    hf = HFLM(pretrained=str(ckpt), dtype="float32", batch_size=2, device="cpu", **kw)
    mj = MoejaxLM(pretrained=str(ckpt), dtype="float32", batch_size=2, model=backends[1].model, **kw)
    hf._model_generate, mj._generator = hf_generate, mj_generate
    gen_kwargs = {"until": ["\n"], "max_gen_toks": max_new}
    requests = [Instance("generate_until", doc={}, arguments=(f"prompt {c}", gen_kwargs), idx=i)
                for i, c in enumerate("abc")]
    want = hf.generate_until(requests, disable_tqdm=True)
    assert mj.generate_until(requests, disable_tqdm=True) == want
    assert want == {None: ["let me # think", "x</think>y # z</think>  last #  answer", "no end token here"],
                    "</think>": ["# it", "last #  answer", "no end token here"]}.get(
        think_end_token, ["it", "answer", "no end token here"])   # (the reasoning gone)


def test_boolean_model_args_take_only_true_false_1_0_and_thinking_needs_its_end_token(setup, backends):
    """enable_thinking and add_bos_token: true/false/1/0 in any case (and bools) are read, anything
    else (`ture`) is refused by name, from Python and from lm-eval's model_args string;
    enable_thinking=true without think_end_token is refused as the hf backend refuses it, and with
    it loglikelihood requests are refused as the hf backend refuses them."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from moejax.evaluation.lm_eval import MoejaxLM

    ckpt, _ = setup
    model = backends[1].model
    for value, want in [("true", True), ("TRUE", True), ("1", True), (1, True), (True, True), ("false", False),
                        ("False", False), ("0", False), (0, False), (False, False), (None, None)]:
        lm = MoejaxLM(pretrained=str(ckpt), model=model, add_bos_token=value, enable_thinking=value,
                      think_end_token="</think>")
        assert lm.add_bos_token is want and lm.enable_thinking is want, value
        assert lm.chat_template_args == ({} if want is None else {"enable_thinking": want})
    for name in ("enable_thinking", "add_bos_token"):
        for value in ("ture", "yes", "", 2, 0.5):
            with pytest.raises(ConfigError, match=rf"moejax lm-eval model: {name}={value!r}; expected true, false, "
                                                  r"1 or 0"):
                MoejaxLM(pretrained=str(ckpt), model=model, **{name: value})
    with pytest.raises(ConfigError, match=r"enable_thinking='ture'; expected true, false, 1 or 0"):
        MoejaxLM.create_from_arg_string(f"pretrained={ckpt},enable_thinking=ture,think_end_token=</think>")
    assert MoejaxLM.create_from_arg_string(f"pretrained={ckpt},enable_thinking=0").enable_thinking is False
    with pytest.raises(ValueError, match="think_end_token is required"):  # the reference
        HFLM(pretrained=str(ckpt), dtype="float32", device="cpu", enable_thinking=True)
    with pytest.raises(ConfigError, match=r"enable_thinking=true needs think_end_token"):
        MoejaxLM(pretrained=str(ckpt), model=model, enable_thinking="true")
    for value in ("", 1.5, True, -1, "256"):
        with pytest.raises(ConfigError, match=r"think_end_token="):
            MoejaxLM(pretrained=str(ckpt), model=model, think_end_token=value)
    request = Instance("loglikelihood", doc={}, arguments=("a", "b"), idx=0, metadata=("my_task", 0, 1))
    hf = HFLM(pretrained=str(ckpt), dtype="float32", device="cpu", enable_thinking=True, think_end_token="</think>")
    with pytest.raises(ValueError, match="not compatible with loglikelihood"):
        hf.loglikelihood([request])
    lm = MoejaxLM(pretrained=str(ckpt), model=model, enable_thinking=True, think_end_token="</think>")
    with pytest.raises(ConfigError, match=r"enable_thinking=true scores generations only; loglikelihood tasks "
                                          r"\['my_task'\] are refused"):
        lm.loglikelihood([request])
