"""Remote checkpoints (moejax.hf.io.storage, moejax.hf.io.remote): a range-capable HTTP server started
here on 127.0.0.1 serves a tiny checkpoint; inspect, diff and data-free scores of the served copy
equal those of the local folder, the bytes sent are exactly config.json + index + headers (+ the
router and bias tensors), and a missing shard, a server that ignores Range, a truncated body and a
transient 503 each get the answer they should."""

from __future__ import annotations

import json
import re
from pathlib import Path

import ml_dtypes
import numpy as np
import pandas as pd
import pytest

pytest.importorskip("fsspec")
pytest.importorskip("aiohttp")

from hf_fixtures import full_config, spec_shapes  # noqa: E402
from range_server import serve

from moejax.cli import main  # noqa: E402
from moejax.errors import CheckpointError, ConfigError  # noqa: E402
from moejax.hf.io import remote  # noqa: E402
from moejax.hf.io.checkpoint_reader import CheckpointReader  # noqa: E402
from moejax.hf.io.checkpoint_writer import write_checkpoint  # noqa: E402
from moejax.hf.io.location import open_location  # noqa: E402
from moejax.hf.io.safetensors_format import CONFIG_NAME, INDEX_NAME  # noqa: E402
from moejax.hf.io.storage import MissingFile  # noqa: E402
from moejax.scoring.score_checkpoint import score_data_free  # noqa: E402
from moejax.surgery.diff import diff_checkpoints  # noqa: E402
from moejax.surgery.inspect import inspect_checkpoint  # noqa: E402
from moejax.surgery.prune import prune_checkpoint  # noqa: E402

ROUTER = re.compile(r"\.mlp\.gate\.(weight|e_score_correction_bias)$")


