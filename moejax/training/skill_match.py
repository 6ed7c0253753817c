"""Greedy exact match of a model on skills documents (moejax.training.skills), for train_tiny's
learning curve: each prompt left-padded into one batch, decoded greedily with the KV cache
(moejax.inference.generate) until the terminator; a document counts when the text before the first
terminator equals the answer *and* the terminator was emitted."""

from __future__ import annotations

import numpy as np

from moejax.training.skills import TERMINATOR


def exact_match(model, docs: dict) -> dict:
    """{skill: share of its (prompt, answer) pairs that greedy decoding completes exactly}."""
    from moejax.inference.generate import generate

    pairs = [(skill, p, a) for skill, ds in docs.items() for p, a in ds]
    prompts = [list(p.encode("utf-8")) for _, p, _ in pairs]
    P = max(map(len, prompts))
    n_new = max(len(a.encode("utf-8")) for _, _, a in pairs) + len(TERMINATOR)
    ids = np.zeros((len(pairs), P), np.int32)
    mask = np.zeros((len(pairs), P), np.int32)
    for i, p in enumerate(prompts):
        ids[i, P - len(p):], mask[i, P - len(p):] = p, 1
    out = generate(model, ids, mask, max_new_tokens=n_new, stop_token_ids=[ord(TERMINATOR)], pad_token_id=0)
    hits: dict = {}
    for (skill, _, answer), row in zip(pairs, out[:, P:]):
        text = bytes(int(t) for t in row if t != 0).decode("utf-8", errors="replace")
        hits.setdefault(skill, []).append(text == answer + TERMINATOR)
    return {skill: float(np.mean(h)) for skill, h in hits.items()}
