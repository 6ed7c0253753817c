"""Merged variants (issue 18) through the forward, the carried evaluation and `moejax merge`:

- the `tied` form's logits equal a model whose experts are replaced in place by their cluster's
  merged expert; the `shrunk` form equals that model pruned to the cluster leaders;
- a merge with every cluster a singleton reproduces the unpruned model exactly;
- `evaluate_pruning(merges=...)`: perplexities equal the whole model's forward under the same
  variant; keep=E gives the unpruned numbers exactly;
- a `moejax merge` checkpoint loads in transformers and equals moejax's evaluation of the same
  variant on the source; everything not merged is the source's bytes;
- the statistics merging clusters on, from `moejax merge`'s streamed pass and the carried
  evaluation, equal float64 numpy on transformers' own forward (hooks on the routers);
- one layer at a time (cheap enough for the default run): `tied` equals transformers' block with
  experts replaced in place, `shrunk` that block pruned to the leaders; an HC-SMoE checkpoint equals
  the definitions tensor by tensor on transformers' numbers.
"""

import json

import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("transformers")

from family_fixtures import make_family_checkpoint  # noqa: E402
from hf_fixtures import batch, make_checkpoint  # noqa: E402

from flax import nnx  # noqa: E402

from moejax.errors import ConfigError, MoejaxError  # noqa: E402
from moejax.inference.nll import next_token_nll  # noqa: E402
from moejax.hf.io.checkpoint_reader import CheckpointReader  # noqa: E402
from moejax.hf.model_io import load_pretrained, open_checkpoint  # noqa: E402
from moejax.merging.calibration import merge_stats  # noqa: E402
from moejax.merging.layer import merge_clusters, merge_layer  # noqa: E402
from moejax.merging.method import MergeContext, parse  # noqa: E402

E = 8


@pytest.fixture(scope="module")
def dsv3(tmp_path_factory):
    """DeepSeek-V3 (sigmoid router, balance bias, groups, shared experts), calibration ids."""
    path = tmp_path_factory.mktemp("merge") / "dsv3"
    make_checkpoint(path, seed=5, n_group=1, topk_group=1)
    model = load_pretrained(path)
    calib = np.random.default_rng(1).integers(0, 96, size=(4, 20)).astype(np.int32)
    return path, model, calib


def layer_merges(model, calib, method, keep):
    """{MoE layer: LayerMerge} from the unpruned model's router inputs on `calib` (in memory)."""
    out = model.jitted()(jnp.asarray(calib), None, return_moe_inputs=True)
    merges = {}
    for l, z in out.moe_inputs.items():
        moe = model.model.layers[l].mlp
        ctx = MergeContext.of(merge_stats(moe, [z], [None]))
        merges[l] = merge_layer(parse(method), keep, ctx, moe.expert_weights())
    return merges


def replaced_in_place(model, merges):
    """A copy of the model whose expert e holds its cluster's merged expert (every slot pointing at it)."""
    other = nnx.clone(model)
    for l, lm in merges.items():
        moe = other.model.layers[l].mlp
        for key, attr in (("gate", "experts_gate"), ("up", "experts_up"), ("down", "experts_down")):
            getattr(moe, attr)[...] = jnp.asarray(lm.weights[key][lm.labels_E])
    return other


_JITTED = {}


def logits(model, ids, mask, variant=None):
    """The model's jitted forward (one per model, kept: each variant kind compiles once)."""
    forward = _JITTED.setdefault(id(model), (model, model.jitted()))[1]
    return np.asarray(forward(jnp.asarray(ids), jnp.asarray(mask), variant).logits_BSV)


