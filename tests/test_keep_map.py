"""keep_map.json (issue 45 item 5) and its public formats:

- the formats' own published examples parse to the kept sets they mean: RIY's docs profile (vLLM PR
  #37824), vllm-ascend's PR lines (#12525), hipfire's test plan (PR #445), and an EvoESAP pair laid
  out as `non_uni_prune.py` writes it;
- every format round-trips canonical -> format -> canonical to the same kept sets (and order where
  the format keeps one); ascend-jsonl's ratio gives the kept count in Python floats for every E, K;
- a pruned, a merged and a substituted tiny checkpoint each carry a keep_map.json that agrees with
  pruning.json and with the tensors (a kept expert's bytes are the source's at the listed id);
  `moejax reroute`'s writer carries it;
- `prune --keep-map` from the same source (a folder, or any format) writes the same bytes as the
  original prune; a map from another checkpoint is refused naming both fingerprints, before writing;
- a corrupted keep_map.json makes `moejax inspect` and loading refuse, naming the key; an unknown
  format is refused listing the valid ones."""

import json
import shutil

import numpy as np
import pytest

pytest.importorskip("transformers")

from hf_fixtures import make_checkpoint, with_mtp_layer  # noqa: E402

from moejax.cli import main  # noqa: E402
from moejax.errors import CheckpointError, ConfigError  # noqa: E402
from moejax.hf.check import check_checkpoint  # noqa: E402
from moejax.hf.io.checkpoint_reader import CheckpointReader  # noqa: E402
from moejax.hf.keep_map import KEEP_MAP, check_keep_map, kept_of, new_keep_map  # noqa: E402
from moejax.hf.keep_map_formats import FORMATS, ascend_ratio, convert, format_named, read_keep_map_file  # noqa: E402
from moejax.hf.provenance import checkpoint_fingerprint  # noqa: E402
from moejax.surgery.prune import prune_checkpoint  # noqa: E402

# --- the formats' published examples ------------------------------------------------------------

RIY_DOCS = (b'{"version": 1, "model": "Qwen3.5-397B-A17B", "workload": "municipal German administrative", '
            b'"pruned_experts": [[0, 3], [0, 11], [4, 7], [12, 2]]}')
ASCEND_PR = b'{"0":[106,65,113,84,104,53,127,11]}\n{"1":[86,48,18,3,117,9,32,72]}\n'
HIPFIRE_TEST = b'{"original_experts":4,"num_layers":2,"keep":{"per_layer":[[0,2,3],[1,2,3]]}}'


def test_riys_docs_example_prunes_the_listed_pairs_and_keeps_every_other_layer_whole():
    counts = {l: 512 for l in range(60)}   # Qwen3.5-397B-A17B: 60 MoE layers of 512 experts
    keep_map = FORMATS["riy"].read({"docs.json": RIY_DOCS}, counts, {})
    kept = kept_of(keep_map)
    assert set(kept) == set(counts)
    assert kept[0] == [e for e in range(512) if e not in (3, 11)]
    assert kept[4] == [e for e in range(512) if e != 7] and kept[12] == [e for e in range(512) if e != 2]
    assert all(kept[l] == list(range(512)) for l in counts if l not in (0, 4, 12))
    assert keep_map["fingerprint"] is None   # a foreign format carries none
    with pytest.raises(ConfigError, match="--checkpoint"):   # the pairs alone do not give E
        FORMATS["riy"].read({"docs.json": RIY_DOCS}, None, {})


def test_riy_versions_and_bad_pairs_are_refused_by_key():
    counts = {0: 8, 1: 8}
    read = lambda profile: FORMATS["riy"].read({"p.json": json.dumps(profile).encode()}, counts, {})  # noqa: E731
    v2 = read({"version": 2, "model": "m", "routing_mode": "post_topk_drop", "pruned_experts": [[1, 7]]})
    assert kept_of(v2)[1] == list(range(7))
    for profile, key in [({"version": 1, "model": "m", "routing_mode": "pre_topk_mask", "pruned_experts": []},
                          "routing_mode"),
                         ({"version": 2, "model": "m", "routing_mode": "drop", "pruned_experts": []}, "routing_mode"),
                         ({"version": 3, "model": "m", "pruned_experts": []}, "version"),
                         ({"version": 1, "model": "m", "pruned_experts": [[0, 8]]}, r"\[0, 8\]"),
                         ({"version": 1, "model": "m", "pruned_experts": [[5, 1]]}, "layer 5"),
                         ({"version": 1, "model": "m", "pruned_experts": [[0, 1], [0, 1]]}, "twice")]:
        with pytest.raises(ConfigError, match=key):
            read(profile)


