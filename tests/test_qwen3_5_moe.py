"""Qwen3.5-MoE beyond the shared family tests (tests/test_families.py runs it with the others):
the Hub's layout (the multimodal wrapper, `model.language_model.*`, a vision tower and an `mtp.*`
block transformers does not read) pruned and merged with every non-language tensor carried byte for
byte and the wrapper's config changed only in its text_config; long padded batches."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from family_fixtures import make_family_checkpoint  # noqa: E402
from hf_fixtures import with_mtp  # noqa: E402

from moejax import AutoModelForCausalLM  # noqa: E402
from moejax.cli import main  # noqa: E402
from moejax.hf.io.checkpoint_reader import CheckpointReader  # noqa: E402


@pytest.fixture(scope="module")
def hub_layout(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3_5_moe")
    make_family_checkpoint("qwen3_5_moe", root / "plain", seed=44)
    with_mtp(root / "plain", root / "src")  # `mtp.*` as the Hub ships it (tests/test_mtp.py runs it)
    np.save(root / "calib.npy", np.random.default_rng(6).integers(0, 96, size=(4, 24)).astype(np.int32))
    return root


@pytest.mark.parametrize("command", [["prune", "--score", "l1"],
                                     ["merge", "--method", "hc_smoe", "--tokens", "calib.npy"]])
def test_vision_and_mtp_tensors_are_carried_byte_for_byte(hub_layout, command):
    root = hub_layout
    dst = root / command[0]
    args = [str(root / a) if a.endswith(".npy") else a for a in command[1:]]
    assert main([command[0], str(root / "src"), str(dst), *args, "--keep", "6"]) == 0
    src, out = CheckpointReader(root / "src"), CheckpointReader(dst)
    carried = [n for n in src.keys() if n.startswith("model.visual.") or (n.startswith("mtp.") and ".experts." not in n
                                                                           and not n.endswith("mlp.gate.weight"))]
    assert len(carried) > 30 and set(carried) <= set(out.keys())
    assert all(src.read_bytes(n) == out.read_bytes(n) for n in carried)
    # the MTP block (--mtp prune, the default) keeps 6 experts under its own names, as config.json says
    kept = json.loads((dst / "pruning.json").read_text())["layers"]["3"]["kept"]
    assert len(kept) == 6 and tuple(out.info("mtp.layers.0.mlp.gate.weight").shape) == (6, 64)
    assert {n for n in out.keys() if n.startswith("mtp.layers.0.mlp.experts.")} == {
        f"mtp.layers.0.mlp.experts.{e}.{m}.weight" for e in range(6) for m in ("gate_proj", "up_proj", "down_proj")}
    if command[0] == "prune":  # pruned: each kept expert's bytes under its new index
        assert all(out.read_bytes(f"mtp.layers.0.mlp.experts.{new}.up_proj.weight")
                   == src.read_bytes(f"mtp.layers.0.mlp.experts.{old}.up_proj.weight") for new, old in enumerate(kept))
    a, b = (json.loads((p / "config.json").read_text()) for p in (root / "src", dst))
    assert {k for k in a if a[k] != b[k]} == {"text_config"} and b["text_config"]["num_experts"] == 6
    assert {k for k in a["text_config"] if a["text_config"][k] != b["text_config"][k]} == {"num_experts"}
    hf = transformers.AutoModelForImageTextToText.from_pretrained(dst, attn_implementation="eager",
                                                                  experts_implementation="eager").eval()
    ids = np.random.default_rng(7).integers(2, 96, size=(2, 20))
    with torch.no_grad():
        want = hf(input_ids=torch.as_tensor(ids)).logits.numpy()
    got = np.asarray(AutoModelForCausalLM.from_pretrained(dst).jitted()(jnp.asarray(ids)).logits_BSV)
    assert np.abs(got - want).max() < 1e-4 * max(1.0, np.abs(want).max())  # 1.5e-4 of 3.5 measured, XLA -O3


def test_long_padded_batch_is_exact_per_sequence(hub_layout):
    """130 columns (three DeltaNet chunks), a row left-padded by 40: each row's logits equal moejax
    on the row alone, and are within float32 of transformers on the row alone."""
    model = AutoModelForCausalLM.from_pretrained(hub_layout / "src")
    hf = transformers.AutoModelForImageTextToText.from_pretrained(hub_layout / "src").eval()
    ids = np.random.default_rng(3).integers(2, 96, size=(2, 130)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[1, :40] = 0
    forward = model.jitted()
    got = np.asarray(forward(jnp.asarray(ids), jnp.asarray(mask)).logits_BSV)
    for b in range(2):
        real = mask[b].astype(bool)
        alone = np.asarray(forward(jnp.asarray(ids[b:b + 1, real])).logits_BSV)[0]
        assert np.abs(got[b, real] - alone).max() < 1e-4
        with torch.no_grad():
            theirs = hf(input_ids=torch.as_tensor(ids[b:b + 1, real], dtype=torch.long)).logits.numpy()[0]
        assert np.abs(alone - theirs).max() < 2e-3 * max(1.0, np.abs(theirs).max())