# -m slow: the default run checks both forms one layer at a time against transformers' blocks
# (test_merged_layer_forms_equal_transformers_blocks_with_experts_replaced), and HC-SMoE checkpoints
# tensor by tensor (test_hc_smoe_checkpoint_equals_the_definitions_on_transformers_numbers)
@pytest.mark.slow
@pytest.mark.parametrize("method", ["hc_smoe", "m_smoe"])
def test_tied_equals_experts_replaced_in_place_and_shrunk_equals_pruning_to_leaders(dsv3, method):
    _, model, calib = dsv3
    merges = layer_merges(model, calib, method, 3)
    ids, mask = batch(96, seed=2)
    in_place = replaced_in_place(model, merges)
    tied = logits(model, ids, mask, {l: lm.expert_map("tied") for l, lm in merges.items()})
    np.testing.assert_allclose(tied, logits(in_place, ids, mask), atol=2e-5, rtol=1e-5)
    unpruned = logits(model, ids, mask)
    assert np.abs(tied - unpruned).max() > 1e-3  # merging 8 experts into 3 changes the model
    masks = np.ones((model.config.num_hidden_layers, E), bool)
    for l, lm in merges.items():
        masks[l] = lm.kept_E("shrunk")
        assert sorted(lm.leaders.tolist()) == np.flatnonzero(masks[l]).tolist()
    shrunk = logits(model, ids, mask, {l: lm.expert_map("shrunk") for l, lm in merges.items()})
    np.testing.assert_allclose(shrunk, logits(in_place, ids, mask, jnp.asarray(masks)), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("method", ["hc_smoe", "m_smoe"])
def test_every_cluster_a_singleton_reproduces_the_unpruned_model_exactly(dsv3, method):
    _, model, calib = dsv3
    merges = layer_merges(model, calib, method, E)
    ids, mask = batch(96, seed=3)
    unpruned = logits(model, ids, mask)
    for form in ("tied", "shrunk"):
        got = logits(model, ids, mask, {l: lm.expert_map(form) for l, lm in merges.items()})
        np.testing.assert_array_equal(got, unpruned)


@pytest.fixture(scope="module")
def merged_qwen3(tmp_path_factory):
    root = tmp_path_factory.mktemp("merged")
    src = root / "src"
    hf = make_family_checkpoint("qwen3_moe", src, seed=9)
    tokens = root / "calib.npy"
    np.save(tokens, np.random.default_rng(6).integers(0, 96, size=(5, 24)).astype(np.int32))
    return root, src, hf, tokens


@pytest.mark.parametrize("method", [pytest.param("hc_smoe", marks=pytest.mark.slow), "m_smoe"])
def test_merged_checkpoint_loads_in_transformers_and_equals_the_shrunk_variant(merged_qwen3, method):
    import torch
    import transformers

    from moejax.cli import main

    root, src, _, tokens = merged_qwen3
    dst = root / f"merged_{method}"
    assert main(["merge", str(src), str(dst), "--method", method, "--keep", "4", "--tokens", str(tokens)]) == 0
    record = json.loads((dst / "pruning.json").read_text())
    config = json.loads((dst / "config.json").read_text())
    assert config.get("num_experts", config.get("num_local_experts")) == 4
    assert (record["method"], record["form"]) == (method, "shrunk")
    source = load_pretrained(src)
    # the clusters are the in-memory merge's (the streamed pass equals the in-memory one)
    calib = np.load(tokens)
    merges = layer_merges(source, calib, method, 4)
    variant = {}
    for l, lm in merges.items():
        layer = record["layers"][str(l)]
        assert layer["kept"] == sorted(lm.leaders.tolist())
        assert sorted(map(sorted, layer["clusters"])) == sorted(map(sorted, lm.clusters()))
        labels = np.empty(E, np.int64)
        for c, members in enumerate(layer["clusters"]):
            labels[members] = c
        recorded = MergeContext(None, np.asarray(layer["counts"]))   # the recorded clusters merged again
        np.testing.assert_array_equal(merge_clusters(parse(method), labels, recorded,
                                                     source.model.layers[l].mlp.expert_weights()).weights["gate"][
            np.argsort(np.argsort([m[0] for m in layer["clusters"]]))], np.asarray(lm.weights["gate"])[
            np.argsort(lm.leaders)])
        variant[l] = lm.expert_map("shrunk")
    ids, mask = batch(96, seed=7)
    want = logits(source, ids, mask, variant)
    hf = transformers.AutoModelForCausalLM.from_pretrained(dst, attn_implementation="eager").eval()
    with torch.no_grad():
        got = hf(torch.as_tensor(ids, dtype=torch.long), attention_mask=torch.as_tensor(mask)).logits.float().numpy()
    valid = mask.astype(bool)
    np.testing.assert_allclose(got[valid], want[valid], atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(logits(load_pretrained(dst), ids, mask)[valid], want[valid], atol=1e-5, rtol=1e-5)
    # bytes: untouched tensors, kept router rows and singleton clusters' experts are the source's
    a, b = CheckpointReader(src), CheckpointReader(dst)
    for l, layer in record["layers"].items():
        stem = f"model.layers.{l}.mlp."
        rows = [a.read(stem + "gate.weight")[e].tobytes() for e in layer["kept"]]
        assert [r.tobytes() for r in b.read(stem + "gate.weight")] == rows
        for new, cluster in enumerate(sorted(layer["clusters"], key=lambda c: c[0])):
            same = a.read_bytes(f"{stem}experts.{cluster[0]}.down_proj.weight") == \
                b.read_bytes(f"{stem}experts.{new}.down_proj.weight")
            assert same == (len(cluster) == 1)
    for name in ("model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight", "model.layers.1.self_attn.q_proj.weight"):
        assert a.read_bytes(name) == b.read_bytes(name)
    # moejax diff reads it as a pruning to the leaders; --hash names exactly the merged experts' tensors
    from moejax.surgery.diff import diff_checkpoints, failed_checks

    report = diff_checkpoints(src, dst, hash_tensors=True)
    assert {l: e["kept"] for l, e in report["layers"].items()} == {l: e["kept"] for l, e in record["layers"].items()}
    merged_names = {f"model.layers.{l}.mlp.experts.{new}.{p}_proj.weight" for l, layer in record["layers"].items()
                    for new, c in enumerate(sorted(layer["clusters"], key=lambda c: c[0])) if len(c) > 1
                    for p in ("gate", "up", "down")}
    assert set(report["tensors"]["bytes_differ"]) == merged_names and merged_names
    assert failed_checks(report) == ["other_tensors_identical"]


class _Captured(Exception):
    """Raised by the patched planner: the pass is over, nothing needs writing."""


def streamed_merge_stats(src, tokens, monkeypatch, batch_size=2) -> dict:
    """{MoE layer: MergeStats} exactly as `moejax merge` gathers them (its streamed calibration
    pass over `tokens`, batch by batch), caught at the planner before anything is written."""
    import moejax.surgery.merge as surgery_merge

    seen = {}

    def capture(stats, *args, **kwargs):
        seen.update(stats)
        raise _Captured

    monkeypatch.setattr(surgery_merge, "plan_merge", capture)
    with pytest.raises(_Captured):
        surgery_merge.merge_checkpoint(src, src.parent / "never_written", method=parse("hc_smoe"), keep=4,
                                       tokens=tokens, batch_size=batch_size)
    return seen


def carried_merge_stats(src, calib, monkeypatch) -> dict:
    """{MoE layer: MergeStats} as the carried evaluation (`evaluate_pruning(merges=...)`) gathers
    them on its calibration stream, layer after layer (keep=E, one short held-out text, stopped once
    the last MoE layer's statistics are in: the least to run)."""
    import moejax.evaluation.carried

    ckpt = open_checkpoint(src)
    layers, seen, merge_stats_of = list(ckpt.config.moe_layers), [], moejax.evaluation.carried.merge_stats

    def recording(moe, router_inputs, masks, **options):
        seen.append(merge_stats_of(moe, router_inputs, masks, **options))
        if len(seen) == len(layers):
            raise _Captured
        return seen[-1]

    monkeypatch.setattr(moejax.evaluation.carried, "merge_stats", recording)
    with pytest.raises(_Captured):
        moejax.evaluation.carried.evaluate_pruning(ckpt, calib, {"t": calib[:1, :8]}, ["frequency"], [ckpt.config.n_experts],
                                         merges=(parse("hc_smoe"),), batch_size=2)
    return dict(zip(layers, seen))


def reference_merge_stats(src, ids) -> dict:
    """Merging's statistics from their definitions (SPEC section 8), float64 numpy, on what
    transformers' own model computes for `ids` (hooks on each router: its input x and raw logits,
    its chosen experts; expert outputs from its own fused weights, gate rows first):
    counts_j = |X_j|, c_j = mean over *all* tokens of f_j(x), G = sum_x l(x) l(x)^T."""
    import transformers

    from hf_fixtures import hook_router

    hf = transformers.AutoModelForCausalLM.from_pretrained(src, attn_implementation="eager",
                                                           experts_implementation="eager").eval()
    _, seen = hook_router(hf, ids, np.ones(ids.shape, np.int32))
    out = {}
    for l, (x, logits, _, idx) in seen.items():
        experts = hf.model.layers[l].mlp.experts
        x, logits, idx = x.double().numpy(), logits.double().numpy(), idx.numpy()
        gate_up, down = (p.detach().double().numpy() for p in (experts.gate_up_proj, experts.down_proj))
        Im = gate_up.shape[1] // 2
        g, u = np.einsum("th,efh->etf", x, gate_up[:, :Im]), np.einsum("th,efh->etf", x, gate_up[:, Im:])
        f_ETH = np.einsum("etf,ehf->eth", g / (1 + np.exp(-g)) * u, down)   # every expert on every token
        routed_TE = (idx[:, :, None] == np.arange(gate_up.shape[0])).any(1)
        out[l] = {"counts": np.bincount(idx.reshape(-1), minlength=gate_up.shape[0]).astype(np.float64),
                  "mean_output": f_ETH.mean(axis=1), "gram": logits.T @ logits, "n_tokens": len(x),
                  "routed_mean_output": np.einsum("te,eth->eh", routed_TE, f_ETH)
                  / np.maximum(routed_TE.sum(0), 1)[:, None]}
    return out


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_moe"])
def test_merge_statistics_equal_numpy_on_transformers_hooks(dsv3, merged_qwen3, family, monkeypatch, tmp_path):
    """The statistics merging clusters on (HC-SMoE: every expert's mean output over all calibration
    tokens; M-SMoE: the router-logit Gram matrix; both: routing counts), as `moejax merge`'s streamed
    pass and the carried evaluation gather them, equal float64 numpy recomputed from transformers'
    forward, for a sigmoid router with balance bias and shared experts (DeepSeek-V3) and a softmax
    GQA family (Qwen3-MoE); so do the clusters and leaders drawn from them."""
    from moejax.merging.clusters import hc_smoe_clusters, m_smoe_groups_from_gram
    from moejax.merging.clusters import cluster_leaders

    if family == "deepseek_v3":
        src, _, calib = dsv3
        tokens = tmp_path / "calib.npy"
        np.save(tokens, calib)
    else:
        _, src, _, tokens = merged_qwen3
    ids = np.load(tokens)
    want = reference_merge_stats(src, ids)
    for ref in want.values():  # the test can tell: c_j over the tokens routed to j alone is far from it
        assert np.abs(ref["routed_mean_output"] - ref["mean_output"]).max() > 0.1 * np.abs(ref["mean_output"]).max()
    paths = {"moejax merge": streamed_merge_stats(src, tokens, monkeypatch)}
    if family == "deepseek_v3":  # the carried pass is family-agnostic: one family is enough
        paths["evaluate_pruning"] = carried_merge_stats(src, ids, monkeypatch)
    for path, got in paths.items():
        assert sorted(got) == sorted(want) and len(got) >= 2, path
        for l, ref in want.items():
            st, where = got[l], f"{path}, layer {l}"
            assert st.n_tokens == ref["n_tokens"] == ids.size, where
            np.testing.assert_array_equal(st.counts_E, ref["counts"], err_msg=where)
            for name, value, target in (("mean output", st.mean_output_EH, ref["mean_output"]),
                                        ("logit Gram", st.logit_gram_EE, ref["gram"])):
                np.testing.assert_allclose(value, target, rtol=1e-4, atol=1e-5 * np.abs(target).max(),
                                           err_msg=f"{name}, {where}")
            for keep in (3, 5):
                hc = hc_smoe_clusters(ref["mean_output"], keep)
                np.testing.assert_array_equal(hc_smoe_clusters(st.mean_output_EH, keep), hc, err_msg=where)
                np.testing.assert_array_equal(m_smoe_groups_from_gram(st.logit_gram_EE, st.counts_E, keep),
                                              m_smoe_groups_from_gram(ref["gram"], ref["counts"], keep), err_msg=where)
                np.testing.assert_array_equal(cluster_leaders(hc, st.counts_E), cluster_leaders(hc, ref["counts"]))


def test_merge_statistics_convert_a_bfloat16_layer_one_expert_at_a_time(dsv3):
    """Every expert on every token (HC-SMoE's statistics) over a bfloat16 expert stack holds no
    float32 copy of the stack: XLA hoists a conversion out of a loop over experts unless told not
    to, and at Moonlight's shape that copy was 2.2 GB of a 3 GB budget. The compiled program's
    temporaries are checked, not a clock or the process's memory."""
    import jax

    from moejax.merging.calibration import _sums

    _, model, _ = dsv3
    moe = model.model.layers[model.config.moe_layers[0]].mlp
    graphdef, state = nnx.split(moe)
    state = jax.tree.map(lambda w: w.astype(jnp.bfloat16) if w.ndim == 3 else w, state)  # the expert stacks
    stacks = [w for w in jax.tree.leaves(state) if w.ndim == 3]
    float32_copy = sum(w.size for w in stacks) * 4
    x = jnp.zeros((4, moe.router.shape[1]), jnp.float32)
    compiled = _sums.lower(graphdef, state, x, jnp.ones(4), True).compile()
    assert len(stacks) == 3 and compiled.memory_analysis().temp_size_in_bytes < float32_copy / 4


def test_merge_statistics_leave_out_padding_tokens(dsv3):
    """A batch's padding tokens (mask False) count in no statistic: counts, summed outputs, the
    logit Gram and REAM's router-weighted sums over a masked batch equal those over its valid tokens
    alone, even when the padding rows are large (they are selected away, not scaled)."""
    _, model, _ = dsv3
    moe = model.model.layers[model.config.moe_layers[0]].mlp
    rng = np.random.default_rng(3)
    x = rng.normal(size=(12, moe.router.shape[1])).astype(np.float32)
    valid = rng.random(12) < 0.6
    x[~valid] *= 1e3   # padding far from the data: any leak shows
    masked = merge_stats(moe, [jnp.asarray(x)], [valid], ream=True, ream_tokens=3)
    alone = merge_stats(moe, [jnp.asarray(x[valid])], [None], ream=True, ream_tokens=3)
    assert masked.n_tokens == alone.n_tokens == valid.sum()
    np.testing.assert_array_equal(masked.counts_E, alone.counts_E)
    for name in ("output_sum_EH", "logit_gram_EE", "gated_output_sum_EH"):
        a, b = getattr(masked, name), getattr(alone, name)
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * np.abs(b).max(), err_msg=name)


@pytest.mark.parametrize("method", ["hc_smoe", "m_smoe"])
def test_merged_layer_forms_equal_transformers_blocks_with_experts_replaced(dsv3, method):
    """One MoE layer at a time, on the router inputs transformers computed (no whole-model compile,
    so this runs by default beside the -m slow whole-model test): the `shrunk` form equals
    transformers' block with every expert replaced in place by its cluster's merged expert and
    every non-leader unreachable (pruned to the leaders); the `tied` form equals that block with
    every expert reachable. Shared experts included, DeepSeek-V3's balance bias and scaling."""
    import torch
    import transformers

    from hf_fixtures import hook_router, unreachable

    path, model, calib = dsv3
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager",
                                                           experts_implementation="eager").eval()
    _, seen = hook_router(hf, calib, np.ones(calib.shape, np.int32))
    not_lowest = 0
    for l, (x, _, _, idx) in seen.items():
        moe, block = model.model.layers[l].mlp, hf.model.layers[l].mlp
        x_TH = jnp.asarray(x.numpy())
        lm = merge_layer(parse(method), 3, MergeContext.of(merge_stats(moe, [x_TH], [None])), moe.expert_weights())
        assert np.bincount(lm.labels_E).max() > 1  # some cluster merges experts
        # the leaders by definition: each cluster's most frequent member on transformers' routing
        counts = np.bincount(idx.numpy().reshape(-1), minlength=E)
        members = [np.flatnonzero(lm.labels_E == c).tolist() for c in range(lm.n_clusters)]
        leaders = [min(m, key=lambda e: (-counts[e], e)) for m in members]
        not_lowest += sum(lead != m[0] for lead, m in zip(leaders, members))
        gate_up, down = block.experts.gate_up_proj, block.experts.down_proj
        saved = gate_up.detach().clone(), down.detach().clone()
        w = {k: torch.as_tensor(np.asarray(v)[lm.labels_E]) for k, v in lm.weights.items()}  # [E, ...] in place
        try:
            with torch.no_grad():
                gate_up.copy_(torch.cat([w["gate"], w["up"]], dim=2).transpose(1, 2))   # [E, 2 Im, H]
                down.copy_(w["down"].transpose(1, 2))                                  # [E, H, Im]
                tied_ref = block(x[None]).numpy()[0]
                with unreachable(hf, sorted(set(range(E)) - set(leaders))):
                    shrunk_ref = block(x[None]).numpy()[0]
                untouched = np.asarray(moe(x_TH[None])[0])[0]
        finally:
            with torch.no_grad():
                gate_up.copy_(saved[0])
                down.copy_(saved[1])
        for form, want in (("tied", tied_ref), ("shrunk", shrunk_ref)):
            got = np.asarray(moe(x_TH[None], lm.expert_map(form))[0])[0]
            scale = np.abs(want).max()
            np.testing.assert_allclose(got, want, atol=2e-5 * scale, rtol=1e-4, err_msg=f"{form}, layer {l}")
            assert np.abs(got - untouched).max() > 1e-2 * scale  # the merge changed the layer: the test can fail
        assert np.abs(tied_ref - shrunk_ref).max() > 1e-2 * np.abs(tied_ref).max()  # the two forms differ
    assert not_lowest > 0  # a leader that is not its cluster's lowest member: the leader rule is seen


