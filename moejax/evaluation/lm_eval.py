"""lm-evaluation-harness backend `moejax`: evaluate a checkpoint, or a pruned or merged variant of it
given as expert masks or expert maps (no checkpoint written), on any lm-eval task.

    from moejax.evaluation.lm_eval import MoejaxLM
    lm = MoejaxLM(pretrained=PATH, dtype="float32", batch_size=8)              # the whole model
    lm = MoejaxLM(pretrained=PATH, scores="scores.parquet", score="reap", keep=0.5)   # a variant
    lm = MoejaxLM(pretrained=PATH, pruning="pruned/pruning.json")               # `moejax prune`'s set
    lm_eval.simple_evaluate(model=lm, tasks=["gsm8k"])

and from the command line (`moejax-lm-eval` registers the model, then is lm-eval's own CLI):

    moejax-lm-eval run --model moejax --model_args pretrained=PATH,dtype=float32 --tasks gsm8k

Semantics follow lm-eval's own `hf` backend, so that the numbers agree with it
(shared/reference/lm-eval-notes.md): the checkpoint's tokenizer.json encodes with its special
tokens (a BOS where the tokenizer adds one), empty contexts and rolling windows are conditioned
on the prefix token (prefix_token_id=, else the tokenizer's own BOS, else its EOS: config.json's
bos_token_id is not read, as transformers' tokenizer does not read it; a Qwen3 tokenizer has no
BOS), requests are sorted longest first with lm-eval's own Collator, inputs longer than
max_length (config.json max_position_embeddings) are truncated on the left, and generate_until
stops at the EOS token id as well as at the stop strings, greedy unless the task samples, the
reasoning cut off after think_end_token when one is given. Differences: sequence lengths are
padded up to a few buckets (powers of two) and batches to batch_size, so a task compiles a
handful of shapes; log-softmax and the gather of the continuation's log-probabilities run
inside the compiled forward, so only [batch, length] numbers leave it; requests that share a
context and differ only in a one-token continuation are computed separately (the `hf` backend
reuses one forward for them: same numbers, more work here).
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import jinja2
import numpy as np
from tokenizers import Tokenizer as HFTokenizer
from tqdm import tqdm

from moejax.errors import ConfigError, MoejaxError
from moejax.evaluation.chat_template import (chat_template_source, read_chat_template, render_chat,
                                             special_token_texts)
from moejax.inference.generate import SEEDS, Generator, Sampling, check_seed
from moejax.inference.nll import compiled_scorer
from moejax.hf.model_io import load_pretrained
from moejax.models.registry import read_config
from moejax.models.variant import check_variant
from moejax.parallel.mesh import MeshConfig, make_mesh
from moejax.variants import check as variant

try:
    import lm_eval.models  # noqa: F401  (before registering: see lm-eval-notes.md)
    from lm_eval import utils as lm_utils
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model
    from lm_eval.models.utils import Collator, handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
except ImportError as e:  # pragma: no cover - the message is the point
    raise ImportError(f"moejax.evaluation.lm_eval needs lm-eval: pip install 'moejax[eval]' ({e})") from None

log = logging.getLogger(__name__)

BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)


def bucket(n: int, cap: int) -> int:
    """The smallest bucket length >= n (at most cap, and never below n)."""
    return max(n, min(next((b for b in BUCKETS if b >= n), n), cap))


class LmEvalTokenizer:
    """A checkpoint's tokenizer.json (the `tokenizers` package, as transformers' fast tokenizers
    wrap it) with the special tokens its tokenizer_config.json names: the tokenizer as lm-eval's
    `hf` backend sees it (special tokens added on request, `split_special_tokens`, BOS / EOS / pad
    ids, decode, the chat template). Not `moejax.data.Tokenizer`, which encodes calibration text:
    never a special token, with tiktoken and byte-level fallbacks where this one refuses."""

    def __init__(self, path: Path, config: dict):
        file = path / "tokenizer.json"
        if not file.is_file():
            raise ConfigError(f"{path}: no tokenizer.json; lm-eval tasks are text, so the checkpoint needs its "
                              "tokenizer (a train_tiny checkpoint writes a byte-level one)")
        self.tok = HFTokenizer.from_file(str(file))
        settings = {}
        if (path / "tokenizer_config.json").is_file():
            settings = json.loads((path / "tokenizer_config.json").read_text(encoding="utf-8"))
        # transformers' split_special_tokens: special-token text in a prompt is encoded as text
        self.tok.encode_special_tokens = bool(settings.get("split_special_tokens", False))
        self.name_or_path = str(path)
        self.chat_template = read_chat_template(path, settings)   # lm-eval's TemplateLM.chat_template reads these
        self.chat_template_source = chat_template_source(path)
        self.default_chat_template = None
        self.special_token_texts = special_token_texts(settings)

        def special(name, from_config=True):
            value = settings.get(name)
            value = value.get("content") if isinstance(value, dict) else value
            if isinstance(value, str):
                token_id = self.tok.token_to_id(value)
                if token_id is None:
                    raise ConfigError(f"{path / 'tokenizer_config.json'}: {name}={value!r} is not in tokenizer.json")
                return token_id
            token_id = config.get(f"{name}_id") if from_config else None
            return token_id if isinstance(token_id, int) else None

        # the BOS is the tokenizer's own, as transformers' tokenizer has it (the hf backend's
        # prefix token): a Qwen3 tokenizer has none (bos_token: null) though its config.json names a
        # bos_token_id, and lm-eval then conditions on the EOS
        self.eos_id, self.pad_id = special("eos_token"), special("pad_token")
        self.bos_id = special("bos_token", from_config=False)
        if self.eos_id is None:
            raise ConfigError(f"{path}: no eos_token in tokenizer_config.json and no eos_token_id in config.json")
        self.bos_text = self.special_token_texts.get("bos_token")   # transformers' tokenizer.bos_token

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        ids = [ids] if isinstance(ids, int) else list(ids)
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


@register_model("moejax")
class MoejaxLM(TemplateLM):
    """lm-eval model `moejax` (module docstring). Arguments as lm-eval's `model_args`:

    pretrained: checkpoint folder (config.json, safetensors, tokenizer.json)
    dtype: float32 | bfloat16; batch_size: requests per forward (an integer; not "auto")
    max_length: context length (default config.json max_position_embeddings)
    max_gen_toks: default new tokens for generate_until (tasks usually set their own)
    pruning: a `pruning.json` (or the folder holding it) of `moejax prune` on this checkpoint (a
        merge's record is refused: evaluate the merged checkpoint as pretrained=)
    scores + score + keep: a `moejax score` parquet, a score name in it, a count or ratio of E
    (a record or scores file made from another checkpoint is refused: `moejax.hf.provenance`)
    seed: for tasks that sample (an integer in [0, 2**32))
    mesh_data + mesh_expert: run on a data x expert mesh of the devices (expert-parallel "ep"
        dispatch, each device reading only its experts: `from_pretrained(..., mesh=)`); default 1 x 1,
        one device without a mesh
    prefix_token_id: the token empty contexts and the first rolling window are conditioned on
        (default: the tokenizer's BOS, else its EOS; as the hf backend)
    enable_thinking: true/false, passed to the chat template (as the hf backend's `enable_thinking`);
        true needs think_end_token, and refuses loglikelihood tasks (as the hf backend)
    think_end_token: the end of the reasoning in generations (a token id, or its text): each
        generation keeps only what follows its last occurrence (as the hf backend)
    add_bos_token: true/false, whether to encode with the tokenizer's special tokens (default: yes)
    Booleans are true/false/1/0 (any case), anything else refused by name.
    With `--apply_chat_template` (and `--fewshot_as_multiturn`) prompts are rendered with the
    checkpoint's chat template (`moejax.evaluation.chat_template`), as the hf backend renders them.
    Integers are refused out of range (max_length, batch_size, max_gen_toks >= 1), as is a task
    asking to sample (do_sample=True) at a temperature <= 0, before any request runs.
    """

    def __init__(self, pretrained: str, dtype: str = "float32", batch_size: int | str = 8, max_length=None,
                 max_gen_toks: int = 256, pruning: str | None = None, scores: str | None = None,
                 score: str | None = None, keep=None, seed: int = 0, add_bos_token: bool | None = None,
                 mesh_data=1, mesh_expert=1, enable_thinking=None, think_end_token=None, prefix_token_id=None,
                 device: str | None = None, max_batch_size=None, variant=None, model=None, **unused):
        super().__init__()
        if unused:
            raise ConfigError(f"moejax lm-eval model: unknown model_args {sorted(unused)}; valid: pretrained, "
                              "dtype, batch_size, max_length, max_gen_toks, pruning, scores, score, keep, seed, "
                              "add_bos_token, prefix_token_id, mesh_data, mesh_expert, enable_thinking, "
                              "think_end_token")
        path = Path(pretrained).expanduser()
        if not (path / "config.json").is_file():
            raise ConfigError(f"moejax lm-eval model: {path} has no config.json (pretrained= must be a local "
                              "checkpoint folder)")
        if dtype not in ("float32", "bfloat16"):
            raise ConfigError(f"moejax lm-eval model: dtype={dtype!r}; expected float32 or bfloat16")
        self._batch_size = _int_arg("batch_size", batch_size, 1, " (compiled shapes are fixed, so 'auto' is not "
                                    "offered)")
        if device not in (None, "cpu", "cuda", "gpu", "tpu") and not str(device).startswith("cuda"):
            raise ConfigError(f"moejax lm-eval model: device={device!r}; JAX places the model on its default "
                              "backend (set JAX_PLATFORMS to choose)")
        config = read_config(path / "config.json", uniform_experts=False)  # per-layer counts: as the loader reads them
        # the variant, checked before the model is loaded
        if variant is None:
            variant = self._variant_masks(config, pruning, scores, score, keep, path)
        self.expert_variant = check_variant(variant, config)
        self.tokenizer = LmEvalTokenizer(path, config.raw)
        self.add_bos_token = _bool_arg("add_bos_token", add_bos_token)
        self.enable_thinking = _bool_arg("enable_thinking", enable_thinking)
        self.think_end_token = _think_end_token(think_end_token, self.tokenizer)
        if self.enable_thinking and self.think_end_token is None:
            raise ConfigError("moejax lm-eval model: enable_thinking=true needs think_end_token (the token that "
                              "ends the reasoning, e.g. think_end_token=</think>, or its id), so that generations "
                              "are scored without their reasoning (lm-eval's hf backend requires it too)")
        self.custom_prefix_token_id = None if prefix_token_id is None else _token_id_arg(
            "prefix_token_id", prefix_token_id, self.tokenizer)
        self._prefix_text = self.tok_decode(self.prefix_token_id, skip_special_tokens=False)   # tok_encode's test
        self._max_length = config.max_position_embeddings if max_length is None else _int_arg(
            "max_length", max_length, 1, " (the context length inputs are truncated to; default "
            "max_position_embeddings)")
        self._max_gen_toks = _int_arg("max_gen_toks", max_gen_toks, 1)
        self.seed = check_seed(_int_arg("seed", seed, 0), "moejax lm-eval model: seed")
        self.chat_template_args = {} if self.enable_thinking is None else {"enable_thinking": self.enable_thinking}
        self._warned_system_retry = False
        self.mesh = self._mesh(mesh_data, mesh_expert, config, path)
        self.path = path
        self.model = model or load_pretrained(path, dtype=jnp.dtype(dtype), mesh=self.mesh)
        self._score_fn = compiled_scorer(self.model)
        self._generator = Generator(self.model)

    def variant(self, variant) -> "MoejaxLM":
        """The same model, tokenizer and compiled functions under another variant: expert masks
        (bool [num_hidden_layers, E], True = kept), {MoE layer: ExpertMap} (pruned or merged
        experts), or None (every expert): how one job evaluates many variants without reloading
        (a variant of a new kind or table size compiles once)."""
        from lm_eval.api.model import CacheHook

        cfg = self.model.config
        other = copy.copy(self)
        other.expert_variant = check_variant(variant, cfg)
        other.cache_hook = CacheHook(None)
        return other

    @staticmethod
    def _mesh(data, expert, config, path):
        """The data x expert mesh of the model args (None for 1 x 1), the experts checked to split
        over it before loading (`MeshConfig.check_experts`, as `moejax score` and `reroute` check)."""
        mesh = MeshConfig(data=_int_arg("mesh_data", data, 1), expert=_int_arg("mesh_expert", expert, 1))
        for count in sorted({config.experts_in_layer(l) for l in config.moe_layers}):
            mesh.check_experts(count, f"{path} (model_args mesh_expert)")
        return make_mesh(mesh) if mesh.n_devices > 1 else None

    def _on_mesh(self):
        """The context the compiled calls run in: the mesh (for the "ep" dispatch) when there is one."""
        return contextlib.nullcontext() if self.mesh is None else jax.set_mesh(self.mesh)

    # --- chat templates, as lm-eval's hf backend offers them --------------------------------

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name_or_path.replace("/", "__")

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The chat rendered with the checkpoint's chat template (its "default" when it has several),
        as the hf backend renders it: a template that raises on a chat holding a system message is
        tried again without it (a warning, once, when that works). A template that does not parse,
        or fails on the chat (again without its system message), is one ConfigError naming where
        the template is and jinja's message."""
        template = self.tokenizer.chat_template
        if isinstance(template, dict):
            template = template.get("default")
        if not isinstance(template, str):
            raise ConfigError(f"{self.path}: --apply_chat_template, but the checkpoint has no chat template "
                              f"({'no default among several' if self.tokenizer.chat_template else 'none'} in "
                              "chat_template.jinja or tokenizer_config.json)")
        variables = dict(self.tokenizer.special_token_texts, **self.chat_template_args)
        source = self.tokenizer.chat_template_source

        def render(history):
            return render_chat(template, history, add_generation_prompt=add_generation_prompt,
                               continue_final_message=not add_generation_prompt, template_source=source,
                               **variables)

        def failed(e):
            return f"jinja2 {type(e).__name__}: {e}"

        try:
            return render(chat_history)
        except jinja2.exceptions.TemplateError as e:
            first = e
        without_system = [m for m in chat_history if m["role"] != "system"]
        if len(without_system) == len(chat_history):
            raise ConfigError(f"{source}: the chat template failed on the chat ({failed(first)})") from None
        try:
            text = render(without_system)   # what the hf backend does when the template refuses a chat
        except jinja2.exceptions.TemplateError as e:
            raise ConfigError(f"{source}: the chat template failed on the chat ({failed(first)}), and again "
                              f"without its system message ({failed(e)})") from None
        if not self._warned_system_retry:
            log.warning("%s: the chat template refused a chat with a system message (%s); rendered it without the "
                        "system role, as lm-eval's hf backend does", source, failed(first))
            self._warned_system_retry = True
        return text

    @staticmethod
    def _variant_masks(config, pruning, scores, score, keep, checkpoint):
        if pruning is not None and (scores is not None or score is not None or keep is not None):
            raise ConfigError("moejax lm-eval model: give either pruning= or scores=/score=/keep=, not both")
        if pruning is not None:
            return variant.masks_from_pruning_record(pruning, config, checkpoint)
        if scores is None and score is None and keep is None:
            return None
        if scores is None or score is None or keep is None:
            raise ConfigError(f"moejax lm-eval model: a scored variant needs scores=FILE, score=NAME and keep=N "
                              f"together; got scores={scores!r}, score={score!r}, keep={keep!r}")
        return variant.masks_from_scores(scores, str(score), keep, config, checkpoint)

    # --- what TemplateLM asks for ------------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_id

    @property
    def prefix_token_id(self) -> int:
        """As the hf backend: prefix_token_id=, else the tokenizer's BOS, else its EOS."""
        if self.custom_prefix_token_id is not None:
            return self.custom_prefix_token_id
        return self.tokenizer.bos_id if self.tokenizer.bos_id is not None else self.tokenizer.eos_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def batch_size(self) -> int:
        return self._batch_size

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        """As the hf backend: the tokenizer's special tokens unless told otherwise (add_bos_token),
        none when the string already starts with the prefix token's text."""
        if add_special_tokens is None:
            add_special_tokens = self.add_bos_token if self.add_bos_token is not None else True
            if string.startswith(self._prefix_text):
                add_special_tokens = False
        return self.tokenizer.encode(string, add_special_tokens)

    def _encode_contexts(self, contexts) -> list[list[int]]:
        """A generation batch's contexts, encoded as the hf backend's tok_batch_encode encodes them:
        without special tokens when the first starts with the tokenizer's BOS text, else as
        add_bos_token says, else with them."""
        if self.tokenizer.bos_text is not None and contexts[0].startswith(self.tokenizer.bos_text):
            add_special_tokens = False
        else:
            add_special_tokens = self.add_bos_token if self.add_bos_token is not None else True
        return [self.tokenizer.encode(c, add_special_tokens) for c in contexts]

    def tok_decode(self, tokens, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens)

    # --- log-likelihoods ---------------------------------------------------------------------

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """TemplateLM's, refused under enable_thinking=true as the hf backend refuses it."""
        if self.enable_thinking:
            tasks = sorted({req.task_name for req in requests if getattr(req, "task_name", None)})
            raise ConfigError(f"moejax lm-eval model: enable_thinking=true scores generations only; loglikelihood "
                              f"tasks {tasks} are refused (lm-eval's hf backend refuses them too)")
        return super().loglikelihood(requests, disable_tqdm=disable_tqdm)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """(sum of the continuation's log-probabilities, whether it is the greedy continuation)
        for each (request, context tokens, continuation tokens). Identical token pairs are scored
        once (a multiple-choice task's right answer is often its log-likelihood twin's request)."""
        def longest_first(req):
            toks = req[1] + req[2]
            return -len(toks), tuple(toks)

        index = {}
        for req in requests:
            index.setdefault((tuple(req[1]), tuple(req[2])), len(index))
        unique = [(None, list(context), list(continuation)) for context, continuation in index]
        order = Collator(unique, sort_fn=longest_first)
        results = []
        bar = tqdm(total=len(unique), disable=disable_tqdm, desc="moejax loglikelihood")
        for chunk in order.get_batched(n=self.batch_size):
            results.extend(self._score_batch(chunk))
            bar.update(len(chunk))
        bar.close()
        scored = order.get_original(results)
        return [scored[index[(tuple(req[1]), tuple(req[2]))]] for req in requests]

    def _score_batch(self, chunk) -> list[tuple[float, bool]]:
        rows = []
        for _, context, continuation in chunk:
            if not context or not continuation:
                raise ConfigError(f"lm-eval request with an empty context or continuation: {context!r}, "
                                  f"{continuation!r}")
            whole = (context + continuation)[-(self.max_length + 1):]  # left-truncated as the hf backend
            rows.append((whole, len(continuation)))
        length = bucket(max(len(w) - 1 for w, _ in rows), self.max_length)
        B = self.batch_size
        ids = np.zeros((B, length), np.int32)
        targets = np.zeros((B, length), np.int32)
        for b, (whole, _) in enumerate(rows):
            ids[b, :len(whole) - 1] = whole[:-1]
            targets[b, :len(whole) - 1] = whole[1:]
        with self._on_mesh():
            logp, greedy = self._score_fn(jnp.asarray(ids), jnp.asarray(targets), self.expert_variant)
        logp, greedy = np.asarray(logp, np.float64), np.asarray(greedy)
        out = []
        for b, (whole, n_cont) in enumerate(rows):
            span = slice(len(whole) - 1 - n_cont, len(whole) - 1)
            out.append((float(logp[b, span].sum()), bool(greedy[b, span].all())))
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each text's total log-likelihood over disjoint windows of max_length tokens, each
        conditioned on the token before it (the first on the prefix token), as the hf backend."""
        windows, owner = [], []
        for i, (text,) in enumerate(req.args for req in requests):
            for window in map(lm_utils.make_disjoint_window, lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((None, *window))
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, (ll, _) in zip(owner, self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)):
            totals[i] += ll
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # --- generation --------------------------------------------------------------------------

    def _generation_settings(self, gen_kwargs: dict, eos: str) -> tuple[list[str], int, dict]:
        """(stop strings, new tokens, the generator's sampling arguments) of a request's
        generation kwargs, read as lm-eval's `hf` backend reads them, or a ConfigError for a
        setting it refuses: sampling (do_sample=True) needs a temperature > 0 (transformers
        refuses any other; moejax would otherwise decode greedily without a word)."""
        try:
            kwargs = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"generate_until: generation kwargs {gen_kwargs!r}: {e}") from None
        until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
        max_new = kwargs.pop("max_gen_toks")
        if max_new < 1:
            raise ConfigError(f"generate_until: max_gen_toks={max_new} (the task's generation kwargs, else the "
                              "model's max_gen_toks); expected an integer >= 1")
        if self.max_length - max_new < 1:
            raise ConfigError(f"generate_until: max_gen_toks={max_new} leaves no room for a prompt within "
                              f"max_length={self.max_length}")
        if not kwargs.get("do_sample"):
            return until, max_new, dict(temperature=0.0, top_k=None, top_p=None)
        temperature = float(kwargs.get("temperature", 0.0))  # (the hf backend's default too)
        if not temperature > 0:
            raise ConfigError(f"generate_until: do_sample=True with temperature={temperature}; sampling needs a "
                              "temperature > 0 (lm-eval's hf backend refuses it too, through transformers); set "
                              "do_sample=False for greedy decoding")
        sampling = dict(temperature=temperature, top_k=kwargs.get("top_k"), top_p=kwargs.get("top_p"))
        Sampling(**sampling).checked()
        return until, max_new, sampling

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy (or the task's sampling) continuations with the KV-cached generator, cut at the
        first stop string; the EOS token id always stops a row; with think_end_token, only what
        follows its last occurrence is kept (`strip_thinking`)."""
        order = Collator([req.args for req in requests], sort_fn=lambda r: (-len(self.tok_encode(r[0])), r[0]),
                         group_by="gen_kwargs", group_fn=lambda r: r[1])
        eos = self.tok_decode(self.eot_token_id, skip_special_tokens=False)
        for req in requests:  # every request's settings, before the first batch runs
            self._generation_settings(req.args[1], eos)
        results = []
        bar = tqdm(total=len(requests), disable=disable_tqdm, desc="moejax generate_until")
        for batch_index, chunk in enumerate(order.get_batched(n=self.batch_size)):
            contexts, all_kwargs = zip(*chunk)
            until, max_new, sampling = self._generation_settings(all_kwargs[0], eos)
            max_context = self.max_length - max_new
            encoded = [e[-max_context:] for e in self._encode_contexts(contexts)]
            P = bucket(max(len(e) for e in encoded), self.max_length)
            B = self.batch_size
            ids, mask = np.zeros((B, P), np.int32), np.zeros((B, P), np.int32)
            for b in range(B):
                e = encoded[b] if b < len(encoded) else encoded[0]  # a full batch: one compiled shape
                ids[b, P - len(e):], mask[b, P - len(e):] = e, 1
            with self._on_mesh():
                out = self._generator(ids, mask, max_new_tokens=max_new, variant=self.expert_variant, **sampling,
                                      seed=(self.seed * 1_000_003 + batch_index) % SEEDS,  # its own draws per batch
                                      stop_token_ids=[self.eot_token_id],
                                      pad_token_id=self.tokenizer.pad_id if self.tokenizer.pad_id is not None
                                      else self.eot_token_id,
                                      stop_sequences=[s for s in until if s], decode=self.tok_decode, check_every=8)
            for b, context in enumerate(contexts):
                text = self.strip_thinking(out[b, P:].tolist(), until)
                results.append(text)
                self.cache_hook.add_partial("generate_until", (context, all_kwargs[b]), text)
            bar.update(len(contexts))
        bar.close()
        return order.get_original(results)

    def strip_thinking(self, tokens: list[int], until: list[str]) -> str:
        """A generation's new tokens as the hf backend's generate_until turns them into the answer:
        an integer think_end_token cuts the tokens after its last occurrence (the text then
        left-stripped), a text one cuts the decoded text after its last occurrence; then the text
        stops at the first stop string."""
        think = self.think_end_token
        if isinstance(think, int):
            at = [i for i, t in enumerate(tokens) if t == think]
            if at:
                tokens = tokens[at[-1] + 1:]
        text = self.tok_decode(tokens)
        if isinstance(think, int):
            text = text.lstrip()
        return postprocess_generated_text(text, until, think if isinstance(think, str) else None)


def _bool_arg(name: str, value) -> bool | None:
    """A boolean model_arg: None, a bool, or true/false/1/0 (any case; lm-eval's command line passes
    true/false as bools and 1/0 as ints); anything else a ConfigError naming it (`ture` is not false)."""
    if value is None or isinstance(value, (bool, np.bool_)):
        return None if value is None else bool(value)
    if isinstance(value, (int, np.integer)) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in ("true", "false", "1", "0"):
        return value.strip().lower() in ("true", "1")
    raise ConfigError(f"moejax lm-eval model: {name}={value!r}; expected true, false, 1 or 0")


def _token_id_arg(name: str, value, tokenizer: LmEvalTokenizer) -> int:
    """A token id model_arg, an id of the tokenizer, or a ConfigError naming it."""
    token_id = _int_arg(name, value, 0)
    if tokenizer.tok.id_to_token(token_id) is None:
        raise ConfigError(f"moejax lm-eval model: {name}={token_id}; not a token id of {tokenizer.name_or_path}'s "
                          f"tokenizer.json ({tokenizer.tok.get_vocab_size()} tokens)")
    return token_id


def _think_end_token(value, tokenizer: LmEvalTokenizer) -> int | str | None:
    """think_end_token as the hf backend reads it: a string of digits (or an int) is a token id, any
    other string the text that ends the reasoning. Refused: an id not in the tokenizer, an empty
    text, a bool or a float (the hf backend would silently strip nothing)."""
    if value is None:
        return None
    if isinstance(value, str) and value.isdigit() or isinstance(value, (int, np.integer)) and not isinstance(
            value, (bool, np.bool_)):
        return _token_id_arg("think_end_token", value, tokenizer)
    if not isinstance(value, str) or not value:
        raise ConfigError(f"moejax lm-eval model: think_end_token={value!r}; expected the text that ends the "
                          "reasoning (e.g. </think>) or its token id")
    token_id = tokenizer.tok.token_to_id(value)
    added = tokenizer.tok.get_added_tokens_decoder()
    if token_id in added and added[token_id].special:
        log.warning("think_end_token=%r is a special token of %s: generations are decoded without special tokens, "
                    "so its text never appears and nothing is stripped (as in lm-eval's hf backend); give its id "
                    "(think_end_token=%d) instead", value, tokenizer.name_or_path, token_id)
    return value


def _int_arg(name: str, value, low: int, why: str = "") -> int:
    """A model_arg as an int >= low, or a ConfigError naming it. lm-eval's command line passes
    "-5" as -5.0, the Python API may pass strings."""
    if (isinstance(value, str) and value.strip().lstrip("-").isdigit()) or (isinstance(value, float)
                                                                            and value.is_integer()):
        value = int(value)
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < low:
        raise ConfigError(f"moejax lm-eval model: {name}={value!r}; expected an integer >= {low}{why}")
    return int(value)


# How lm-eval words its refusal of a task list (its command line: unknown names; simple_evaluate:
# an empty list; TaskManager.load: a name it cannot resolve), for `cli` to report in one line.
TASK_LIST_REFUSALS = ("Tasks not found", "No tasks specified", "Spec ")


def cli() -> None:
    """`moejax-lm-eval ...`: lm-eval's own command line with the `moejax` model registered. A task
    list lm-eval refuses (unknown or empty) and moejax's own errors (model_args) end in one line
    on stderr and exit status 2, as `moejax`'s commands do, rather than in a traceback."""
    from lm_eval.__main__ import cli_evaluate

    try:
        cli_evaluate()
    except MoejaxError as e:
        print(f"moejax-lm-eval: error: {e}", file=sys.stderr)
        sys.exit(2)
    except (ValueError, KeyError) as e:
        message = str(e.args[0]) if e.args else ""
        if not message.startswith(TASK_LIST_REFUSALS):
            raise
        print(f"moejax-lm-eval: error: {message} (`lm_eval ls tasks` lists lm-eval's tasks; --include_path "
              "adds a folder of YAML tasks)", file=sys.stderr)
        sys.exit(2)