# --------------------------------------------------------------------------------------------
# A tiny checkpoint, served
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A complete DeepSeek-V3 checkpoint (BASE config, flat routing: two MoE layers of 8 experts with
    balance biases) in several shards, built from numpy (routers F32, the rest BF16), and an
    l1-pruned copy."""
    root = tmp_path_factory.mktemp("remote")
    rng = np.random.default_rng(0)
    config = full_config(n_group=1, topk_group=1)  # flat routing: any keep is a valid selection
    tensors = [(name, rng.standard_normal(shape).astype(np.float32 if ".mlp.gate." in name else ml_dtypes.bfloat16))
               for name, shape in spec_shapes(config)]
    write_checkpoint(root / "src", tensors, config, max_shard_bytes=60_000)
    prune_checkpoint(root / "src", root / "pruned", score="l1", keep=4)
    return root


@pytest.fixture(scope="module")
def server(checkpoints):
    with serve(checkpoints) as running:
        yield running


@pytest.fixture
def served(server):
    """The server, well-behaved and with an empty log, for one test (and reset after it)."""
    server.reset()
    yield server
    server.reset()


def url(server, name: str) -> str:
    return server.url(name)


def expected_reads(folder: Path, prefetch: int, tensors=()) -> tuple[int, int]:
    """(bytes, requests) that reading `folder`'s config, index and every shard header (and then
    `tensors`) should cost: per shard min(prefetch, size) bytes in one request, plus one more
    request for the rest of a header longer than that; one request per tensor, its bytes."""
    nbytes, requests = (folder / CONFIG_NAME).stat().st_size + (folder / INDEX_NAME).stat().st_size, 2
    for shard in sorted(set(json.loads((folder / INDEX_NAME).read_text())["weight_map"].values())):
        size = (folder / shard).stat().st_size
        header_end = 8 + int.from_bytes((folder / shard).read_bytes()[:8], "little")
        nbytes += max(min(prefetch, size), header_end)
        requests += 1 + (header_end > prefetch)
    reader = CheckpointReader(folder)
    return nbytes + sum(reader.info(n).nbytes for n in tensors), requests + len(tensors)


# --------------------------------------------------------------------------------------------
# The same answers, local or served
# --------------------------------------------------------------------------------------------


def test_inspect_and_plan_of_served_equal_local(checkpoints, server, served, capsys):
    local = inspect_checkpoint(checkpoints / "src")
    there = inspect_checkpoint(url(server, "src"))
    assert there.pop("checkpoint") == url(server, "src")
    local.pop("checkpoint")
    assert there == local
    assert main(["plan", url(server, "src"), "--json"]) == 0
    plan_remote = json.loads(capsys.readouterr().out)
    assert main(["plan", str(checkpoints / "src"), "--json"]) == 0
    plan_local = json.loads(capsys.readouterr().out)
    assert plan_remote.pop("checkpoint") == url(server, "src")
    plan_local.pop("checkpoint")
    assert plan_remote == plan_local
    assert all(r.range is not None for r in served.log if r.path.endswith(".safetensors"))  # ranges only


@pytest.mark.parametrize("prefetch", [1024, remote.HEADER_PREFETCH])
def test_bytes_read_are_headers_and_router_rows_exactly(checkpoints, server, served, prefetch):
    """1 KiB: every header needs a second request; the default 128 KiB: one request each (and a
    tiny shard is read whole, as the prefetch asks for more than it holds)."""
    src = checkpoints / "src"
    storage = open_location(url(server, "src"), header_prefetch=prefetch)
    inspect_checkpoint(storage)
    want_bytes, want_requests = expected_reads(src, prefetch)
    assert (served.sent(), len(served.log)) == (want_bytes, want_requests)
    assert (storage.stats.bytes, storage.stats.requests) == (want_bytes, want_requests)
    assert all(r.status == 206 for r in served.log if r.path.endswith(".safetensors"))

    served.reset()
    routers = [n for n in CheckpointReader(src).keys() if ROUTER.search(n)]
    assert len(routers) == 4  # two MoE layers: gate.weight and its balance bias
    score_data_free(open_location(url(server, "src"), header_prefetch=prefetch), scores=["l1", "signed", "bias"])
    want_bytes, want_requests = expected_reads(src, prefetch, routers)
    assert (served.sent(), len(served.log)) == (want_bytes, want_requests)
    total = sum(p.stat().st_size for p in src.iterdir())
    if prefetch == 1024:
        assert served.sent() < total / 4


def test_data_free_scores_of_served_equal_local_bitwise(checkpoints, server, served, tmp_path):
    names = ["bias", "signed", "l1", "random"]
    local = score_data_free(checkpoints / "src", scores=names, seed=3)
    there = score_data_free(url(server, "src"), scores=names, seed=3, out=tmp_path / "s.parquet")
    pd.testing.assert_frame_equal(there, local, check_exact=True)
    pd.testing.assert_frame_equal(pd.read_parquet(tmp_path / "s.parquet"), local, check_exact=True)
    assert json.loads((tmp_path / "s.json").read_text())["checkpoint"] == url(server, "src")
    # the CLI, without calibration data: data-free scores only
    assert main(["score", url(server, "src"), "--scores", "l1,bias", "--out", str(tmp_path / "c.parquet")]) == 0
    cli = pd.read_parquet(tmp_path / "c.parquet")
    pd.testing.assert_frame_equal(cli, score_data_free(checkpoints / "src", scores=["l1", "bias"]), check_exact=True)


def test_diff_of_local_source_against_served_pruned_copy(checkpoints, server, served, capsys):
    src, pruned = str(checkpoints / "src"), str(checkpoints / "pruned")
    assert main(["diff", src, pruned, "--json"]) == 0
    both_local = json.loads(capsys.readouterr().out)
    assert main(["diff", src, url(server, "pruned"), "--json"]) == 0
    mixed = json.loads(capsys.readouterr().out)
    assert mixed.pop("pruned") == url(server, "pruned")
    both_local.pop("pruned")
    assert mixed == both_local
    assert both_local["summary"]["all_rows_identical"] and both_local["summary"]["l1_reproduces_layers"] == "2/2"
    # both served, every other tensor's bytes hashed by range requests too: the same selection, all equal
    hashed = diff_checkpoints(url(server, "src"), url(server, "pruned"), hash_tensors=True)
    assert hashed["layers"] == both_local["layers"] and hashed["tensors"]["bytes_differ"] == []


# --------------------------------------------------------------------------------------------
# Failures
# --------------------------------------------------------------------------------------------


@pytest.fixture
def quick_retries(monkeypatch):
    monkeypatch.setattr(remote, "RETRY_DELAYS", (0.01, 0.01, 0.01))


def shard_names(folder: Path) -> list[str]:
    return sorted(set(json.loads((folder / INDEX_NAME).read_text())["weight_map"].values()))


def test_missing_shard_is_named(checkpoints, server, served, capsys):
    missing = shard_names(checkpoints / "src")[2]
    served.hidden = {missing}
    with pytest.raises(MissingFile, match=rf"names a shard that does not exist: .*/src/{missing}: not found \(HTTP 404\)"):
        inspect_checkpoint(url(server, "src"))
    assert main(["inspect", url(server, "src")]) == 2
    assert missing in capsys.readouterr().err


def test_server_ignoring_ranges_is_refused_before_reading(checkpoints, server, served):
    served.ranges = False
    storage = open_location(url(server, "src"), header_prefetch=1024)
    shard = rf"{url(server, 'src')}/model-\d+-of-\d+\.safetensors"
    with pytest.raises(CheckpointError, match=rf"{shard}: the server ignored the Range request for bytes 0-1023 "
                                              r"and began sending the whole file \(HTTP 200, \d+ bytes"):
        inspect_checkpoint(storage)
    # config.json and the index, read whole; no shard byte was taken
    assert storage.stats.bytes == sum((checkpoints / "src" / name).stat().st_size for name in (CONFIG_NAME, INDEX_NAME))


def test_transient_503_is_retried(checkpoints, server, served, quick_retries):
    served.fail_next = 2  # the first request (config.json) fails twice, the third attempt succeeds
    local = inspect_checkpoint(checkpoints / "src")
    there = inspect_checkpoint(url(server, "src"))
    assert [r.status for r in served.log[:3]] == [503, 503, 200]
    assert {k: v for k, v in there.items() if k != "checkpoint"} == {k: v for k, v in local.items() if k != "checkpoint"}
    served.reset()
    served.fail_next = 4  # every attempt fails: a clear error naming the file
    with pytest.raises(CheckpointError, match=rf"{CONFIG_NAME}: HTTP 503 .*gave up after 4 attempts"):
        inspect_checkpoint(url(server, "src"))


def test_truncated_body_is_retried_then_refused(checkpoints, server, served, quick_retries):
    storage = open_location(url(server, "src"))
    shard = storage.root / shard_names(checkpoints / "src")[0]
    served.truncate = True  # half of each body, then the connection closes
    with pytest.raises(CheckpointError, match=rf"{shard} \(bytes 100-1123\): truncated response.*gave up after 4 attempts"):
        storage.read_range(shard, 100, 1024)
    assert [(r.range, r.sent) for r in served.log] == [("bytes=100-1123", 512)] * 4


def test_commands_that_need_every_weight_refuse_remote_sources(server, served, tmp_path, capsys):
    assert main(["prune", url(server, "src"), str(tmp_path / "out"), "--score", "l1", "--keep", "4"]) == 2
    assert "takes a local folder only" in capsys.readouterr().err
    assert main(["score", url(server, "src"), "--tokens", str(tmp_path / "t.npy"), "--out", str(tmp_path / "x.parquet")]) == 2
    assert "takes a local folder only" in capsys.readouterr().err
    assert main(["score", url(server, "src"), "--scores", "reap", "--out", str(tmp_path / "x.parquet")]) == 2
    assert "need a calibration pass" in capsys.readouterr().err
    assert not (tmp_path / "out").exists() and served.log == []


# --------------------------------------------------------------------------------------------
# hf:// locations
# --------------------------------------------------------------------------------------------


@pytest.fixture
def hub(server, served):
    """HfFileSystem options pointing hf://hub/NAME at the test server (no token, no network)."""
    pytest.importorskip("huggingface_hub")
    from huggingface_hub import constants

    if getattr(constants, "is_offline_mode", lambda: constants.HF_HUB_OFFLINE)():
        pytest.skip("HF_HUB_OFFLINE is set")
    return {"endpoint": server.hub_endpoint, "token": False}