def test_ascends_pr_lines_keep_their_first_ids_in_list_order():
    counts = {0: 128, 1: 128}   # Qwen3-30B-A3B's 128 experts; the PR's lines list 8 of them
    keep_map = FORMATS["ascend-jsonl"].read({"math.jsonl": ASCEND_PR}, counts, {"expert_prune_ratio": 0.9375})
    assert kept_of(keep_map) == {0: [106, 65, 113, 84, 104, 53, 127, 11], 1: [86, 48, 18, 3, 117, 9, 32, 72]}
    half = FORMATS["ascend-jsonl"].read({"math.jsonl": ASCEND_PR}, counts, {"expert_prune_ratio": 0.96875})
    assert kept_of(half) == {0: [106, 65, 113, 84], 1: [86, 48, 18, 3]}   # int(128 * 0.03125) = 4: the first four
    with pytest.raises(ConfigError, match="lists 8"):    # ratio 0.5 keeps 64; a line of 8 cannot
        FORMATS["ascend-jsonl"].read({"math.jsonl": ASCEND_PR}, counts, {"expert_prune_ratio": 0.5})
    with pytest.raises(ConfigError, match=r"\[2\] have no line"):   # every MoE layer needs its line
        FORMATS["ascend-jsonl"].read({"math.jsonl": ASCEND_PR}, {**counts, 2: 128}, {"expert_prune_ratio": 0.9375})
    with pytest.raises(ConfigError, match="expert_prune_ratio"):
        FORMATS["ascend-jsonl"].read({"math.jsonl": ASCEND_PR}, counts, {})


def test_hipfires_test_plan_keeps_its_rows_in_slot_order():
    keep_map = FORMATS["hipfire"].read({"reap_plan.json": HIPFIRE_TEST}, None, {})
    assert kept_of(keep_map) == {0: [0, 2, 3], 1: [1, 2, 3]}
    assert keep_map["layers"]["0"]["n_experts"] == 4 and keep_map["num_hidden_layers"] == 2
    ragged = b'{"original_experts":4,"num_layers":2,"keep":{"per_layer":[[0,2,3],[1,2]]}}'
    with pytest.raises(ConfigError, match="different lengths"):
        FORMATS["hipfire"].read({"reap_plan.json": ragged}, None, {})


def evoesap_pair(plan, pruned) -> dict:
    """The two files as EvoESAP's non_uni_prune.py writes them (json.dump(..., indent=2))."""
    return {"run/nonuniform_plan.json": json.dumps({"plan": plan, "best_score": 0.8731}, indent=2).encode(),
            "run/pruned_experts.json": json.dumps(pruned, indent=2).encode()}


def test_an_evoesap_pair_gives_its_pruned_ids_and_its_plans_counts():
    plan = [{"layer": 1, "total_experts": 8, "pruned_experts": 2, "kept_experts": 6, "prune_ratio": 0.25},
            {"layer": 2, "total_experts": 8, "pruned_experts": 0, "kept_experts": 8, "prune_ratio": 0.0}]
    keep_map = FORMATS["evoesap"].read(evoesap_pair(plan, {"1": [5, 0]}), None, {})   # least salient first
    assert kept_of(keep_map) == {1: [1, 2, 3, 4, 6, 7], 2: list(range(8))}
    wrong = [dict(plan[0], pruned_experts=3, kept_experts=5, prune_ratio=0.375), plan[1]]
    with pytest.raises(ConfigError, match="prunes 3, but pruned_experts.json lists 2"):
        FORMATS["evoesap"].read(evoesap_pair(wrong, {"1": [5, 0]}), None, {})
    with pytest.raises(ConfigError, match="prune_ratio"):
        FORMATS["evoesap"].read(evoesap_pair([dict(plan[0], prune_ratio=0.3), plan[1]], {"1": [5, 0]}), None, {})
    with pytest.raises(ConfigError, match="checkpoint's layer has 16"):   # the plan's count against the checkpoint's
        FORMATS["evoesap"].read(evoesap_pair(plan, {"1": [5, 0]}), {1: 16, 2: 8}, {})


