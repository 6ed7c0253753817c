"""Generation with a preallocated KV cache: one jitted prefill, then a jitted decode loop.

    out = generate(model, input_ids, attention_mask, max_new_tokens=128)   # or Generator(model)(...)

Any model that offers three methods can generate (every family's are in `moejax.models.causal_lm`):

    model.init_cache(batch, length) -> cache                  # preallocated, `length` columns
    model.prefill(ids_BP, positions_BP, mask_BP, cache, variant) -> (logits [B, 1, V], cache)
    model.decode_step(ids_B1, positions_B1, cache, column, variant) -> (logits [B, 1, V], cache)

Layout and semantics are transformers' `generate` for a decoder-only model: prompts are
left-padded (attention_mask 0 on the left), each real token's rope position is the number of real
tokens before it, the result is `[B, prompt_len + max_new_tokens]` int32 with the prompt first,
and once a row stops (a stop token id, which is kept, or a stop sequence) every later position
holds the pad id. Greedy when temperature == 0; otherwise temperature, then top-k, then top-p
(transformers' warper order and rules), sampled with a key folded from (seed, step), so a run is
reproducible whatever the chunking.

The decode loop runs inside one `lax.while_loop` (no Python per token). Stop sequences are
strings, so they are checked on the host between chunks of `check_every` tokens; tokens past the
stop are then replaced by the pad id.
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moejax.errors import ConfigError
from moejax.models.variant import check_variant


class Sampling(NamedTuple):
    """How the next token is chosen (static: part of the compiled decode loop)."""

    temperature: float = 0.0      # 0: greedy (argmax)
    top_k: int | None = None      # keep the k largest logits
    top_p: float | None = None    # keep the smallest set of tokens whose probability exceeds top_p

    def validate(self) -> None:
        if not (_is_number(self.temperature) and np.isfinite(self.temperature) and self.temperature >= 0):
            raise ConfigError(f"temperature={self.temperature!r}; expected a finite number >= 0 (0 = greedy)")
        if self.top_k is not None and (isinstance(self.top_k, bool) or not isinstance(self.top_k, (int, np.integer))
                                       or self.top_k < 1):  # numpy integers too (np.bool_ is not one)
            raise ConfigError(f"top_k={self.top_k!r}; expected None or an integer >= 1")
        if self.top_p is not None and not (_is_number(self.top_p) and 0 < self.top_p <= 1):
            raise ConfigError(f"top_p={self.top_p!r}; expected None or a number in (0, 1]")

    def checked(self) -> "Sampling":
        """Validated, as plain Python numbers (it is a static argument of the compiled loop)."""
        self.validate()
        return Sampling(float(self.temperature), None if self.top_k is None else int(self.top_k),
                        None if self.top_p is None else float(self.top_p))


def _is_number(x) -> bool:
    """A real number, numpy's included; not a bool (True is no temperature) and not a string."""
    return not isinstance(x, (bool, np.bool_)) and isinstance(x, (int, float, np.integer, np.floating))


def _is_integer(x) -> bool:
    return not isinstance(x, (bool, np.bool_)) and isinstance(x, (int, np.integer))


SEEDS = 2 ** 32  # a JAX PRNG key keeps 32 bits of an integer seed (without x64): 2**32 draws as 0 does


def check_seed(seed, name: str = "seed") -> int:
    """`seed` as an int, or a ConfigError: an integer in [0, 2**32), since a larger one (or a
    negative one) would silently repeat another seed's draws, and past 2**63 fails inside JAX."""
    if not _is_integer(seed) or not 0 <= seed < SEEDS:
        raise ConfigError(f"{name}={seed!r}; expected an integer in [0, 2**32) (a JAX PRNG key keeps 32 bits: "
                          "other seeds would repeat these seeds' draws)")
    return int(seed)


def check_token_ids(values, name: str, vocab_size: int) -> list[int]:
    """A token id or a sequence of them, as ints, each in [0, vocab_size); else a ConfigError
    naming the setting (an id the model cannot emit never stops a row)."""
    ids = [values] if _is_integer(values) else values
    if not isinstance(ids, (list, tuple, np.ndarray)) or not all(_is_integer(v) and 0 <= v < vocab_size for v in ids):
        raise ConfigError(f"{name}={values!r}; expected token ids (integers) in [0, vocab_size={vocab_size})")
    return [int(v) for v in ids]


