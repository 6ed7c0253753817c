"""Chat templates and meshes in the lm-eval backend `moejax`: the template rendered as transformers'
`apply_chat_template` renders it, lm-eval's `hf` backend with `apply_chat_template` and
`fewshot_as_multiturn` giving the same requests, log-likelihoods and generations, and the backend
on the 8-device CPU mesh equal to one device."""

import json
import re
import shutil

import pytest

pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("lm_eval")

from hf_fixtures import lm_eval_setup  # noqa: E402

from moejax.errors import ConfigError  # noqa: E402
from moejax.evaluation.chat_template import read_chat_template, render_chat  # noqa: E402

# a template with what real ones use: a system turn, loop controls, namespace, tojson, an exception,
# the special tokens as variables, a generation prompt and a {% generation %} block
TEMPLATE = """{% set ns = namespace(n=0) %}
{% for m in messages %}
  {% set ns.n = ns.n + 1 %}
  {% if m['role'] == 'system' %}
<<SYS {{ m['content'] | tojson }}>>
  {% elif m['role'] == 'user' %}
U{{ ns.n }}: {{ m['content'] }}
  {% elif m['role'] == 'assistant' %}
A: {% generation %}{{ m['content'] }}{% endgeneration %}{% if not loop.last %}{{ eos_token }}
{% endif %}
  {% else %}
{{ raise_exception('unknown role ' + m['role']) }}
  {% endif %}
{% endfor %}
{% if add_generation_prompt %}A: {% endif %}
"""
NO_SYSTEM = "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system') }}" \
            "{% endif %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}"
TASKS = ["stdlib_mc", "stdlib_nextline"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    # textwrap.py alone: with two shots of fractions.py's longer lines the prompts fill the 512
    # positions, and 2 of 16 log-likelihoods there differed from the hf backend's by 1e-3 and 3e-3
    # (the other 14 by 1e-5; not traced further)
    ckpt, tasks = lm_eval_setup(tmp_path_factory.mktemp("lmchat"), seed=23, files=["textwrap.py"], n_nextline=4,
                                n_mc=4, n_ppl=1)
    config = json.loads((ckpt / "tokenizer_config.json").read_text())
    (ckpt / "tokenizer_config.json").write_text(json.dumps(dict(config, chat_template=TEMPLATE)))
    return ckpt, tasks


CHATS = [
    [{"role": "user", "content": "def f(x):"}],
    [{"role": "system", "content": 'be "brief" <ok>'}, {"role": "user", "content": "a"},
     {"role": "assistant", "content": "b  "}, {"role": "user", "content": "c\n"}],
    [{"role": "user", "content": "q"}, {"role": "assistant", "content": "partial answ "}],
]


def test_templates_render_as_transformers_renders_them(setup, tmp_path):
    """Every chat, with and without a generation prompt, and continuing the final message (what
    lm-eval asks for a scored assistant turn): the text of transformers' `apply_chat_template` on
    the same folder; the same from `chat_template.jinja`, which wins over tokenizer_config.json, and
    from a list of named templates; the template's own exception raised as jinja's TemplateError."""
    import jinja2

    ckpt, _ = setup
    folder = tmp_path / "jinja"
    shutil.copytree(ckpt, folder)
    (folder / "chat_template.jinja").write_text(NO_SYSTEM)
    for path, template in ((ckpt, TEMPLATE), (folder, NO_SYSTEM)):
        tok = transformers.AutoTokenizer.from_pretrained(path)
        config = json.loads((path / "tokenizer_config.json").read_text())
        assert read_chat_template(path, config) == template
        for chat in CHATS:
            if template == NO_SYSTEM and chat[0]["role"] == "system":
                with pytest.raises(jinja2.exceptions.TemplateError, match="no system"):
                    render_chat(template, chat, eos_token="Ā")
                continue
            for gen, cont in ((True, False), (False, False), (False, True)):
                if cont and chat[-1]["role"] != "assistant":
                    continue
                want = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen,
                                               continue_final_message=cont)
                got = render_chat(template, chat, add_generation_prompt=gen, continue_final_message=cont,
                                  eos_token=tok.eos_token)
                assert got == want, (chat, gen, cont)
    named = {"chat_template": [{"name": "default", "template": TEMPLATE}, {"name": "plain", "template": NO_SYSTEM}]}
    assert read_chat_template(tmp_path, named) == {"default": TEMPLATE, "plain": NO_SYSTEM}
    with pytest.raises(ConfigError, match="chat_template must be"):
        read_chat_template(tmp_path, {"chat_template": 3})