# --- round trips --------------------------------------------------------------------------------

UNIFORM = new_keep_map({0: [5, 1, 7, 2], 1: [0, 3, 6, 4], 2: [7, 6, 5, 4]}, n_experts={0: 8, 1: 8, 2: 8},
                       num_hidden_layers=3)
PER_LAYER = new_keep_map({0: [6, 0, 3], 1: [1, 2, 4, 5, 7], 2: list(range(16))}, n_experts={0: 8, 1: 8, 2: 16},
                         num_hidden_layers=3)


def round_trip(keep_map, name):
    converted = convert(keep_map, name)
    files = {f"out/{file}": text.encode() for file, text in converted.files.items()}
    counts = {int(l): e["n_experts"] for l, e in keep_map["layers"].items()}
    return FORMATS[name].read(files, counts, converted.settings), converted


@pytest.mark.parametrize("name", list(FORMATS))
def test_every_format_round_trips_to_the_same_kept_sets(name):
    back, converted = round_trip(UNIFORM, name)
    want = kept_of(UNIFORM)
    got = kept_of(back)
    if FORMATS[name].keeps_order:
        assert got == want
    else:   # riy and evoesap compact in ascending id order, and say so
        assert got == {l: sorted(k) for l, k in want.items()} and got != want
        assert any("order" in note for note in converted.notes)
    if name in ("ascend-jsonl", "hipfire"):   # one count for the model: refused, naming the layers' counts
        with pytest.raises(ConfigError, match=r"keeps \{0: 3, 1: 5, 2: 16\} of \{0: 8, 1: 8, 2: 16\}"):
            convert(PER_LAYER, name)
    else:
        back, _ = round_trip(PER_LAYER, name)
        assert {l: sorted(k) for l, k in kept_of(back).items()} == {l: sorted(k) for l, k in kept_of(PER_LAYER).items()}


def test_hipfire_needs_every_decoder_layer_and_no_pruned_mtp_layer():
    dense_first = new_keep_map({1: [0, 1], 2: [2, 3]}, n_experts={1: 8, 2: 8}, num_hidden_layers=3)
    with pytest.raises(ConfigError, match=r"layers \[0\] are not MoE layers"):
        convert(dense_first, "hipfire")
    mtp = new_keep_map({0: [0, 1], 1: [2, 3], 2: [4, 5]}, n_experts={0: 8, 1: 8, 2: 8}, num_hidden_layers=2)
    with pytest.raises(ConfigError, match=r"MTP layers \[2\] are pruned"):
        convert(mtp, "hipfire")
    whole = new_keep_map({0: [0, 1], 1: [2, 3], 2: list(range(8))}, n_experts={0: 8, 1: 8, 2: 8}, num_hidden_layers=2)
    assert json.loads(convert(whole, "hipfire").files["reap_plan.json"])["keep"]["per_layer"] == [[0, 1], [2, 3]]


def test_ascend_ratio_gives_the_kept_count_in_float_arithmetic():
    off = 0
    for n in range(1, 300):
        for k in range(1, n + 1):
            r = ascend_ratio(n, k)
            assert 0 <= r < 1 and int(n * (1 - r)) == k, (n, k, r)
            off += int(n * (1 - (n - k) / n)) != k
    assert off > 0   # (n - k) / n alone falls one short for some: the search is needed
    assert ascend_ratio(128, 64) == 0.5


def test_an_unknown_format_is_refused_listing_the_valid_ones(tmp_path, capsys):
    with pytest.raises(ConfigError, match="valid formats: moejax, riy, evoesap, ascend-jsonl, hipfire"):
        format_named("gguf")
    (tmp_path / "m.json").write_text(json.dumps(UNIFORM))
    with pytest.raises(SystemExit) as exit_:
        main(["keep-map", str(tmp_path / "m.json"), "--to", "gguf"])
    assert exit_.value.code == 2 and "invalid choice: 'gguf'" in capsys.readouterr().err
    (tmp_path / "odd.json").write_text('{"experts": [1, 2]}')
    with pytest.raises(ConfigError, match="--from"):
        read_keep_map_file(tmp_path / "odd.json")