def test_hf_repository_through_hffilesystem(checkpoints, server, served, hub):
    storage = open_location("hf://hub/src@main", header_prefetch=1024, **hub)
    there, local = inspect_checkpoint(storage), inspect_checkpoint(checkpoints / "src")
    assert there.pop("checkpoint") == "hf://hub/src@main"
    local.pop("checkpoint")
    assert there == local
    assert (served.sent(), len(served.log)) == expected_reads(checkpoints / "src", 1024)  # the same ranges as https
    names = ["bias", "signed", "l1"]
    pd.testing.assert_frame_equal(score_data_free(storage, scores=names),
                                  score_data_free(checkpoints / "src", scores=names), check_exact=True)
    served.hidden = {shard_names(checkpoints / "src")[1]}
    with pytest.raises(MissingFile, match=rf"hf://hub/src@main/{shard_names(checkpoints / 'src')[1]}: not found"):
        inspect_checkpoint(open_location("hf://hub/src@main", **hub))


@pytest.mark.parametrize("location,path", [
    ("hf://deepseek-ai/DeepSeek-V3", "deepseek-ai/DeepSeek-V3"),
    ("hf://deepseek-ai/DeepSeek-V3@main", "deepseek-ai/DeepSeek-V3@main"),
    ("hf://org/name@4c1f24cc10a2a1894304c7ab52edd9710c047571/",
     "org/name@4c1f24cc10a2a1894304c7ab52edd9710c047571"),
    ("hf://org/name@refs/pr/3/sub/dir", "org/name@refs/pr/3/sub/dir"),
    ("hf://org/name@refs%2Fconvert%2Fx", "org/name@refs%2Fconvert%2Fx"),
    ("hf://org/name/pruned", "org/name/pruned"),
])
def test_hf_locations_map_to_hffilesystem_paths(location, path):
    assert remote.hub_path(location) == path


