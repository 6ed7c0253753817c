"""A checkpoint's chat template, read and rendered as transformers reads and renders it, for the
lm-eval backend's `--apply_chat_template` (and `--fewshot_as_multiturn`).

Where the template is (transformers' order): `chat_template.jinja` (and named ones in
`additional_chat_templates/NAME.jinja`) before tokenizer_config.json's `chat_template` (a string,
or a list of {"name", "template"}). Several templates are a dict by name ("default" the one used
when none is named).

Rendering: a sandboxed Jinja environment with trim_blocks and lstrip_blocks, `loopcontrols`, a
`{% generation %}` block that renders its body, `tojson` without HTML escaping, `raise_exception`
and `strftime_now`; the template sees `messages`, `add_generation_prompt`, the tokenizer's special
tokens as text (`bos_token`, `eos_token`, ...) and any extra arguments. `continue_final_message`
cuts the text after the last message's content, so a continuation is scored against the
assistant turn the template opened. A template that does not parse is a ConfigError naming where
it came from (`chat_template_source`) with jinja's message and line; one that raises while
rendering a chat raises jinja's TemplateError, as transformers does (the caller decides whether to
retry). Needs jinja2 (lm-eval's dependency; 3.1.6 or later, as transformers requires, for its
sandbox fixes). Tested against transformers' `apply_chat_template` and lm-eval's `hf` backend
(tests/test_lm_eval_chat.py).
"""

from __future__ import annotations

import datetime
import functools
import json
from pathlib import Path

from moejax.errors import ConfigError

TEMPLATE_FILE = "chat_template.jinja"
TEMPLATE_DIR = "additional_chat_templates"
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def read_chat_template(folder: Path, tokenizer_config: dict) -> str | dict | None:
    """The checkpoint's chat template: a string, {name: template} for several, or None."""
    templates = {}
    if (folder / TEMPLATE_FILE).is_file():
        templates["default"] = (folder / TEMPLATE_FILE).read_text(encoding="utf-8")
    if (folder / TEMPLATE_DIR).is_dir():
        for file in sorted((folder / TEMPLATE_DIR).glob("*.jinja")):
            templates[file.stem] = file.read_text(encoding="utf-8")
    if templates:
        return templates["default"] if list(templates) == ["default"] else templates
    value = tokenizer_config.get("chat_template")
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(t, dict) and {"name", "template"} <= set(t) for t in value):
        return {t["name"]: t["template"] for t in value}
    raise ConfigError(f"{folder / 'tokenizer_config.json'}: chat_template must be a string or a list of "
                      f"{{'name', 'template'}} objects, got {type(value).__name__}")


def chat_template_source(folder: Path, name: str = "default") -> str:
    """Where `read_chat_template` found the template called `name`, for error messages: a .jinja
    file, or tokenizer_config.json's `chat_template`."""
    folder = Path(folder)
    if name == "default" and (folder / TEMPLATE_FILE).is_file():
        return str(folder / TEMPLATE_FILE)
    if (folder / TEMPLATE_DIR / f"{name}.jinja").is_file():
        return str(folder / TEMPLATE_DIR / f"{name}.jinja")
    return f"{folder / 'tokenizer_config.json'} (chat_template{'' if name == 'default' else ' ' + repr(name)})"


def special_token_texts(tokenizer_config: dict) -> dict:
    """{bos_token: text, ...} of the special tokens tokenizer_config.json names (the template's
    variables of those names)."""
    out = {}
    for name in SPECIAL_TOKENS:
        value = tokenizer_config.get(name)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            out[name] = value
    return out


@functools.lru_cache(maxsize=8)
def _compiled(template: str):
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    if tuple(int(p) for p in jinja2.__version__.split(".")[:3] if p.isdigit()) < (3, 1, 6):
        raise ConfigError(f"chat templates need jinja2 >= 3.1.6 (sandbox fixes); found {jinja2.__version__}")

    class Generation(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask marker): the body."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(template)


def compile_chat_template(template: str, source: str = "chat template"):
    """The template compiled (cached), or a ConfigError naming `source` (where it came from) with
    jinja's message and line when it does not parse: no chat can render it, so no retry helps."""
    import jinja2

    try:
        return _compiled(template)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ConfigError(f"{source}: the chat template does not parse: jinja2 {type(e).__name__} at line "
                          f"{e.lineno}: {e.message}") from None


def render_chat(template: str, messages: list[dict], *, add_generation_prompt: bool = False,
                continue_final_message: bool = False, template_source: str = "chat template",
                **variables) -> str:
    """The chat as text (module docstring). A template that does not parse is a ConfigError naming
    `template_source` (where the template came from); one that raises on this chat raises jinja2's
    TemplateError as transformers does (lm-eval's `hf` backend then retries without the system
    message)."""
    compiled = compile_chat_template(template, template_source)
    messages = [dict(m) for m in messages]
    if continue_final_message:
        if not messages or not isinstance(messages[-1].get("content"), str):
            raise ValueError("continue_final_message needs a last message with text content")
        final = messages[-1]["content"]
        messages[-1]["content"] = final + _CONTINUE_TAG
    text = compiled.render(messages=messages, add_generation_prompt=add_generation_prompt, tools=None,
                           documents=None, **variables)
    if continue_final_message:
        if final.strip() not in text or _CONTINUE_TAG.strip() not in text:
            raise ValueError("continue_final_message: the chat template dropped part of the final message")
        at = text.rindex(_CONTINUE_TAG.strip())
        text = text[:at] if text[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:at].rstrip()
    return text
