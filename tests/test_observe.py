"""Scores of a DeepSeek-V3 model from one calibration pass, against numpy computed from the
definitions (SPEC section 2) on what transformers' own model routes and computes (forward hooks)."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from hf_fixtures import batch, hook_router, make_checkpoint, reference_mean_outputs, reference_scores  # noqa: E402

from moejax import from_pretrained  # noqa: E402
from moejax.scoring.observe import calibrate  # noqa: E402
from moejax.scoring.scores import compute_scores  # noqa: E402

SCORES = ["frequency", "reap", "reap_code", "ean", "w_mean", "man", "msan", "max_act", "aimer", "mone"]


def hf_reference(hf, ids, mask):
    """Every score from the definitions in float64 numpy, on what transformers' model routed."""
    return reference_scores(hf, hook_router(hf, ids, mask)[1], mask)


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
    constants = reference_mean_outputs(hf, hook_router(hf, ids, mask)[1], mask)
    model = from_pretrained(path)
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
        # MoNE's novice constants: each expert's mean output over its routed tokens (0 for expert 6 of layer 2)
        np.testing.assert_allclose(stats[layer].mean_output_EH, constants[layer], rtol=1e-5,
                                   atol=1e-5 * np.abs(constants[layer]).max())  # a float32 pass
    assert not stats[2].mean_output_EH[6].any()


def test_streamed_pass_equals_in_memory_pass(tmp_path):
    from moejax.scoring.observe import calibrate_streamed

    path = tmp_path / "bf16"
    hf = make_checkpoint(path, seed=8, dtype="bfloat16")  # a checkpoint stored in bfloat16
    ids, mask = batch(hf.config.vocab_size, seed=4, B=3, S=16)
    batches = [(ids[:2], mask[:2]), (ids[2:], mask[2:])]
    streamed = calibrate_streamed(path, batches, progress=False, interventions=True)
    in_memory = calibrate(from_pretrained(path), batches)
    assert sorted(streamed) == sorted(in_memory) == [1, 2]
    for layer in streamed:
        for name, a in compute_scores(streamed[layer], SCORES).items():
            np.testing.assert_allclose(a, compute_scores(in_memory[layer], [name])[name], rtol=1e-6, err_msg=name)
