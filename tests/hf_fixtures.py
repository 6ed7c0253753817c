"""Tiny random DeepSeek-V3 checkpoints made by transformers (the reference we did not write).

Every parameter is made to matter: norms and balance biases randomised (transformers
initialises them to ones and zeros, which hides mapping bugs), biases partly negative, router
rows wide so routing is decisive, weights large enough that activations are not negligible.
"""

from __future__ import annotations

import contextlib
import re

import numpy as np

from moejax.hf.io.checkpoint_reader import CheckpointReader
from moejax.hf.io.checkpoint_writer import write_checkpoint
from moejax.hf.quant import encode as quant_encode

BASE = dict(
    vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=16,
    qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8, n_shared_experts=2, num_experts_per_tok=2,
    n_group=4, topk_group=2, first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
    rms_norm_eps=1e-6, max_position_embeddings=256, tie_word_embeddings=False, num_nextn_predict_layers=0,
    initializer_range=0.15,
)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
DEFAULT_ROPE = {"rope_type": "default", "rope_theta": 50000.0}


def make_checkpoint(path, seed=0, dtype="float32", max_shard_size=None, save_original_format=True, **overrides):
    """Save a random transformers DeepseekV3ForCausalLM to `path` (sharded when max_shard_size,
    e.g. "200KB", is given; save_original_format=False: transformers 5's fused expert tensors);
    returns the torch model (eval)."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    kw = {**BASE, "rope_parameters": YARN, **overrides}
    cfg = DeepseekV3Config(**kw, attn_implementation="eager", experts_implementation="eager")
    model = harden(DeepseekV3ForCausalLM(cfg).eval())
    if dtype == "bfloat16":
        model = model.to(torch.bfloat16)
    model.save_pretrained(path, save_original_format=save_original_format,
                          **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    return model


def lm_eval_setup(root, seed: int, files=("textwrap.py", "fractions.py"), **task_counts):
    """(checkpoint, tasks folder) for the lm-eval backend tests under `root`: a byte-level model
    (vocab 256, eos = pad = byte 0, as train_tiny writes it; 512 positions; a tokenizer.json) and
    the local stdlib tasks from `files` of the standard library (`task_counts`: write_stdlib_tasks'
    n_nextline, n_mc, n_ppl), lm-eval's datasets kept offline in `root`."""
    import os
    import sysconfig
    from pathlib import Path

    from moejax.data import write_byte_tokenizer
    from moejax.evaluation.tasks import write_stdlib_tasks

    os.environ["HF_DATASETS_OFFLINE"] = "1"
    os.environ["HF_DATASETS_CACHE"] = str(root / "datasets")
    ckpt = root / "tiny"
    make_checkpoint(ckpt, seed=seed, vocab_size=256, max_position_embeddings=512, n_routed_experts=16, n_group=4,
                    topk_group=2, num_experts_per_tok=4, eos_token_id=0, pad_token_id=0, bos_token_id=None)
    write_byte_tokenizer(ckpt, 512)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return ckpt, write_stdlib_tasks(root / "tasks", files=[stdlib / f for f in files], **task_counts)