def test_a_malformed_keep_map_is_refused_naming_the_key():
    bad = json.loads(json.dumps(UNIFORM))
    bad["layers"]["1"]["kept"] = [0, 3, 3, 9]
    bad["layers"]["2"]["clusters"] = [[7, 0], [6], [5], [4, 1, 2, 3]]   # a valid partition, leaders first
    bad["mtp"] = "sometimes"
    with pytest.raises(ConfigError) as error:
        check_keep_map(bad, "m.json", top_k=2)
    message = str(error.value)
    assert "layers.1.kept: expert ids [3] given more than once" in message and "[9] outside [0, 8)" in message
    assert "mtp: 'sometimes'" in message and "layers.2.clusters" not in message
    bad["layers"]["2"]["clusters"] = [[6, 0, 1], [7, 2], [5, 3], [4]]
    with pytest.raises(ConfigError, match=r"layers.2.clusters\[0\]: starts with 6"):
        check_keep_map(bad, "m.json")
    with pytest.raises(ConfigError, match="fewer than the model's top_k"):
        check_keep_map(UNIFORM, "m.json", top_k=5)


# --- checkpoints --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pruned(tmp_path_factory):
    """(source, its l1 prune to 4 of 8, another checkpoint): every decoder layer MoE (hipfire's rows)."""
    root = tmp_path_factory.mktemp("keep_map")
    make_checkpoint(root / "src", seed=11, n_group=1, topk_group=1, first_k_dense_replace=0)
    make_checkpoint(root / "other", seed=12, n_group=1, topk_group=1, first_k_dense_replace=0)
    assert main(["prune", str(root / "src"), str(root / "dst"), "--score", "l1", "--keep", "4"]) == 0
    return root / "src", root / "dst", root / "other"


def weights(folder) -> dict:
    """config.json and every shard's bytes (what --keep-map must reproduce; the records differ)."""
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.suffix == ".safetensors" or
            p.name in ("config.json", "model.safetensors.index.json")}


def expert_bytes(folder, layer, e, part="gate_proj"):
    return CheckpointReader(folder).read_bytes(f"model.layers.{layer}.mlp.experts.{e}.{part}.weight")


def router_row(folder, layer, row):
    return CheckpointReader(folder).read(f"model.layers.{layer}.mlp.gate.weight")[row]


def test_a_pruned_checkpoints_keep_map_agrees_with_its_record_and_its_tensors(pruned):
    src, dst, _ = pruned
    keep_map = json.loads((dst / KEEP_MAP).read_text())
    record = json.loads((dst / "pruning.json").read_text())
    assert keep_map["fingerprint"] == record["fingerprint"] == checkpoint_fingerprint(check_checkpoint(src))
    assert keep_map["source"] == str(src.resolve()) and keep_map["method"] == "l1" and keep_map["mtp"] == "prune"
    assert kept_of(keep_map) == {int(l): e["kept"] for l, e in record["layers"].items()} and len(keep_map["layers"]) == 3
    assert check_checkpoint(dst, uniform_experts=False).keep_map == keep_map
    for layer, kept in kept_of(keep_map).items():
        for row, e in enumerate(kept):   # row i of the output holds source expert kept[i]
            for part in ("gate_proj", "up_proj", "down_proj"):
                assert expert_bytes(dst, layer, row, part) == expert_bytes(src, layer, e, part)
            assert np.array_equal(router_row(dst, layer, row), router_row(src, layer, e))


