"""toy3 end to end on small sizes: against the independent numpy implementation (sigmoid router in
tests/toy3_reference.py, softmax router here), and the schema."""


import numpy as np
import pandas as pd
import pytest

from toy3_reference import np_keep_mask, np_route, np_routed_output, np_scores, numpy_toy3, variant_rows
from moejax.errors import ConfigError
from moejax.experiments import toy3

SMALL = dict(n_calib=700, n_heldout=500, balance_steps=25, merges=(), eq6_pairs=0)  # merging: test_toy3_merging.py


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


@pytest.mark.slow  # ~18 s; both paths are checked against numpy by default (here and test_toy3_merging.py)
def test_held_out_table_made_in_either_stage_gives_the_same_bits():
    """Without merges stage two tabulates each (seed, offset) in its loop; with merges stage one
    tabulates them all for them. The pruning rows must not depend on which."""
    from moejax.merging.method import parse

    tiny = dict(SMALL, n_calib=300, n_heldout=200, balance_steps=10, keep=(8, 32), loads=("skewed",))
    a, _ = toy3.run(toy3.Toy3Config(seeds=1, **tiny))
    b, _ = toy3.run(toy3.Toy3Config(seeds=1, **{**tiny, "merges": (parse("hc_smoe"),)}))
    assert not toy3.merges_read_table(toy3.Toy3Config(**tiny))
    key = ["offset", "load", "seed", "score", "keep", "metric"]
    b = b[~b.score.fillna("").str.contains(":")].reset_index(drop=True)
    a, b = (d.sort_values(key, na_position="first").reset_index(drop=True) for d in (a, b))
    pd.testing.assert_frame_equal(a, b, check_exact=True)


@pytest.mark.parametrize("kw,match", [
    (dict(keep=(2,)), "below top_k=4"),
    (dict(keep=(65,)), "exceeds"),
    (dict(seeds=0), "seeds >= 1"),
    (dict(scores=("frequency", "nope")), "valid scores"),
    (dict(offsets=("sideways",)), "valid values"),
    (dict(scores=("reap_code",)), "use reap"),
    (dict(router="tanh"), "router='tanh'; valid routers"),
    (dict(router="softmax"), r"loads=\['skewed', 'balanced'\] with router=softmax.*loads=\[skewed\]"),
    (dict(router="softmax", loads=("balanced",)), "router=softmax"),
    (dict(router="softmax", loads=("skewed",), scores=("signed", "bias")), r"router=softmax.*\['bias'\]"),
])
def test_bad_settings_fail_before_compute(kw, match):
    with pytest.raises(ConfigError, match=match):
        toy3.Toy3Config(**kw).validate()


def test_unknown_setting_is_named():
    with pytest.raises(ConfigError, match="unknown setting.*n_experst"):
        toy3.Toy3Config.from_mapping({"n_experst": 8})


def test_default_router_is_sigmoid():
    """The default stays today's sigmoid layer (whose results test_matches_numpy_per_expert_loop pins),
    in the dataclass and so in the Hydra config composed from it (moejax.experiments.hydra_defaults)."""
    from moejax.experiments import hydra_defaults

    assert toy3.Toy3Config().router == "sigmoid"
    assert hydra_defaults("toy3")["toy"]["router"] == "sigmoid"
    cfg = toy3.Toy3Config.from_mapping({"router": "softmax", "loads": ["skewed"]})
    assert cfg.router == "softmax" and not cfg.has_balance_bias


def np_softmax(logits_TE):
    """exp(l_j - max l) / sum_i exp(l_i - max l) over the last axis; -inf logits (pruned) get 0."""
    z = np.exp(logits_TE - logits_TE.max(axis=-1, keepdims=True))
    return z / z.sum(axis=-1, keepdims=True)


def np_softmax_route(logits_TE, kept_E, top_k):
    """A (pruned) softmax router from the definitions: s = softmax over the kept experts' logits, the
    top K of s (ties to the lower index), gates s renormalised over the K."""
    s = np_softmax(np.where(kept_E, logits_TE, -np.inf))
    return np_route(np.where(kept_E, s, -np.inf), s, top_k)