def harden(model, router_std: float = 1.0):
    """Make every parameter matter (in place; returns the model): norms random around the identity, router rows
    wide (decisive routing: entries of standard deviation router_std), attention biases random,
    balance biases random and partly negative."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                # around the identity: 1 for a norm scaling by w, 0 for one scaling by 1 + w (Qwen3-Next's,
                # initialised to zeros)
                p.copy_((0 if (p == 0).all() else 1) + 0.3 * torch.randn_like(p))
            elif name.endswith(("mlp.gate.weight", "mlp.router.weight")):
                p.normal_(0, router_std)
            elif name.endswith((".bias", "_bias", ".sinks")):  # gpt-oss: experts' biases, attention sinks
                p.normal_(0, 0.1 if "sinks" not in name else 1.0)
            elif name.endswith(("_hc.base", "_hc.scale", "hc_head.hc_base", "hc_head.hc_scale")):
                p.normal_(0 if name.endswith("base") else 1, 0.5)  # DeepSeek-V4's hyper-connections
        for m in model.modules():
            if hasattr(m, "e_score_correction_bias"):
                m.e_score_correction_bias.normal_(0, 0.3)
            if hasattr(m, "tid2eid"):  # DeepSeek-V4's hash routers: zeros in a fresh model; distinct experts per id
                m.tid2eid.copy_(torch.stack([torch.randperm(m.num_experts)[:m.top_k] for _ in range(len(m.tid2eid))]))
    return model


def decoder_layers(hf):
    """transformers' decoder layers: `model.layers`, or a multimodal wrapper's language model's
    (Qwen3.5-MoE: `model.language_model.layers`)."""
    return getattr(hf.model, "language_model", hf.model).layers


def hook_router(hf, ids, mask):
    """transformers' logits [B, S, V] (float32 numpy) and, per MoE layer (a block with a router
    `gate`), what its router saw and chose: (input x [T, H], logits, gates, chosen experts) as torch."""
    import torch

    seen, hooks = {}, []
    for l, layer in enumerate(decoder_layers(hf)):
        router = getattr(layer.mlp, "gate", None) or getattr(layer.mlp, "router", None)  # gpt-oss: `router`
        if router is not None:
            hooks.append(router.register_forward_hook(
                lambda mod, inp, out, l=l: seen.__setitem__(l, (inp[0].reshape(-1, inp[0].shape[-1]), *out))))
    with torch.no_grad():
        out = hf(torch.as_tensor(ids, dtype=torch.long), attention_mask=torch.as_tensor(mask))
    for h in hooks:
        h.remove()
    return out.logits.float().numpy(), seen


def reference_scores(hf, seen, mask, blocks=None) -> dict:
    """Every score from its definition (SPEC section 2), float64 numpy, on what transformers' model
    routed and computed (`hook_router`): its router input, logits, real gates (sigmoid or softmax,
    as the family routes) and chosen experts; expert outputs from its own weights (transformers 5's
    fused `experts.gate_up_proj` [E, 2 Im, H], gate rows first, and `experts.down_proj` [E, H, Im]),
    which `aimer` also reads (minus AIMER's ratio over the expert's gate, up and down entries).
    blocks: {layer: MoE block} when the hooked blocks are not the decoder layers' (an MTP layer's)."""
    out = {}
    blocks = blocks or moe_blocks_of(hf)
    for l, x, logits, gates, idx, f in _routed_layers(hf, seen, mask, blocks):
        block = blocks[l]
        matrices = expert_matrices(block.experts)
        E = len(matrices)

        def reap(idx_TK, gate_TK):
            freq, gate_norm, norm, norm_sq, norm_max = (np.zeros(E) for _ in range(5))
            for j in range(E):
                t, k = np.nonzero(idx_TK == j)
                n = np.linalg.norm(f(j, x[t]), axis=1)
                freq[j], gate_norm[j], norm[j], norm_sq[j] = len(t), (gate_TK[t, k] * n).sum(), n.sum(), (n ** 2).sum()
                norm_max[j] = n.max() if len(t) else 0.0
            per_token = lambda v: np.where(freq > 0, v / np.maximum(freq, 1), 0.0)  # noqa: E731
            return freq, per_token(gate_norm), norm, per_token(norm), per_token(norm_sq), norm_max

        freq, reap_real, ean, man, msan, max_act = reap(idx, gates)
        code_idx = np.argsort(-logits, axis=1, kind="stable")[:, :idx.shape[1]]
        p = np.exp(logits - logits.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        code_gate = np.take_along_axis(p, code_idx, 1)
        code_gate /= code_gate.sum(1, keepdims=True)
        reap_code = reap(code_idx, code_gate)[1]
        router = getattr(block, "gate", None) or block.router  # gpt-oss: `router`
        W = router.weight.detach().double().numpy()
        out[l] = {"frequency": freq, "reap": reap_real, "reap_code": reap_code, "ean": ean, "w_mean": W @ x.mean(0),
                  "signed": W.sum(1), "l1": np.abs(W).sum(1), "man": man, "msan": msan, "max_act": max_act,
                  "aimer": -np.array([aimer_ratio(*matrices[j]) for j in range(E)]),
                  "mone": mone_reference(x, gates, idx, f, E)[0],
                  **leave_one_out_reference(router, x, gates, idx, f, E),
                  "ranked_vote": ranked_vote_reference(logits, idx.shape[1]),
                  "shapley": shapley_reference(idx, E)}
        if hasattr(router, "e_score_correction_bias"):
            out[l]["bias"] = -router.e_score_correction_bias.detach().double().numpy()
    return out


def leave_one_out_reference(router, x, gates, idx, f, E) -> dict:
    """`loo_reroute` and `loo_reroute_cos` from their definitions, transformers' router rerouting:
    for each expert j, its tokens routed again by the router module itself with j removed (its
    logit -inf, by a patched `F.linear`; with a balance bias also that bias -1e4, so a sigmoid
    router cannot choose it), their routed outputs sum_k g_k f_k(x) in float64 from transformers'
    weights, against the unpruned ones: sum ||y' - y||^2 / (T H) and sum (1 - cos) / T."""
    import torch

    T, H = x.shape
    y = np.stack([sum(gates[t, k] * f(idx[t, k], x[t:t + 1])[0] for k in range(idx.shape[1])) for t in range(T)])
    sq, cos = np.zeros(E), np.zeros(E)
    linear = torch.nn.functional.linear
    for j in range(E):
        tokens = np.flatnonzero((idx == j).any(axis=1))
        if not len(tokens):
            continue

        def without_j(inp, weight, bias=None):
            out = linear(inp, weight, bias)
            return out.index_fill(-1, torch.tensor([j]), float("-inf")) if out.shape[-1] == E else out

        bias = getattr(router, "e_score_correction_bias", None)
        saved = None if bias is None else bias.detach().clone()
        torch.nn.functional.linear = without_j
        try:
            with torch.no_grad():
                if bias is not None:
                    bias[j] = -1e4
                _, new_gates, new_idx = router(torch.as_tensor(x[tokens], dtype=router.weight.dtype))
        finally:
            torch.nn.functional.linear = linear
            if bias is not None:
                with torch.no_grad():
                    bias.copy_(saved)
        new_gates, new_idx = new_gates.double().numpy(), new_idx.numpy()
        assert not (new_idx == j).any()
        for row, t in enumerate(tokens):
            y_new = sum(new_gates[row, k] * f(new_idx[row, k], x[t:t + 1])[0] for k in range(new_idx.shape[1]))
            sq[j] += np.square(y_new - y[t]).sum()
            cos[j] += 1 - y_new @ y[t] / (np.linalg.norm(y_new) * np.linalg.norm(y[t]))
    return {"loo_reroute": sq / (T * H), "loo_reroute_cos": cos / T}