@pytest.mark.parametrize("name", list(FORMATS))
def test_keep_map_from_the_same_source_writes_the_same_bytes(pruned, tmp_path, name, capsys):
    src, dst, _ = pruned
    out = tmp_path / ("map" if FORMATS[name].folder else f"map.{name}")
    assert main(["keep-map", str(dst), "--to", name, "--out", str(out)]) == 0
    ratio = ["--expert-prune-ratio", "0.5"] if name == "ascend-jsonl" else []
    assert main(["prune", str(src), str(tmp_path / "again"), "--keep-map", str(out), *ratio]) == 0
    assert weights(tmp_path / "again") == weights(dst)
    assert kept_of(json.loads((tmp_path / "again" / KEEP_MAP).read_text())) == kept_of(json.loads((dst / KEEP_MAP).read_text()))
    record = json.loads((tmp_path / "again" / "pruning.json").read_text())
    assert record["method"] == "keep_map" and record["keep_map"]["format"] == name
    foreign = name != "moejax"
    assert ("carries no router fingerprint" in capsys.readouterr().out) == foreign


def test_keep_map_in_another_order_writes_ascending_and_says_so(pruned, tmp_path, capsys):
    src, dst, _ = pruned
    kept = kept_of(json.loads((dst / KEEP_MAP).read_text()))
    plan = {"original_experts": 8, "num_layers": 3, "keep": {"per_layer": [kept[l][::-1] for l in range(3)]}}
    (tmp_path / "plan").mkdir()
    (tmp_path / "plan" / "reap_plan.json").write_text(json.dumps(plan))   # HIPFIRE_REAP_PLAN=<dir>: the folder
    assert main(["prune", str(src), str(tmp_path / "again"), "--keep-map", str(tmp_path / "plan")]) == 0
    assert weights(tmp_path / "again") == weights(dst)
    assert "the map's order is not kept" in capsys.readouterr().out


def test_the_keep_map_folder_itself_reproduces_the_prune(pruned, tmp_path):
    src, dst, _ = pruned
    record = prune_checkpoint(src, tmp_path / "again", keep_map=dst)
    assert weights(tmp_path / "again") == weights(dst) and record["keep"] == 4


def test_a_keep_map_of_another_checkpoint_is_refused_before_writing(pruned, tmp_path, capsys):
    src, dst, other = pruned
    want = checkpoint_fingerprint(check_checkpoint(src))
    assert main(["prune", str(other), str(tmp_path / "x"), "--keep-map", str(dst)]) == 2
    err = capsys.readouterr().err
    assert want in err and checkpoint_fingerprint(check_checkpoint(other)) in err and "another model's experts" in err
    assert not list(tmp_path.iterdir())   # nothing written, no staging folder left
    assert main(["keep-map", str(dst), "--to", "riy", "--checkpoint", str(other)]) == 2
    assert want in capsys.readouterr().err
    with pytest.raises(ConfigError, match="takes no --score, --keep"):
        prune_checkpoint(src, tmp_path / "y", score="l1", keep=4, keep_map=dst)
    # a foreign map has no fingerprint: it must fit the checkpoint's layers and counts
    (tmp_path / "p.json").write_text(json.dumps({"version": 1, "model": "m", "pruned_experts": [[1, 2]]}))
    with pytest.raises(ConfigError, match="a riy file lists experts without each layer's expert count"):
        read_keep_map_file(tmp_path / "p.json")
    hip = {"original_experts": 16, "num_layers": 3, "keep": {"per_layer": [[0, 1, 2, 3]] * 3}}
    (tmp_path / "reap_plan.json").write_text(json.dumps(hip))
    with pytest.raises(ConfigError, match="the map's n_experts 16, the checkpoint's 8"):
        prune_checkpoint(src, tmp_path / "z", keep_map=tmp_path / "reap_plan.json")
    assert not (tmp_path / "z").exists()