def test_hc_smoe_checkpoint_equals_the_definitions_on_transformers_numbers(merged_qwen3):
    """`moejax merge --method hc_smoe` (average linkage, no neuron alignment), checked without
    moejax's forward: the clusters are average linkage on the mean outputs transformers' own
    forward gives; each cluster's leader its most frequent member; every merged tensor the
    frequency-weighted average of the source's (float64 numpy, written in the source dtype);
    singletons, kept router rows and everything else the source's bytes; transformers loads it."""
    import torch
    import transformers

    from moejax.cli import main
    from moejax.merging.clusters import hc_smoe_clusters

    root, src, _, tokens = merged_qwen3
    dst = root / "hc_smoe_checked"
    assert main(["merge", str(src), str(dst), "--method", "hc_smoe", "--keep", "4", "--tokens", str(tokens)]) == 0
    record = json.loads((dst / "pruning.json").read_text())
    config = json.loads((dst / "config.json").read_text())
    assert (record["method"], record["form"], record["settings"]) == ("hc_smoe", "shrunk", {"clustering": "average"})
    assert config.get("num_experts", config.get("num_local_experts")) == 4
    want = reference_merge_stats(src, np.load(tokens))
    a, b = CheckpointReader(src), CheckpointReader(dst)
    assert sorted(record["layers"]) == sorted(map(str, want))
    for l, ref in want.items():
        layer, stem = record["layers"][str(l)], f"model.layers.{l}.mlp."
        labels = hc_smoe_clusters(ref["mean_output"], 4)
        counts = ref["counts"]
        clusters = [min(members, key=lambda e: (-counts[e], e)) for members in
                    (np.flatnonzero(labels == c).tolist() for c in range(4))]   # leaders
        clusters = sorted([[lead] + [e for e in np.flatnonzero(labels == labels[lead]).tolist() if e != lead]
                           for lead in clusters])                                 # leader first, by leader
        assert layer["clusters"] == clusters and layer["kept"] == [c[0] for c in clusters]
        np.testing.assert_array_equal(layer["counts"], counts)
        assert any(len(c) > 1 for c in clusters)
        router = a.read(stem + "gate.weight")
        assert [r.tobytes() for r in b.read(stem + "gate.weight")] == [router[c[0]].tobytes() for c in clusters]
        for new, members in enumerate(clusters):
            f = counts[members] / counts[members].sum() if counts[members].sum() > 0 else np.full(len(members),
                                                                                                   1 / len(members))
            for p in ("gate", "up", "down"):
                name = f"experts.{{}}.{p}_proj.weight"
                source = [a.read(stem + name.format(e)) for e in members]
                merged = sum(share * w.astype(np.float64) for share, w in zip(f, source)).astype(source[0].dtype)
                got = b.read(stem + name.format(new))
                if len(members) == 1:
                    assert b.read_bytes(stem + name.format(new)) == a.read_bytes(stem + name.format(members[0]))
                else:
                    np.testing.assert_allclose(got, merged, rtol=1e-6, atol=1e-7 * np.abs(merged).max(),
                                               err_msg=f"layer {l} expert {new} {p}")
    for name in a.keys():
        if ".mlp.gate." not in name and ".mlp.experts." not in name:
            assert a.read_bytes(name) == b.read_bytes(name), name
    hf = transformers.AutoModelForCausalLM.from_pretrained(dst, attn_implementation="eager").eval()
    ids, mask = batch(96, seed=7)
    with torch.no_grad():
        logits = hf(torch.as_tensor(ids, dtype=torch.long), attention_mask=torch.as_tensor(mask)).logits.numpy()
    assert np.isfinite(logits).all() and hf.config.num_experts == 4