def evaluate(model, tasks_dir):
    import lm_eval
    from lm_eval.tasks import TaskManager

    tm = TaskManager(include_path=str(tasks_dir), include_defaults=False)
    return lm_eval.simple_evaluate(model=model, tasks=TASKS, task_manager=tm, bootstrap_iters=0, log_samples=True,
                                   num_fewshot=2, apply_chat_template=True, fewshot_as_multiturn=True,
                                   random_seed=0, numpy_random_seed=0, fewshot_random_seed=0)


def samples(out, task):
    return sorted(out["samples"][task], key=lambda s: s["doc_id"])


@pytest.fixture(scope="module")
def chat_runs(setup):
    from lm_eval.models.huggingface import HFLM

    from moejax.evaluation.lm_eval import MoejaxLM

    ckpt, tasks = setup
    return (evaluate(HFLM(pretrained=str(ckpt), dtype="float32", batch_size=4, device="cpu"), tasks),
            evaluate(MoejaxLM(pretrained=str(ckpt), dtype="float32", batch_size=4), tasks))


def test_chat_requests_loglikelihoods_and_generations_equal_the_hf_backend(chat_runs):
    """With --apply_chat_template --fewshot_as_multiturn and two shots: the same prompts (each the
    template's multi-turn chat), the same log-likelihoods and greedy flags, the same generations,
    the same metrics."""
    hf, mj = chat_runs
    for task in TASKS:
        want, got = samples(hf, task), samples(mj, task)
        assert len(want) == len(got) > 0
        for w, g in zip(want, got):
            assert [a[0] for a in w["arguments"]] == [a[0] for a in g["arguments"]]
            assert w["arguments"][0][0].count("U") >= 3 and "A: " in w["arguments"][0][0]   # shots as turns
            if task == "stdlib_mc":
                for (w_ll, w_greedy), (g_ll, g_greedy) in zip((r[0] for r in w["resps"]), (r[0] for r in g["resps"])):
                    assert abs(w_ll - g_ll) <= 1e-4 + 1e-6 * abs(w_ll) and w_greedy == g_greedy
            else:
                assert w["resps"] == g["resps"]
        assert hf["results"][task] == mj["results"][task]


def test_the_backend_on_a_mesh_equals_one_device(setup, chat_runs):
    """mesh_data=2, mesh_expert=4 (the 8 simulated CPU devices, expert-parallel dispatch): the same
    chat-templated requests give the single device's log-likelihoods and generations; a mesh the
    experts do not split over is refused before loading."""
    from moejax.evaluation.lm_eval import MoejaxLM

    ckpt, tasks = setup
    lm = MoejaxLM(pretrained=str(ckpt), dtype="float32", batch_size=4, mesh_data=2, mesh_expert=4)
    assert lm.model.model.layers[1].mlp.backend == "ep"
    mesh = evaluate(lm, tasks)
    one = chat_runs[1]
    for task in TASKS:
        for w, g in zip(samples(one, task), samples(mesh, task)):
            if task == "stdlib_mc":
                for (w_ll, w_greedy), (g_ll, g_greedy) in zip((r[0] for r in w["resps"]), (r[0] for r in g["resps"])):
                    assert abs(w_ll - g_ll) <= 1e-4 and w_greedy == g_greedy
            else:
                assert w["resps"] == g["resps"]
    with pytest.raises(ConfigError, match="mesh.expert=3 .* does not divide the 16 routed experts .*mesh_expert"):
        MoejaxLM(pretrained=str(ckpt), mesh_expert=3)
    with pytest.raises(ConfigError, match="mesh_data"):
        MoejaxLM(pretrained=str(ckpt), mesh_data=0)