def numpy_toy3_softmax(cfg, inputs, seeds):
    """toy3's skewed load under a softmax router (no bias), in numpy; the same tidy rows as moejax."""
    keeps, rows = cfg.keep_counts(), []
    for seed, inp in zip(seeds, inputs):
        router, w1, w2 = inp["router"], inp["w1"], inp["w2"]
        every = np.ones(router.shape[0], bool)
        for o, offset in enumerate(cfg.offsets):
            x_cal, x_held = inp["x_cal"][o], inp["x_held"][o]
            base = dict(offset=offset, load="skewed", seed=int(seed))
            idx, gate = np_softmax_route(x_cal @ router.T, every, cfg.top_k)
            _, norms = np_routed_output(x_cal, idx, gate, w1, w2)
            counts = np.bincount(idx.ravel(), minlength=router.shape[0]).astype(np.float64)
            gns = np.bincount(idx.ravel(), weights=(gate * norms).ravel().astype(np.float64), minlength=len(every))
            ns = np.bincount(idx.ravel(), weights=norms.ravel().astype(np.float64), minlength=len(every))
            usage = np.sort(counts)[::-1]
            rows.append({**base, "score": None, "keep": None, "metric": "top16_share",
                         "value": usage[:16].sum() / usage.sum()})
            y, _ = np_routed_output(x_held, *np_softmax_route(x_held @ router.T, every, cfg.top_k), w1, w2)
            for name in cfg.scores:
                score = np_scores(name, counts, gns, ns, router, None, x_cal.mean(0, dtype=np.float64), seed,
                                  routed=(idx, norms), experts=(w1, w2))
                for keep in keeps:
                    kept = np_keep_mask(score, keep)
                    y_p, _ = np_routed_output(x_held, *np_softmax_route(x_held @ router.T, kept, cfg.top_k), w1, w2)
                    rows += variant_rows({**base, "score": name, "keep": keep}, kept, counts, y_p, y)
    return pd.DataFrame(rows)


def test_softmax_router_matches_numpy():
    cfg = toy3.Toy3Config(seed=5, seeds=1, keep=(8, 0.5, 64), router="softmax", loads=("skewed",),
                          scores=("frequency", "signed", "l1", "reap", "man", "msan", "max_act", "aimer"), **SMALL)
    df, _ = toy3.run(cfg)
    ref = numpy_toy3_softmax(cfg, toy3.draw_inputs(cfg, [5]), [5]).astype({"keep": "Int64"})
    key = ["offset", "load", "seed", "score", "keep", "metric"]
    both = df.merge(ref, on=key, how="outer", suffixes=("", "_np"), indicator=True)
    assert (both["_merge"] == "both").all() and len(both) == len(df) == len(ref)
    exact = both.metric.isin(["overlap_frequency", "top16_share"])
    np.testing.assert_array_equal(both.value[exact], both.value_np[exact])
    np.testing.assert_allclose(both.value[~exact], both.value_np[~exact], rtol=1e-4, atol=1e-7)
    full = df[(df.keep == 64) & df.metric.isin(["rel_error", "rel_error_median"])]
    assert (full.value == 0).all()


def test_stage_two_compiled_ahead_is_what_the_job_calls(caplog):
    """A cold job compiles the held-out table's program and stage two's (the K-th values, the pruning
    and the merges' programs) on a second thread from the shapes alone (`job._compile_ahead`); the
    job's own calls must then find them compiled: each program compiles exactly once (a shape or
    dtype in `compile_for` that differs from the call's compiles it a second time, on the main thread)."""
    import logging

    import jax

    cfg = toy3.Toy3Config(seeds=1, n_calib=300, n_heldout=200, balance_steps=5, keep=(16,), eq6_pairs=2,
                          offsets=("ones",))
    jax.config.update("jax_log_compiles", True)
    try:
        with caplog.at_level(logging.WARNING, logger="jax"):
            toy3.run(cfg)
    finally:
        jax.config.update("jax_log_compiles", False)
    done = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Finished XLA compilation of jit(")]
    names = ("_pruning_errors", "_merges_errors", "kth_values", "tabulate")
    counts = {name: sum(f"jit({name})" in m for m in done) for name in names}
    # stage_two's and stage_merges' programs, and the K-th values (every masked variant's, once) and
    # the held-out table (`held_table`) they read
    assert counts == dict.fromkeys(names, 1), done


def test_a_job_in_a_fresh_interpreter():
    """`toy3.run` called right after importing toy3, JAX not yet imported: the job's background
    imports (`job._import_in_background`) must not race the main thread into JAX's circular imports
    (importing moejax's merging modules there deadlocked jax.numpy's import, or left `jax` half
    imported, in every such run)."""
    import subprocess
    import sys

    code = ("import moejax.experiments.toy3 as t\n"
            "df, _ = t.run(t.Toy3Config(seeds=1, n_calib=300, n_heldout=200, balance_steps=5, keep=(16,), "
            "eq6_pairs=2, offsets=('ones',)))\n"
            "print('rows', len(df))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and "rows " in out.stdout, out.stderr[-3000:]