def test_merge_refuses_before_the_pass(merged_qwen3, tmp_path):
    from moejax.surgery.merge import merge_checkpoint

    _, src, _, tokens = merged_qwen3
    with pytest.raises(ConfigError, match="^unknown merge method 'zipit'; valid: \\['hc_smoe', 'm_smoe', 'ream'\\]"):
        merge_checkpoint(src, tmp_path / "x", method=parse("zipit"), keep=4, tokens=tokens)
    with pytest.raises(ConfigError, match="expected a merge method object"):   # a name, not a method object
        merge_checkpoint(src, tmp_path / "x", method="hc_smoe", keep=4, tokens=tokens)
    with pytest.raises(ConfigError, match="below top_k"):
        merge_checkpoint(src, tmp_path / "x", method=parse("hc_smoe"), keep=1, tokens=tokens)
    with pytest.raises(ConfigError, match="allocation"):
        merge_checkpoint(src, tmp_path / "x", method=parse("hc_smoe"), keep=4, tokens=tokens, allocation="local")
    with pytest.raises(MoejaxError, match="exactly one"):
        merge_checkpoint(src, tmp_path / "x", method=parse("hc_smoe"), keep=4)
    assert not (tmp_path / "x").exists()


def test_carried_pass_with_merges_and_a_global_budget_equals_the_forward(dsv3, tmp_path):
    """evaluate_pruning(merges=..., allocation="global"): the per-layer counts are the allocation
    rule's on in-memory calibration statistics (normalised frequency; the same total as uniform, not
    uniform here); at keep=E every variant reproduces the unpruned numbers (pruning exactly, merging
    up to float rounding); each pruned and
    merged variant's perplexity equals the whole model's forward under the same variant built from
    in-memory merges; `moejax prune --allocation global` keeps the same counts."""
    import pandas as pd

    from moejax.evaluation.carried import evaluate_pruning
    from moejax.allocation import layer_counts
    from moejax.scoring.observe import calibrate
    from moejax.scoring.select import select_kept
    from moejax.surgery.prune import prune_checkpoint

    path, model, calib = dsv3
    stats = calibrate(model, [(calib, None)])
    want = layer_counts({l: st.counts_E for l, st in stats.items()}, 3, model.config.num_experts_per_tok, "global")
    assert sum(want.values()) == 3 * len(stats) and len(set(want.values())) > 1  # not uniform here
    heldout = {"a": np.random.default_rng(4).integers(0, 96, size=(3, 20)).astype(np.int32)}
    rows, info = evaluate_pruning(open_checkpoint(path), calib, heldout, ["frequency"], [E, 3],
                                  merges=(parse("m_smoe"),), allocation="global", batch_size=4)
    df = pd.DataFrame(rows)
    ppl = df[(df.metric == "perplexity") & (df.text == "a")]
    unpruned = ppl[ppl["form"] == "none"].value.item()
    full = ppl[ppl.keep == E]
    assert len(full) == 1 + 2   # frequency; m_smoe tied and shrunk
    # pruning computes in the unpruned stream's calls: exactly its numbers; a merge's calls are its
    # own, over its table (the layer's experts plus padding rows here), and these small experts'
    # grouped matmul lays its blocks out by the table's size: equal up to float rounding (the
    # large experts' exact loop gives the same numbers bitwise: scripts/bench_real.py)
    assert full[full.method == "frequency"].value.item() == unpruned
    np.testing.assert_allclose(full.value, unpruned, rtol=1e-6)
    err = df[(df.keep == E) & (df.metric == "rel_error")]
    assert len(err) == 3 * 2 and (err[err.method == "frequency"].value == 0).all()  # 3 variants x 2 MoE layers
    assert (err.value < 1e-10).all()
    for name in ("frequency@3", "m_smoe@3"):
        assert info["layer_counts"][name] == want
    got = df[(df.metric == "experts") & (df.method == "frequency") & (df.keep == 3)].set_index("layer").value
    assert {int(l): int(v) for l, v in got.items()} == want
    ids = heldout["a"]

    def perplexity(variant):
        lg = logits(model, ids, np.ones(ids.shape, np.int32), variant)
        return float(np.exp(np.mean(np.asarray(next_token_nll(jnp.asarray(lg), jnp.asarray(ids))))))

    masks = np.ones((model.config.num_hidden_layers, E), bool)
    for l, c in want.items():
        masks[l] = select_kept(stats[l].counts_E, c)
        assert np.flatnonzero(masks[l]).tolist() == info["kept"][l]["frequency@3"]
    row = ppl[(ppl["form"] == "one_shot") & (ppl.keep == 3)]
    assert row.value.item() == pytest.approx(perplexity(jnp.asarray(masks)), rel=1e-4)
    out = model.jitted()(jnp.asarray(calib), None, return_moe_inputs=True)
    for method in ("m_smoe",):  # hc_smoe's variants: the lm-eval backend test and -m slow tests
        merges = {}
        for l, z in out.moe_inputs.items():
            moe = model.model.layers[l].mlp
            merges[l] = merge_layer(parse(method), want[l], MergeContext.of(merge_stats(moe, [z], [None])),
                                    moe.expert_weights())
            assert info["clusters"][l][f"{method}@3"] == merges[l].clusters() and merges[l].n_clusters == want[l]
        for form in ("tied", "shrunk"):
            got = ppl[(ppl["form"] == form) & (ppl.method == method) & (ppl.keep == 3)].value.item()
            assert got == pytest.approx(perplexity({l: m.expert_map(form) for l, m in merges.items()}), rel=1e-4)
            assert got != pytest.approx(unpruned, rel=1e-3)
    scores = pd.DataFrame([{"layer": l, "expert": e, "score": "frequency", "value": float(v)}
                           for l, st in stats.items() for e, v in enumerate(st.counts_E)])
    scores.to_parquet(tmp_path / "scores.parquet")
    record = prune_checkpoint(path, tmp_path / "pruned", score="frequency", keep=3,
                              scores_file=tmp_path / "scores.parquet", allocation="global")
    assert record["allocation"] == "global"
    assert {int(l): len(layer["kept"]) for l, layer in record["layers"].items()} == want