def shapley_reference(idx, E: int) -> np.ndarray:
    """SHAPE's phi (arXiv 2606.09886) by brute force over the coalition lattice: for each expert i
    and every (K-1)-set S of the other experts, c = the tokens whose chosen set is exactly S + {i}
    and, where c > 0, m = the tokens whose chosen set contains S; alpha_i = the least c / m over
    those S, phi_i = the sum over them of c - alpha_i m (0 where there are none)."""
    from collections import Counter
    from itertools import combinations

    chosen = Counter(frozenset(row) for row in np.asarray(idx).tolist())
    K = idx.shape[1]
    phi = np.zeros(E)
    for i in range(E):
        terms = []
        for S in combinations([e for e in range(E) if e != i], K - 1):
            c = chosen.get(frozenset(S) | {i}, 0)
            if c:
                terms.append((c, sum(n for A, n in chosen.items() if frozenset(S) <= A)))
        if terms:
            alpha = min(c / m for c, m in terms)
            phi[i] = sum(c - alpha * m for c, m in terms)
    return phi


def ranked_vote_reference(logits, top_k: int) -> np.ndarray:
    """`ranked_vote` literally (NVIDIA ModelOpt's `RankedChoiceVotingHook.to_dict`, every expert
    still in counted, zero votes included): each round every token's top_k of its experts still in
    (by descending logit, ties to the lower index) are counted, the least-voted expert leaves (ties:
    the lowest index); its round is its score."""
    T, E = logits.shape
    order = np.argsort(-logits, axis=1, kind="stable")
    out, removed = np.zeros(E), []
    for r in range(E):
        ballots = np.stack([row[~np.isin(row, removed)][:top_k] for row in order]) if len(removed) < E else None
        counts = np.bincount(ballots.ravel(), minlength=E).astype(np.float64)
        counts[removed] = np.inf
        loser = int(np.argmin(counts))
        out[loser] = r
        removed.append(loser)
    return out