def test_the_keep_map_command_writes_each_format(pruned, tmp_path, capsys):
    src, dst, _ = pruned
    assert main(["keep-map", str(dst), "--to", "riy"]) == 0
    out = capsys.readouterr()
    keep_map = json.loads((dst / KEEP_MAP).read_text())
    assert json.loads(out.out) == json.loads(convert(keep_map, "riy").files["riy_profile.json"])
    assert json.loads(out.out)["pruned_experts"] == [[l, e] for l in range(3) for e in range(8)
                                                     if e not in kept_of(keep_map)[l]]
    assert main(["keep-map", str(dst), "--to", "ascend-jsonl"]) == 0
    assert '"expert_prune_ratio": 0.5' in capsys.readouterr().err
    assert main(["keep-map", str(dst), "--to", "evoesap"]) == 2   # a folder format needs --out
    assert "--out DIR" in capsys.readouterr().err
    riy = tmp_path / "riy.json"
    assert main(["keep-map", str(dst), "--to", "riy", "--out", str(riy)]) == 0
    assert main(["keep-map", str(riy), "--to", "moejax", "--checkpoint", str(src), "--out", str(tmp_path / "k.json")]) == 0
    assert kept_of(json.loads((tmp_path / "k.json").read_text())) == kept_of(keep_map)
    assert main(["keep-map", str(dst), "--to", "riy", "--out", str(riy)]) == 2   # exists: --overwrite
    assert main(["keep-map", str(dst), "--to", "riy", "--out", str(dst / "x.json")]) == 2   # inside the input


@pytest.fixture
def corrupted(pruned, tmp_path):
    """A copy of the pruned folder whose keep_map.json `edit` changes."""
    def make(edit):
        folder = tmp_path / "copy"
        shutil.rmtree(folder, ignore_errors=True)
        shutil.copytree(pruned[1], folder)
        value = json.loads((folder / KEEP_MAP).read_text())
        edit(value)
        (folder / KEEP_MAP).write_text(json.dumps(value))
        return folder
    return make


@pytest.mark.parametrize("edit, key", [
    (lambda m: m["layers"]["1"].update(kept=[0, 1, 2, 3]), r"layers\.1\.kept: \[0, 1, 2, 3\], but pruning.json has"),
    (lambda m: m["layers"]["1"].update(kept=m["layers"]["1"]["kept"][:3]), r"layers\.1\.kept: 3 experts, but the "
                                                                           r"checkpoint's layer 1 holds 4"),
    (lambda m: m["layers"]["2"].update(kept="all"), r"layers\.2\.kept: expected a list"),
    (lambda m: m["layers"].pop("0"), r"MoE layers \[0\] are not listed"),
    (lambda m: m.update(fingerprint="routers-sha256:" + "0" * 64), "fingerprint: 'routers-sha256:000"),
    (lambda m: m.update(version=2), "version: 2, expected 1"),
    (lambda m: m.update(extra=1), r"unknown keys \['extra'\]"),
])
def test_a_corrupted_keep_map_makes_inspect_and_loading_refuse_naming_the_key(corrupted, edit, key, capsys):
    from moejax.hf.model_io import open_checkpoint

    folder = corrupted(edit)
    assert main(["inspect", str(folder)]) == 2
    err = capsys.readouterr().err
    assert "keep_map.json" in err and __import__("re").search(key, err), err
    with pytest.raises(CheckpointError, match=key):
        open_checkpoint(folder)