def test_carried_pass_holds_no_merged_experts(dsv3, monkeypatch):
    """The carried pass holds no merge's merged experts (the 3 GB budget at Moonlight's shape: four
    merges' experts held together were 1.7 GB, one merge's 0.4 GB): a merge's table is the layer's
    own experts (not a copy) and an `AveragedRows` over them, index arrays smaller than one expert,
    whose rows (made when read) are its clusters of two or more in order, each bitwise the merged
    expert `merge_clusters` makes (a singleton's slot computes with the layer's own expert, which
    is its merged expert exactly); every merge's has E rows (one compiled shape). With
    merged_weights=True every plan keeps its experts."""
    import jax

    import moejax.evaluation.carried as carried
    from moejax.moe.averaged_rows import AveragedRows

    path, _, calib = dsv3
    tables = []
    real_map = carried.stacked_expert_map

    def stacked_expert_map(plans, own, n_experts, *rows):
        em = real_map(plans, own, n_experts, *rows)
        if isinstance(em.weights, tuple):
            assert em.weights[0] is own
            lm = plans[0].merge
            tables.append((lm, own, em.weights[1]))
        return em

    monkeypatch.setattr(carried, "stacked_expert_map", stacked_expert_map)
    ckpt = open_checkpoint(path)
    keeps = [4, 3]
    _, info = carried.evaluate_pruning(ckpt, calib, {"a": calib}, ["frequency"], keeps,
                                       merges=(parse("hc_smoe"), parse("m_smoe")),
                                       batch_size=4)
    n_moe = len(ckpt.config.moe_layers)
    assert len(tables) == 2 * len(keeps) * n_moe
    for lm, own, rows in tables:
        assert isinstance(rows, AveragedRows)
        E = lm.labels_E.shape[0]
        assert rows.n_rows == E
        smallest_expert = min(w[0].size for w in own.values())
        assert all(leaf.size < smallest_expert for leaf in jax.tree.leaves(rows)), "a merge holds expert-sized arrays"
        counts = np.bincount(lm.labels_E)
        made = jax.jit(rows.materialize)(own)
        shared = lm.shared_clusters()
        assert shared == np.flatnonzero(counts > 1).tolist() and np.asarray(rows.counts)[len(shared):].sum() == 0
        for w in made.values():
            np.testing.assert_array_equal(np.asarray(w)[len(shared):], 0)
    made_of = {id(lm): (lm, own, rows) for lm, own, rows in tables}
    where = {(p.spec.method, p.spec.keep, l): made_of[id(p.layers[l].merge)]
             for p in info["plans"] if p.spec.merged for l in p.layers}
    assert len({id(t[0]) for t in where.values()}) == len(tables)
    assert all(p.layers[l].merge.weights is None for p in info["plans"] if p.spec.merged for l in p.layers)
    _, info = carried.evaluate_pruning(ckpt, calib, {"a": calib}, ["frequency"], keeps,
                                       merges=(parse("hc_smoe"), parse("m_smoe")),
                                       batch_size=4, merged_weights=True)
    checked = 0
    for p in info["plans"]:
        for l, plan in p.layers.items() if p.spec.merged else ():
            lm, own, rows = where[p.spec.method, p.spec.keep, l]
            assert plan.merge.weights is not None
            np.testing.assert_array_equal(plan.merge.labels_E, lm.labels_E)
            made = jax.jit(rows.materialize)(own)
            for i, c in enumerate(lm.shared_clusters()):   # bitwise `merge_weights`' merged expert
                for k, w in made.items():
                    np.testing.assert_array_equal(np.asarray(w[i]), plan.merge.weights[k][c])
                    checked += 1
    assert checked > 0


