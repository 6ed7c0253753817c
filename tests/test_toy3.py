"""toy3 end to end on small sizes: against the independent numpy implementation, and the schema."""

import numpy as np
import pandas as pd
import pytest

from bench_toy3 import numpy_toy3
from moejax.errors import ConfigError
from moejax.experiments import toy3

SMALL = dict(n_calib=700, n_heldout=500, balance_steps=25)


@pytest.fixture(scope="module")
def small_run():
    cfg = toy3.Toy3Config(seed=3, seeds=2, keep=(8, 0.5, 64), **SMALL)
    df, timings = toy3.run(cfg)
    return cfg, df


def test_matches_numpy_per_expert_loop(small_run):
    cfg, df = small_run
    ref = numpy_toy3(cfg, toy3.draw_inputs(cfg, [3, 4]), [3, 4]).astype({"keep": "Int64"})
    key = ["offset", "load", "seed", "score", "keep", "metric"]
    both = df.merge(ref, on=key, how="outer", suffixes=("", "_np"), indicator=True)
    assert (both["_merge"] == "both").all()
    exact = both.metric.isin(["overlap_frequency", "top16_share"])
    np.testing.assert_array_equal(both.value[exact], both.value_np[exact])
    np.testing.assert_allclose(both.value[~exact], both.value_np[~exact], rtol=1e-4, atol=1e-7)


def test_schema_and_invariants(small_run):
    cfg, df = small_run
    assert list(df.columns) == ["offset", "load", "seed", "score", "keep", "metric", "value"]
    assert set(df.metric) == {"rel_error", "rel_error_median", "overlap_frequency", "top16_share"}
    share = df[df.metric == "top16_share"]
    assert share.score.isna().all() and share.keep.isna().all() and len(share) == 2 * 2 * 2
    assert sorted(df.keep.dropna().unique()) == [8, 32, 64]  # 0.5 of E=64 -> 32
    assert sorted(df.seed.unique()) == [3, 4]
    full = df[(df.keep == 64) & df.metric.isin(["rel_error", "rel_error_median"])]
    assert (full.value == 0).all()  # keeping every expert changes nothing
    freq = df[(df.score == "frequency") & (df.metric == "overlap_frequency")]
    assert (freq.value == freq.keep).all()
    small = df[(df.keep == 8) & (df.metric == "rel_error")]
    assert (small.value > 0.1).all()


def test_seeds_are_independent_of_batching():
    a, _ = toy3.run(toy3.Toy3Config(seeds=3, keep=(16,), seed_batch=2, **SMALL))
    b, _ = toy3.run(toy3.Toy3Config(seeds=3, keep=(16,), seed_batch=3, **SMALL))
    key = ["offset", "load", "seed", "score", "keep", "metric"]
    a, b = (d.sort_values(key, na_position="first").reset_index(drop=True) for d in (a, b))
    pd.testing.assert_frame_equal(a[key], b[key])
    np.testing.assert_allclose(a.value, b.value, rtol=1e-5)


@pytest.mark.parametrize("kw,match", [
    (dict(keep=(2,)), "below top_k=4"),
    (dict(keep=(65,)), "exceeds"),
    (dict(seeds=0), "seeds >= 1"),
    (dict(scores=("frequency", "nope")), "valid scores"),
    (dict(offsets=("sideways",)), "valid values"),
    (dict(scores=("reap_code",)), "use reap"),
])
def test_bad_settings_fail_before_compute(kw, match):
    with pytest.raises(ConfigError, match=match):
        toy3.Toy3Config(**kw).validate()


def test_unknown_setting_is_named():
    with pytest.raises(ConfigError, match="unknown setting.*n_experst"):
        toy3.Toy3Config.from_mapping({"n_experst": 8})