def assert_scores_match(stats, ref: dict, where: str, rtol: float = 1e-5, atol_scale: float = 1e-6,
                        ranking: bool = False) -> None:
    """moejax's scores of one layer's statistics against the reference values `ref` ({name: [E]});
    float32 passes against float64: a signed sum (w_mean) cancels, so the absolute tolerance scales
    with the score's largest magnitude. ranking: the rankings must also be equal."""
    from moejax.scoring.scores import compute_scores

    got = compute_scores(stats, list(ref))
    for name, want in ref.items():
        np.testing.assert_allclose(got[name], want, rtol=rtol, atol=atol_scale * np.abs(want).max(),
                                   err_msg=f"{where}: {name}")
        if ranking:
            assert np.array_equal(np.argsort(-got[name], kind="stable"), np.argsort(-want, kind="stable")), \
                f"{where}: {name} ranking"


def moe_blocks_of(hf) -> dict:
    """{layer: its `mlp`} of transformers' decoder layers."""
    return {l: layer.mlp for l, layer in enumerate(decoder_layers(hf))}


def _routed_layers(hf, seen, mask, blocks):
    """Per MoE layer of `hook_router`'s record: (layer, router input x [T, H], logits, gates, chosen
    experts, f) in float64 numpy over the valid tokens, f(j, xs) expert j's output before its gate
    from transformers' own weights (`expert_function`)."""
    valid = mask.reshape(-1).astype(bool)
    for l, (x, logits, gates, idx) in seen.items():
        yield (l, x.double().numpy()[valid], logits.double().numpy()[valid], gates.double().numpy()[valid],
               idx.numpy()[valid], expert_function(blocks[l].experts))


def expert_matrices(experts) -> list:
    """Expert by expert, the weight matrices of transformers' fused experts module in float64 (what
    AIMER reads): gate_up_proj and down_proj (biases aside)."""
    gate_up = experts.gate_up_proj.detach().double().numpy()
    down = experts.down_proj.detach().double().numpy()
    return [(gate_up[j], down[j]) for j in range(gate_up.shape[0])]


def expert_function(experts):
    """f(j, xs): expert j's output before its gate, from transformers' fused experts module in
    float64: SwiGLU from `gate_up_proj` [E, 2 Im, H] (gate rows first) and `down_proj` [E, H, Im];
    gpt-oss's (`swiglu_limit` set) from `gate_up_proj` [E, H, 2 Im] (gate columns even, up odd) and
    `down_proj` [E, Im, H], with their biases, the clamps and (up + 1) * gate * sigmoid(alpha gate)."""
    gate_up = experts.gate_up_proj.detach().double().numpy()
    down = experts.down_proj.detach().double().numpy()
    if hasattr(experts, "limit") and not hasattr(experts, "gate_up_proj_bias"):  # DeepSeek-V4: clamped, no biases
        limit, Im = float(experts.limit), gate_up.shape[1] // 2

        def f(j, xs):
            g, u = np.minimum(xs @ gate_up[j, :Im].T, limit), np.clip(xs @ gate_up[j, Im:].T, -limit, limit)
            return (g / (1 + np.exp(-g)) * u) @ down[j].T

        return f
    if hasattr(experts, "limit"):
        gu_b = experts.gate_up_proj_bias.detach().double().numpy()
        d_b = experts.down_proj_bias.detach().double().numpy()
        alpha, limit = float(experts.alpha), float(experts.limit)

        def f(j, xs):
            h = xs @ gate_up[j] + gu_b[j]
            g, u = np.minimum(h[:, 0::2], limit), np.clip(h[:, 1::2], -limit, limit)
            return ((u + 1) * g / (1 + np.exp(-alpha * g))) @ down[j] + d_b[j]

        return f
    Im = gate_up.shape[1] // 2

    def f(j, xs):
        g, u = xs @ gate_up[j, :Im].T, xs @ gate_up[j, Im:].T
        return (g / (1 + np.exp(-g)) * u) @ down[j].T

    return f