def test_merge_refuses_a_quantised_source_before_the_pass(dsv3, tmp_path):
    """Merged experts would need re-quantising, which moejax does not do: refused by name, nothing written."""
    from hf_fixtures import QUANT_CONFIGS, quantize, rewrite

    from moejax.errors import CheckpointError
    from moejax.surgery.merge import merge_checkpoint

    path, _, calib = dsv3
    src = rewrite(path, tmp_path / "fp8", quantize("fp8_block"), {"quantization_config": QUANT_CONFIGS["fp8_block"]})
    np.save(tmp_path / "calib.npy", calib)
    with pytest.raises(CheckpointError, match="quantised.*does not re-quantise"):
        merge_checkpoint(src, tmp_path / "out", method=parse("m_smoe"), keep=4, tokens=tmp_path / "calib.npy")
    assert not (tmp_path / "out").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["calib.npy", "fp8"]


def test_a_bfloat16_checkpoints_merged_experts_are_what_moejax_merge_writes(tmp_path):
    """A bfloat16 checkpoint: the carried pass holds its experts as stored and its merged experts in
    bfloat16, as `moejax merge` writes them (so the pass measures the checkpoint a user would get,
    and its expert table is not promoted to float32: half the memory); each merged tensor equals the
    written one (both round a float32/float64 average to bfloat16: at most one bfloat16 step apart)."""
    import ml_dtypes

    from moejax.cli import main
    from moejax.evaluation.carried import evaluate_pruning
    from moejax.variants.plan import stacked_expert_map

    path = tmp_path / "bf16"
    make_checkpoint(path, seed=6, dtype="bfloat16", n_group=1, topk_group=1)
    calib = np.random.default_rng(2).integers(0, 96, size=(4, 20)).astype(np.int32)
    np.save(tmp_path / "calib.npy", calib)
    assert main(["merge", str(path), str(tmp_path / "merged"), "--method", "m_smoe", "--keep", "4",
                 "--tokens", str(tmp_path / "calib.npy"), "--batch-size", "4"]) == 0
    record = json.loads((tmp_path / "merged" / "pruning.json").read_text())
    ckpt = open_checkpoint(path)
    _, info = evaluate_pruning(ckpt, calib, {"a": calib}, ["frequency"], [4], merges=(parse("m_smoe"),), batch_size=4,
                               merged_weights=True)
    plan = next(p for p in info["plans"] if p.spec.method == "m_smoe" and p.spec.form == "shrunk")
    written, merged_rows = CheckpointReader(tmp_path / "merged"), 0
    for l, layer in record["layers"].items():
        lm = plan.layers[int(l)].merge
        assert layer["clusters"] == sorted(lm.clusters())
        assert {np.dtype(w.dtype) for w in lm.weights.values()} == {np.dtype(ml_dtypes.bfloat16)}
        held = ckpt.decoder_layer(int(l), jnp.float32, expert_dtype=ckpt.stored_expert_dtype(jnp.float32))
        table = stacked_expert_map([plan.layers[int(l)]], held.mlp.expert_weights(), E).weights
        assert {np.dtype(w.dtype) for part in table for w in part.values()} == {np.dtype(jnp.bfloat16)}
        for new, members in enumerate(layer["clusters"]):
            if len(members) == 1:
                continue
            c = int(lm.labels_E[members[0]])
            for p in ("gate", "up", "down"):
                got = np.asarray(lm.weights[p][c], np.float32).T
                want = written.read(f"model.layers.{l}.mlp.experts.{new}.{p}_proj.weight").astype(np.float32)
                np.testing.assert_allclose(got, want, rtol=2 ** -7, atol=1e-6)
                merged_rows += 1
    assert merged_rows > 0