def filtered_logits(logits_BV: jax.Array, sampling: Sampling) -> jax.Array:
    """logits / temperature with -inf outside the tokens top-k and top-p keep, in transformers'
    order (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper): top-k keeps every token
    not below the k-th largest; top-p sorts ascending and drops the tokens whose cumulative
    probability is <= 1 - top_p, always keeping the most likely one."""
    x = logits_BV.astype(jnp.float32) / sampling.temperature
    if sampling.top_k is not None and sampling.top_k < x.shape[-1]:
        kth = jax.lax.top_k(x, sampling.top_k)[0][..., -1:]
        x = jnp.where(x < kth, -jnp.inf, x)
    if sampling.top_p is not None and sampling.top_p < 1:
        order = jnp.argsort(x, axis=-1)                                       # ascending
        sorted_x = jnp.take_along_axis(x, order, axis=-1)
        cumulative = jnp.cumsum(jax.nn.softmax(sorted_x, axis=-1), axis=-1)
        drop_sorted = (cumulative <= 1 - sampling.top_p).at[..., -1].set(False)
        drop = jnp.zeros_like(drop_sorted).at[jnp.arange(x.shape[0])[:, None], order].set(drop_sorted)
        x = jnp.where(drop, -jnp.inf, x)
    return x


def next_tokens(logits_BV: jax.Array, key: jax.Array, sampling: Sampling) -> jax.Array:
    """int32 [B]: argmax when greedy, else a draw from softmax(filtered_logits)."""
    if sampling.temperature == 0:
        return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, filtered_logits(logits_BV, sampling), axis=-1).astype(jnp.int32)


# --- the driver ----------------------------------------------------------------------------------


def check_prompts(input_ids, attention_mask, max_new_tokens, vocab_size: int, max_positions: int):
    """(ids int32 [B, P], mask int32 [B, P]) after checking everything generation relies on,
    before any compute: integer ids inside the vocabulary, a 0/1 mask of the same shape with the
    padding on the left (the last column real in every row), max_new_tokens >= 1, and the longest
    prompt plus max_new_tokens within max_position_embeddings."""
    ids = np.asarray(input_ids)
    if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer) or 0 in ids.shape:
        raise ConfigError(f"input_ids: expected integer token ids [batch >= 1, prompt_len >= 1], got {ids.dtype} "
                          f"{list(ids.shape)}")
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        raise ConfigError(f"input_ids: token ids must lie in [0, vocab_size={vocab_size}); got "
                          f"[{ids.min()}, {ids.max()}]")
    mask = np.ones(ids.shape, np.int32) if attention_mask is None else np.asarray(attention_mask)
    if mask.shape != ids.shape or not np.isin(mask, (0, 1)).all():
        raise ConfigError(f"attention_mask: expected 0/1 of shape {list(ids.shape)}, got {mask.dtype} "
                          f"{list(mask.shape)}")
    if not mask[:, -1].all():
        rows = np.flatnonzero(mask[:, -1] == 0).tolist()
        raise ConfigError(f"attention_mask: rows {rows} end in padding; generation needs prompts padded on the "
                          "left (the last column real in every row)")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens={max_new_tokens!r}; expected an integer >= 1")
    longest = int(mask.sum(1).max())
    if longest + max_new_tokens > max_positions:
        raise ConfigError(f"generation past the context limit: the longest prompt has {longest} tokens, "
                          f"+ max_new_tokens={max_new_tokens} = {longest + max_new_tokens} > "
                          f"max_position_embeddings={max_positions}")
    return ids.astype(np.int32), mask.astype(np.int32)