@pytest.mark.parametrize("location", ["hf://gpt2", "hf://datasets/org/name", "hf://", "hf://org/name@"])
def test_bad_hf_locations_are_refused(location):
    with pytest.raises(ConfigError, match="expected hf://org/name"):
        remote.hub_path(location)


def test_remote_paths_behave_like_the_paths_the_reader_uses():
    root = remote.RemotePath("https://host/a b")
    shard = root / "sub/model-00001.safetensors"
    assert str(shard) == "https://host/a b/sub/model-00001.safetensors" and shard.name == "model-00001.safetensors"
    assert (root / "x y.safetensors").url == "https://host/a b/x%20y.safetensors"  # the base is used as given
    assert (root / "model.safetensors.index.json").parent / "x.safetensors" == root / "x.safetensors"
    assert str(shard.relative_to(root)) == "sub/model-00001.safetensors"
    assert not hasattr(shard, "__fspath__")  # never opened as a local file by mistake
    with pytest.raises(ConfigError, match="unsupported location"):
        open_location("s3://bucket/ckpt")


def test_location_without_config_is_named_by_its_config(server, served, capsys):
    """A URL that is not a checkpoint folder (a typo, the parent folder) is refused naming the
    config.json it lacks, not the weights (an https:// server cannot be listed)."""
    with pytest.raises(MissingFile, match=rf"{url(server, 'nothing')}/{CONFIG_NAME}: file is missing; a checkpoint "
                                          "location is the folder that holds config.json"):
        inspect_checkpoint(url(server, "nothing"))
    served.hidden = {CONFIG_NAME}  # the weights are there, config.json is not
    assert main(["inspect", url(server, "src")]) == 2
    err = capsys.readouterr().err
    assert f"src/{CONFIG_NAME}: file is missing" in err and "safetensors" not in err