def mone_reference(x, gates, idx, f, E):
    """(MoNE's score [E], the novice constants [E, H]) from the definitions: per expert j, the
    outputs f_j(x) of the tokens that chose it, their per-dimension population variance var_j and
    mean (0 for an expert no token chose), and rs_j = sum of its gates / T over all T tokens;
    score = ||sqrt(var_j)||_2 * rs_j."""
    score, mean = np.zeros(E), np.zeros((E, x.shape[1]))
    for j in range(E):
        t, k = np.nonzero(idx == j)
        if len(t):
            fj = f(j, x[t])
            mean[j] = fj.mean(axis=0)
            score[j] = np.linalg.norm(np.sqrt(fj.var(axis=0))) * gates[t, k].sum() / len(x)
    return score, mean


def reference_mean_outputs(hf, seen, mask) -> dict:
    """{MoE layer: each expert's mean output over the valid tokens routed to it [E, H]} (MoNE's
    novice constants) from the definitions on what transformers' model routed (`hook_router`)."""
    return {l: mone_reference(x, gates, idx, f, decoder_layers(hf)[l].mlp.experts.gate_up_proj.shape[0])[1]
            for l, x, _, gates, idx, f in _routed_layers(hf, seen, mask, moe_blocks_of(hf))}


def aimer_ratio(*matrices) -> float:
    """AIMER's ratio of one expert: mean |w| over root mean square w, w every entry of its matrices."""
    w = np.concatenate([np.asarray(m, np.float64).ravel() for m in matrices])
    return np.abs(w).mean() / np.sqrt(np.square(w).mean())


def batch(vocab, seed=0, B=3, S=14):
    """Token ids and a padding mask: row 1 right-padded by 4, row 2 left-padded by 3."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, size=(B, S)).astype(np.int32)
    mask = np.ones((B, S), np.int32)
    mask[1, -4:] = 0
    mask[2, :3] = 0
    return ids, mask


def padded_logits_equal(model, hf, vocab, seed, S=20, tol=1e-4) -> np.ndarray:
    """moejax's `model` and transformers' `hf` give equal logits (atol = rtol = tol) at every real
    position of `batch`'s padded batch; transformers' logits there, [n_real, V]."""
    import jax.numpy as jnp
    import torch

    ids, mask = batch(vocab, seed=seed, S=S)
    with torch.no_grad():
        want = hf(torch.as_tensor(ids), attention_mask=torch.as_tensor(mask)).logits.numpy()
    got = np.asarray(model(jnp.asarray(ids), jnp.asarray(mask)).logits_BSV)
    valid = mask.astype(bool)
    np.testing.assert_allclose(got[valid], want[valid], atol=tol, rtol=tol)
    return want[valid]


def reference(model, ids, mask):
    """transformers' logits [B, S, V] (float32 numpy) and each MoE layer's chosen experts [B*S, K]."""
    import torch

    chosen, hooks = {}, []
    for l, layer in enumerate(model.model.layers):
        if hasattr(layer.mlp, "gate"):
            hooks.append(layer.mlp.gate.register_forward_hook(
                lambda mod, inp, out, l=l: chosen.__setitem__(l, out[2].detach().numpy().copy())))
    with torch.no_grad():
        out = model(torch.as_tensor(ids, dtype=torch.long), attention_mask=torch.as_tensor(mask))
    for h in hooks:
        h.remove()
    return out.logits.float().numpy(), chosen


@contextlib.contextmanager
def unreachable(model, experts):
    """transformers' model with `experts` unreachable in every MoE layer (balance bias -1e4, so
    they never win the top-k), restored on exit: the reference for moejax's expert masks."""
    import torch

    saved = {}
    with torch.no_grad():
        for l, layer in enumerate(model.model.layers):
            if hasattr(layer.mlp, "gate"):
                saved[l] = layer.mlp.gate.e_score_correction_bias.clone()
                layer.mlp.gate.e_score_correction_bias[experts] = -1e4
        try:
            yield model
        finally:
            for l, b in saved.items():
                model.model.layers[l].mlp.gate.e_score_correction_bias.copy_(b)