def test_inspect_shows_the_kept_counts_and_the_source_fingerprint(pruned, capsys):
    src, dst, _ = pruned
    assert main(["inspect", str(dst), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["keep_map"]["kept"] == {"0": [4, 8], "1": [4, 8], "2": [4, 8]}
    assert report["keep_map"]["fingerprint"] == checkpoint_fingerprint(check_checkpoint(src))
    assert main(["inspect", str(src), "--json"]) == 0 and json.loads(capsys.readouterr().out)["keep_map"] is None
    assert main(["inspect", str(dst)]) == 0
    assert "kept per layer  0: 4/8, 1: 4/8, 2: 4/8" in capsys.readouterr().out


def test_mtp_policies_are_recorded_and_reproduced(pruned, tmp_path):
    src = with_mtp_layer(pruned[0], tmp_path / "mtp")   # layer 3, as DeepSeek-V3 ships it
    for mtp, want in (("keep", {3: list(range(8))}), ("drop", {})):
        dst = tmp_path / mtp
        prune_checkpoint(src, dst, score="l1", keep=4, mtp=mtp)
        keep_map = json.loads((dst / KEEP_MAP).read_text())
        assert keep_map["mtp"] == mtp and keep_map["num_hidden_layers"] == 3
        assert keep_map["dropped_layers"] == ([3] if mtp == "drop" else [])
        assert {l: k for l, k in kept_of(keep_map).items() if l >= 3} == want
        record = prune_checkpoint(src, tmp_path / f"{mtp}_again", keep_map=dst)
        assert record["mtp"] == mtp and weights(tmp_path / f"{mtp}_again") == weights(dst)


def test_reroutes_writer_carries_the_keep_map(pruned, tmp_path):
    from moejax.surgery.reroute import _write

    _, dst, _ = pruned
    _write(check_checkpoint(dst, uniform_experts=False).reader, {}, dst, tmp_path / "rerouted", {"x": 1}, False)
    assert (tmp_path / "rerouted" / KEEP_MAP).read_bytes() == (dst / KEEP_MAP).read_bytes()
    assert check_checkpoint(tmp_path / "rerouted", uniform_experts=False).keep_map is not None


def test_a_merged_checkpoints_keep_map_holds_its_clusters(pruned, tmp_path):
    src = pruned[0]
    np.save(tmp_path / "calib.npy", np.random.default_rng(6).integers(0, 96, size=(4, 16)).astype(np.int32))
    assert main(["merge", str(src), str(tmp_path / "merged"), "--method", "m_smoe", "--keep", "4",
                 "--tokens", str(tmp_path / "calib.npy")]) == 0
    dst = tmp_path / "merged"
    keep_map = json.loads((dst / KEEP_MAP).read_text())
    record = json.loads((dst / "pruning.json").read_text())
    assert keep_map["form"] == "shrunk" and keep_map["method"] == "m_smoe"
    assert keep_map["fingerprint"] == checkpoint_fingerprint(check_checkpoint(src))
    merged = 0
    for l, entry in keep_map["layers"].items():
        assert entry["clusters"] == record["layers"][l]["clusters"] and entry["kept"] == record["layers"][l]["kept"]
        assert [c[0] for c in entry["clusters"]] == entry["kept"] == sorted(entry["kept"])
        for row, cluster in enumerate(entry["clusters"]):   # the leader's router row; a singleton's bytes
            assert np.array_equal(router_row(dst, int(l), row), router_row(src, int(l), cluster[0]))
            if len(cluster) == 1:
                assert expert_bytes(dst, int(l), row) == expert_bytes(src, int(l), cluster[0])
            else:
                merged += 1
                assert expert_bytes(dst, int(l), row) != expert_bytes(src, int(l), cluster[0])
    assert merged
    assert check_checkpoint(dst).keep_map == keep_map
    assert any("merge's" in note for note in convert(keep_map, "riy").notes)


def test_a_substituted_checkpoints_keep_map_lists_its_substituted_experts(pruned, tmp_path):
    src = pruned[0]
    np.save(tmp_path / "calib.npy", np.random.default_rng(8).integers(0, 96, size=(4, 16)).astype(np.int32))
    assert main(["prune", str(src), str(tmp_path / "sub"), "--substitute", "--score", "mone", "--keep", "4",
                 "--tokens", str(tmp_path / "calib.npy")]) == 0
    dst = tmp_path / "sub"
    keep_map = json.loads((dst / KEEP_MAP).read_text())
    record = json.loads((dst / "pruning.json").read_text())
    assert keep_map["form"] == "substituted"
    for l, entry in keep_map["layers"].items():
        assert entry["substituted"] == record["layers"][l]["substituted"] and entry["kept"] == record["layers"][l]["kept"]
        assert sorted(entry["kept"] + entry["substituted"]) == list(range(8)) and len(entry["kept"]) == 4
        for e in entry["kept"]:   # retained experts keep their logical names and the source's bytes
            assert expert_bytes(dst, int(l), e) == expert_bytes(src, int(l), e)
    assert check_checkpoint(dst, uniform_experts=False, substituted=True).keep_map == keep_map
    # the check compares it with config.json's declaration: another substituted set is refused by key
    swapped = json.loads(json.dumps(keep_map))
    entry = swapped["layers"]["1"]
    entry["kept"][0], entry["substituted"][0] = entry["substituted"][0], entry["kept"][0]
    (dst / KEEP_MAP).write_text(json.dumps(swapped))
    with pytest.raises(CheckpointError, match=r"layers\.1\.substituted: .*but config.json substitutes"):
        check_checkpoint(dst, uniform_experts=False, substituted=True)