class Generator:
    """A model's compiled prefill and decode loop, kept for reuse: each call with new shapes
    (batch, prompt length, max_new_tokens) or new sampling settings compiles once, later calls
    with the same shapes run at once. `generate(model, ...)` builds one per call; keep a Generator when
    generating repeatedly (the lm-eval backend does). It captures the weights as they are now."""

    def __init__(self, model):
        self.model = model
        graphdef, self.state = nnx.split(model)

        @functools.partial(jax.jit, static_argnums=0)
        def prefill(length: int, state, ids_BP, positions_BP, mask_BP, variant):
            m = nnx.merge(graphdef, state)
            out = m.prefill(ids_BP, positions_BP, mask_BP, m.init_cache(ids_BP.shape[0], length), variant)
            return out.logits_BSV[:, 0], out.cache

        @functools.partial(jax.jit, static_argnums=0)
        def decode(sampling: Sampling, state, cache, logits_BV, tokens_BS, done_B, step, end, prompt_len,
                   next_position_B, variant, key, stop_ids, pad_id):
            """Decode steps step..end-1 (fewer once every row is done): sample a token from the
            carried logits, write it, run it through the model for the next logits."""
            m = nnx.merge(graphdef, state)

            def cond(carry):
                i, _, _, done, _ = carry
                return (i < end) & ~jnp.all(done)

            def body(carry):
                i, tokens, logits, done, cache = carry
                token = jnp.where(done, pad_id, next_tokens(logits, jax.random.fold_in(key, i), sampling))
                tokens = jax.lax.dynamic_update_slice(tokens, token[:, None], (0, i))
                done = done | jnp.isin(token, stop_ids)
                out = m.decode_step(token[:, None], (next_position_B + i)[:, None], cache, prompt_len + i,
                                    variant)
                return i + 1, tokens, out.logits_BSV[:, 0], done, out.cache

            return jax.lax.while_loop(cond, body, (step, tokens_BS, logits_BV, done_B, cache))

        self._prefill, self._decode = prefill, decode

    def __call__(self, input_ids, attention_mask=None, *, max_new_tokens: int, variant=None,
                 temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None, seed: int = 0,
                 stop_token_ids=None, pad_token_id: int | None = None, stop_sequences=None,
                 decode: Callable[[list[int]], str] | None = None, check_every: int = 16) -> np.ndarray:
        """Prompt then continuation, int32 [B, P + max_new_tokens] (module docstring).

        variant: a pruning as bool [num_hidden_layers, E] (True = kept; pruned experts are never
        routed to) or {MoE layer: ExpertMap} (pruned or merged experts; moejax.models.variant.check_variant).
        stop_token_ids: a row ends after it emits one of them (it is kept); ids in [0, vocab_size).
        seed: an integer in [0, 2**32) (`check_seed`).
        pad_token_id: fills every position after a row stops (default: config pad_token_id, else
        the first stop token id, else 0). stop_sequences + decode (token ids -> text): a row also
        ends once its decoded continuation contains one of the strings; the tokens after the
        shortest prefix that contains it become pad."""
        cfg = self.model.config
        sampling = Sampling(temperature, top_k, top_p).checked()
        seed = check_seed(seed)
        ids, mask = check_prompts(input_ids, attention_mask, max_new_tokens, cfg.vocab_size,
                                  cfg.max_position_embeddings)
        if stop_sequences and decode is None:
            raise ConfigError("stop_sequences need `decode` (token ids -> text) to be checked")
        stops = [] if stop_token_ids is None else check_token_ids(stop_token_ids, "stop_token_ids", cfg.vocab_size)
        if pad_token_id is None:
            pad_token_id = cfg.raw.get("pad_token_id")
            pad_token_id = pad_token_id if isinstance(pad_token_id, int) else (stops[0] if stops else 0)
        elif not _is_integer(pad_token_id):
            raise ConfigError(f"pad_token_id={pad_token_id!r}; expected one token id (an integer)")
        else:
            pad_token_id = check_token_ids(pad_token_id, "pad_token_id", cfg.vocab_size)[0]
        masks = check_variant(variant, cfg)

        B, P = ids.shape
        n_new = int(max_new_tokens)
        positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0).astype(np.int32)
        logits, cache = self._prefill(P + n_new, self.state, jnp.asarray(ids), jnp.asarray(positions), jnp.asarray(mask),
                                      masks)
        tokens = jnp.full((B, n_new), pad_token_id, jnp.int32)
        done = jnp.zeros((B,), bool)
        step = 0
        stop_ids = jnp.asarray(stops or [-1], jnp.int32)
        key = jax.random.PRNGKey(seed)
        next_position = jnp.asarray(positions[:, -1] + 1)
        while step < n_new:
            end = min(n_new, step + check_every) if stop_sequences else n_new
            step, tokens, logits, done, cache = self._decode(sampling, self.state, cache, logits, tokens, done, step,
                                                             end, P, next_position, masks, key, stop_ids,
                                                             pad_token_id)
            step = int(step)
            if stop_sequences:
                tokens, done = _stop_at_sequences(np.asarray(tokens), np.asarray(done), step, stop_sequences,
                                                  decode, pad_token_id)
                tokens, done = jnp.asarray(tokens), jnp.asarray(done)
            if bool(jnp.all(done)):
                break
        return np.concatenate([ids, np.asarray(tokens, np.int32)], axis=1)


def generate(model, input_ids, attention_mask=None, **kw) -> np.ndarray:
    """One generation call (compiles for these shapes): `Generator(model)(...)`."""
    return Generator(model)(input_ids, attention_mask, **kw)


def _stop_at_sequences(tokens_BS, done_B, n_done: int, stop_sequences, decode, pad_id):
    """Rows not yet done whose text contains a stop sequence: keep the shortest prefix of tokens
    whose text contains it, pad the rest, mark the row done."""
    tokens_BS, done_B = tokens_BS.copy(), done_B.copy()
    for b in np.flatnonzero(~done_B):
        row = tokens_BS[b, :n_done].tolist()
        if not any(s in decode(row) for s in stop_sequences):
            continue
        n = next(n for n in range(1, len(row) + 1) if any(s in decode(row[:n]) for s in stop_sequences))
        tokens_BS[b, n:] = pad_id
        done_B[b] = True
    return tokens_BS, done_B