# --- rewriting a checkpoint tensor by tensor (quantised variants, extra tensors) ---------------

EXPERT = re.compile(r"mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")
ATTN = re.compile(r"self_attn\.(q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj)\.weight$")
QUANT_CONFIGS = {
    "fp8_block": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                  "weight_block_size": [128, 128]},
    "int4_pack": {"quant_method": "compressed-tensors", "format": "pack-quantized",
                  "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                      "num_bits": 4, "type": "int", "symmetric": True, "group_size": 32, "strategy": "group"}}}},
    "mxfp4": {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
              "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                  "num_bits": 4, "type": "float", "group_size": 32}}}},
}


def corrupt(value: np.ndarray):
    """A deliberately corrupt tensor (NaN, inf) for a test checkpoint: as bytes (`RawTensor`, as
    moejax copies a source's bytes), since the writer refuses non-finite computed arrays."""
    from moejax.hf.io.safetensors_format import RawTensor, safetensors_dtype

    value = np.ascontiguousarray(value)
    return RawTensor(safetensors_dtype(value.dtype, "corrupt"), value.shape, value.tobytes())


def rewrite(src, dst, transform=lambda name, reader: [(name, reader.read(name))], config_update=None, **kw):
    """A copy of `src` whose tensors go through `transform` (name -> list of (name, value))."""
    reader = CheckpointReader(src)
    config = {**reader.config(), **(config_update or {})}
    tensors = (item for name in reader.keys() for item in transform(name, reader))
    return write_checkpoint(dst, tensors, config, **kw)


def with_mtp_layer(src, dst, last: int = 2):
    """A copy of `src` with an MTP layer: decoder layer `last` (the last one) copied as layer
    last + 1 = num_hidden_layers, and num_nextn_predict_layers 1, as DeepSeek-V3 ships its MTP layer."""
    def add(name, reader):
        items = [(name, reader.read(name))]
        if name.startswith(f"model.layers.{last}."):
            items.append((name.replace(f"model.layers.{last}.", f"model.layers.{last + 1}."), reader.read(name)))
        return items

    return rewrite(src, dst, add, {"num_nextn_predict_layers": 1})


def with_mtp(src, dst, seed: int = 7):
    """A copy of `src` with one MTP layer as its family ships it, made to matter: the block a copy
    of the last full-attention decoder layer's with every value perturbed (routers included, so it
    routes its own way), and a random predictor. DeepSeek-V3's layout: `model.layers.{L}.*`, its
    predictor `enorm`, `hnorm`, `eh_proj`, `shared_head.norm` (and `shared_head.head`,
    `embed_tokens`, copies of the main model's), num_nextn_predict_layers 1. Qwen3.5-MoE's (a
    `text_config`): `mtp.layers.0.*` with its experts per expert, `mtp.fc`, `mtp.pre_fc_norm_embedding`,
    `mtp.pre_fc_norm_hidden`, `mtp.norm`, text_config.mtp_num_hidden_layers 1."""
    reader = CheckpointReader(src)
    config = reader.config()
    text = config.get("text_config", config)
    L, H = text["num_hidden_layers"], text["hidden_size"]
    types = text.get("layer_types") or ["full_attention"] * L
    last = max(i for i, t in enumerate(types) if t != "linear_attention")  # (not a DeltaNet layer)
    wrapper = "text_config" in config
    stem = "model.language_model.layers." if wrapper else "model.layers."
    rng = np.random.default_rng(seed)
    plus_one = wrapper  # Qwen3.5's norms scale by 1 + w

    def perturbed(value):
        return (value * (1 + 0.3 * rng.standard_normal(value.shape))).astype(value.dtype)

    def norm():
        return ((0.0 if plus_one else 1.0) + 0.3 * rng.standard_normal(H)).astype(np.float32)

    def block(name, value):
        rest = name[len(f"{stem}{last}."):]
        new_stem = "mtp.layers.0." if wrapper else f"model.layers.{L}."
        fused = re.match(r"mlp\.experts\.(gate_up_proj|down_proj)$", rest)
        if not (wrapper and fused):
            return [(new_stem + rest, perturbed(value))]
        if fused.group(1) == "down_proj":
            return [(f"{new_stem}mlp.experts.{e}.down_proj.weight", perturbed(v)) for e, v in enumerate(value)]
        F = value.shape[1] // 2
        return [(f"{new_stem}mlp.experts.{e}.{part}.weight", perturbed(v[rows]))
                for e, v in enumerate(value) for part, rows in (("gate_proj", slice(0, F)), ("up_proj", slice(F, None)))]

    def predictor():
        names = (("mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.fc.weight", "mtp.norm.weight")
                 if wrapper else tuple(f"model.layers.{L}.{n}.weight" for n in ("enorm", "hnorm", "eh_proj", "shared_head.norm")))
        enorm, hnorm, eh_proj, final = names
        out = [(enorm, norm()), (hnorm, norm()),
               (eh_proj, (rng.standard_normal((H, 2 * H)) / np.sqrt(H)).astype(np.float32)), (final, norm())]
        if not wrapper:
            out += [(f"model.layers.{L}.shared_head.head.weight", reader.read("lm_head.weight")),
                    (f"model.layers.{L}.embed_tokens.weight", reader.read("model.embed_tokens.weight"))]
        return out

    def add(name, reader):
        items = [(name, reader.read(name))]
        if name.startswith(f"{stem}{last}."):
            items += block(name, reader.read(name))
        return items + (predictor() if name == "lm_head.weight" else [])

    if wrapper:
        update = {"text_config": {**config["text_config"], "mtp_num_hidden_layers": 1}}
    else:
        update = {"num_nextn_predict_layers": 1}
    return rewrite(src, dst, add, update)


def quantised_linear(name, w, fmt):
    """(name, array) pairs for one Linear whose dense weight is `name` = '...weight', in `fmt`."""
    stem = name[: -len("weight")]
    if fmt == "fp8_block":
        q, scale_inv = quant_encode.quantize_fp8_block(w)
        return [(name, q), (stem + "weight_scale_inv", scale_inv)]
    if fmt == "int4_pack":
        packed, scale, shape = quant_encode.pack_int4(w, 32)
        return [(stem + "weight_packed", packed), (stem + "weight_scale", scale), (stem + "weight_shape", shape)]
    packed, scale = quant_encode.quantize_mxfp4(w)
    return [(stem + "weight_packed", packed), (stem + "weight_scale", scale)]


def quantize(fmt):
    """A `rewrite` transform quantising every expert Linear (and, for FP8, the attention ones)."""
    def transform(name, reader):
        w = reader.read(name)
        if not (EXPERT.search(name) or (fmt == "fp8_block" and ATTN.search(name))):
            return [(name, w)]
        return quantised_linear(name, w, fmt)
    return transform


# --- complete checkpoints without transformers (headers and shapes from the config) -----------

def full_config(**overrides) -> dict:
    """A complete, valid DeepSeek-V3 config.json dictionary: BASE with model_type and architectures,
    then `overrides` (remember num_key_value_heads when changing num_attention_heads)."""
    return {**BASE, "model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], **overrides}


def spec_shapes(config: dict) -> list[tuple[str, tuple]]:
    """(name, HF shape) of every tensor a checkpoint of `config` must hold, in file order: what
    moejax.hf.check expects, so a fixture built from it is complete (quantised Linears aside)."""
    from moejax.hf.mapping import tensor_specs
    from moejax.models.deepseek_v3.config import DeepseekV3Config

    return [(s.hf_name, s.hf_shape) for s in tensor_specs(DeepseekV3Config.from_dict(config, uniform_experts=False))]
