"""Scores of a DeepSeek-V3 model from one calibration pass, against numpy computed from the
definitions (SPEC section 2) on what transformers' own model routes and computes (forward hooks)."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from hf_fixtures import batch, make_checkpoint  # noqa: E402

from moejax import DeepseekV3ForCausalLM  # noqa: E402
from moejax.scoring.observe import calibrate  # noqa: E402
from moejax.scoring.scores import compute_scores  # noqa: E402

SCORES = ["frequency", "reap", "reap_code", "ean", "w_mean"]


def hf_reference(hf, ids, mask):
    """Per MoE layer, from hooks on transformers' router: its input x, logits and chosen experts
    with their gates; then every score from the definitions in float64 numpy."""
    seen, hooks = {}, []
    for l, layer in enumerate(hf.model.layers):
        if hasattr(layer.mlp, "gate"):
            hooks.append(layer.mlp.gate.register_forward_hook(
                lambda mod, inp, out, l=l: seen.__setitem__(l, (inp[0].reshape(-1, inp[0].shape[-1]), *out))))
    with torch.no_grad():
        hf(torch.as_tensor(ids, dtype=torch.long), attention_mask=torch.as_tensor(mask))
    for h in hooks:
        h.remove()
    valid = mask.reshape(-1).astype(bool)
    out = {}
    for l, (x, logits, gates, idx) in seen.items():
        mlp = hf.model.layers[l].mlp
        x, logits = x.double().numpy()[valid], logits.double().numpy()[valid]
        gates, idx = gates.double().numpy()[valid], idx.numpy()[valid]
        gate_up = mlp.experts.gate_up_proj.detach().double().numpy()   # [E, 2 Im, H], gate rows first
        down = mlp.experts.down_proj.detach().double().numpy()         # [E, H, Im]
        E, Im = gate_up.shape[0], gate_up.shape[1] // 2

        def f(j, xs):  # expert j's output, before the gate
            g, u = xs @ gate_up[j, :Im].T, xs @ gate_up[j, Im:].T
            return (g / (1 + np.exp(-g)) * u) @ down[j].T

        def reap(idx_TK, gate_TK):
            freq, gate_norm, norm = np.zeros(E), np.zeros(E), np.zeros(E)
            for j in range(E):
                t, k = np.nonzero(idx_TK == j)
                n = np.linalg.norm(f(j, x[t]), axis=1)
                freq[j], gate_norm[j], norm[j] = len(t), (gate_TK[t, k] * n).sum(), n.sum()
            return freq, np.where(freq > 0, gate_norm / np.maximum(freq, 1), 0.0), norm

        freq, reap_real, ean = reap(idx, gates)
        code_idx = np.argsort(-logits, axis=1, kind="stable")[:, :idx.shape[1]]
        p = np.exp(logits - logits.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        code_gate = np.take_along_axis(p, code_idx, 1)
        code_gate /= code_gate.sum(1, keepdims=True)
        _, reap_code, _ = reap(code_idx, code_gate)
        W = mlp.gate.weight.detach().double().numpy()
        out[l] = {"frequency": freq, "reap": reap_real, "reap_code": reap_code, "ean": ean,
                  "w_mean": W @ x.mean(0)}
    return out


@pytest.mark.parametrize("stored", ["float32", "bfloat16"])
def test_scores_match_definitions_on_transformers_model(tmp_path, stored):
    from transformers import DeepseekV3ForCausalLM as HF

    path = tmp_path / "ckpt"
    hf = make_checkpoint(path, seed=7, dtype=stored)
    with torch.no_grad():  # expert 6 of layer 2 is never routed by the model (REAP code still sees it)
        hf.model.layers[2].mlp.gate.e_score_correction_bias[6] = -10.0
    hf.save_pretrained(path)
    # the reference computes in float32 on the stored values (exact for bfloat16 weights)
    hf = HF.from_pretrained(path, dtype=torch.float32, attn_implementation="eager",
                            experts_implementation="eager").eval()
    ids, mask = batch(hf.config.vocab_size, seed=3, B=3, S=16)
    want = hf_reference(hf, ids, mask)
    model = DeepseekV3ForCausalLM.from_pretrained(path)
    # two batches, to exercise accumulation: the same tokens split in halves along the batch
    stats = calibrate(model, [(ids[:2], mask[:2]), (ids[2:], mask[2:])])
    assert sorted(stats) == sorted(want)
    assert want[2]["frequency"][6] == 0 and stats[2].counts_E[6] == 0 and want[2]["reap_code"][6] > 0
    for layer, ref in want.items():
        got = compute_scores(stats[layer], SCORES)
        for name in SCORES:
            np.testing.assert_allclose(got[name], ref[name], rtol=1e-5, atol=1e-9, err_msg=f"{name} layer {layer}")
            assert np.array_equal(np.argsort(-got[name], kind="stable"), np.argsort(-ref[name], kind="stable")), \
                f"{name} ranking, layer {layer}"


def test_streamed_pass_equals_in_memory_pass(tmp_path):
    from moejax.scoring.observe import calibrate_streamed

    path = tmp_path / "bf16"
    hf = make_checkpoint(path, seed=8, dtype="bfloat16")  # a checkpoint stored in bfloat16
    ids, mask = batch(hf.config.vocab_size, seed=4, B=3, S=16)
    batches = [(ids[:2], mask[:2]), (ids[2:], mask[2:])]
    streamed = calibrate_streamed(path, batches, progress=False)
    in_memory = calibrate(DeepseekV3ForCausalLM.from_pretrained(path), batches)
    assert sorted(streamed) == sorted(in_memory) == [1, 2]
    for layer in streamed:
        for name, a in compute_scores(streamed[layer], SCORES).items():
            np.testing.assert_allclose(a, compute_scores(in_memory[layer], [name])[name], rtol=1e-6, err_msg=name)