def chat_copy(ckpt, out, jinja=None, config_template=None):
    """The checkpoint (linked) with a chat_template.jinja, or another tokenizer_config.json template."""
    out.mkdir()
    for file in ckpt.iterdir():
        if not (config_template is not None and file.name == "tokenizer_config.json"):
            (out / file.name).symlink_to(file)
    if jinja is not None:
        (out / "chat_template.jinja").write_text(jinja)
    if config_template is not None:
        config = json.loads((ckpt / "tokenizer_config.json").read_text())
        (out / "tokenizer_config.json").write_text(json.dumps(dict(config, chat_template=config_template)))
    return out


MALFORMED = "{% for m in messages %}\n{{ m['content'] }\n{% endfor %}"   # line 2: "}" for "}}"
FAILING = "{{ raise_exception('this template renders nothing') }}"


def test_a_malformed_or_failing_chat_template_is_one_config_error(setup, tmp_path, caplog):
    """A template that does not parse (from chat_template.jinja or tokenizer_config.json) is one
    ConfigError naming the file and jinja's message and line, never jinja2's TemplateSyntaxError,
    and without the "trying again without the system role" warning (no chat can render it); a
    template that raises on a chat with a system message is tried again without it (the hf
    backend's text, one warning), and when that fails too the ConfigError names both failures; on a
    chat without a system message there is nothing to retry (no warning)."""
    import logging

    from lm_eval.models.huggingface import HFLM

    from moejax.evaluation.lm_eval import MoejaxLM

    ckpt, _ = setup
    caplog.set_level(logging.WARNING)
    model = MoejaxLM(pretrained=str(ckpt)).model  # (loaded once, shared)
    jinja = chat_copy(ckpt, tmp_path / "jinja", jinja=MALFORMED)
    in_config = chat_copy(ckpt, tmp_path / "in_config", config_template=MALFORMED)
    for folder, source in ((jinja, f"{jinja / 'chat_template.jinja'}"),
                           (in_config, f"{in_config / 'tokenizer_config.json'} (chat_template)")):
        lm = MoejaxLM(pretrained=str(folder), model=model)
        for chat in CHATS[:2]:   # (the second with a system message)
            with pytest.raises(ConfigError, match=re.escape(f"{source}: the chat template does not parse: jinja2 "
                                                            "TemplateSyntaxError at line 2: unexpected '}'")):
                lm.apply_chat_template(chat)
    with pytest.raises(ConfigError, match="my.jinja: the chat template does not parse"):
        render_chat(MALFORMED, CHATS[0], template_source="my.jinja")
    assert not caplog.records, [r.getMessage() for r in caplog.records]

    no_system = chat_copy(ckpt, tmp_path / "no_system", jinja=NO_SYSTEM)
    lm = MoejaxLM(pretrained=str(no_system), model=model)
    hf = HFLM(pretrained=str(no_system), dtype="float32", device="cpu")
    for _ in range(2):
        assert lm.apply_chat_template(CHATS[1]) == hf.apply_chat_template(CHATS[1])
    ours = [r.getMessage() for r in caplog.records if r.name == "moejax.evaluation.lm_eval"]
    assert len(ours) == 1 and "rendered it without the system role" in ours[0] and "no system" in ours[0], ours

    failing = chat_copy(ckpt, tmp_path / "failing", jinja=FAILING)
    lm = MoejaxLM(pretrained=str(failing), model=model)
    caplog.clear()
    where = re.escape(f"{failing / 'chat_template.jinja'}: the chat template failed on the chat (jinja2 TemplateError: "
                      "this template renders nothing)")
    with pytest.raises(ConfigError, match=where + r", and again without its system message \(jinja2 TemplateError"):
        lm.apply_chat_template(CHATS[1])
    with pytest.raises(ConfigError, match=where + "$"):
        lm.apply_chat_template(CHATS[0])
    assert not caplog.records
