"""The merge-method registry (`moejax.registry`, `moejax.merging.method`, issue 44): `parse` is the only
check of a name, a method's settings are checked when it is made, and a method added as its own
class with `@register` reaches every caller (the CLI's choices, the experiments' `merge` block and
configs, `merge_layer`, toy3's layout) with nothing else touched."""

import dataclasses

import numpy as np
import pytest

from moejax.errors import ConfigError
from moejax.merging.clusters import FrequencyAveraged, HcSmoe
from moejax.merging.method import MERGE_METHODS, MergeContext, parse, register
from moejax.merging.ream import Ream


def test_parse_is_the_one_name_check():
    assert MERGE_METHODS.names() == ("hc_smoe", "m_smoe", "ream")
    assert parse("ream", group_size=8) == Ream(group_size=8) and parse("ream").group_size == 16
    assert str(parse("ream", group_size=8)) == "ream(group_size=8)" and str(parse("hc_smoe")) == "hc_smoe"
    assert parse("hc_smoe").record() == {"method": "hc_smoe", "settings": {"clustering": "average"}}
    for name, settings, message in [
            ("zipit", {}, r"^unknown merge method 'zipit'; valid: \['hc_smoe', 'm_smoe', 'ream'\]"),
            ("m_smoe", {"score": "reap"}, r"^merge method m_smoe: unknown setting\(s\) \['score'\]; its settings: none"),
            ("ream", {"group_size": "8"}, r"^merge method ream: group_size='8'; expected an integer \(default 16\)"),
            ("ream", {"group_size": True}, r"expected an integer"),
            ("ream", {"group_size": -1}, r"group_size=-1"),
            ("ream", {"tokens": 0}, r"ream_tokens=0"),
            ("ream", {"score": "signed"}, r"can be negative"),
            ("hc_smoe", {"clustering": "ward"}, r"clustering='ward'")]:
        with pytest.raises(ConfigError, match=message):
            parse(name, **settings)
    with pytest.raises(ConfigError, match="cannot be overridden"):
        parse(parse("ream"), group_size=4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        parse("ream").group_size = 4


def test_parse_all_lists_with_their_settings_block():
    """The experiments' form: names plus {name: settings}; a method already made takes the block's
    settings over its own; a repeat, or settings for an unknown method, are refused."""
    hc, ream = MERGE_METHODS.parse_all(["hc_smoe", "ream"], {"ream": {"group_size": 4}})
    assert (hc, ream) == (HcSmoe(), Ream(group_size=4))
    assert MERGE_METHODS.parse_all((Ream(tokens=7),), {"ream": {"group_size": 4}}) == (Ream(group_size=4, tokens=7),)
    with pytest.raises(ConfigError, match=r"names \['ream'\] more than once"):
        MERGE_METHODS.parse_all(["ream", "ream"])
    with pytest.raises(ConfigError, match=r"settings for unknown merge method\(s\) \['zipit'\]"):
        MERGE_METHODS.parse_all(["ream"], {"zipit": {}})


@pytest.fixture
def first_k():
    """A fourth method, defined here as a new module would define it: its class and `@register`."""
    @register("first_k")
    class FirstK(FrequencyAveraged):
        """Experts 0 .. keep - 2 alone, every other expert in one cluster; frequency-averaged."""
        spread: int = 0   # a setting of its own

        def check_settings(self):
            if self.spread < 0:
                raise ConfigError(f"first_k: spread={self.spread}: expected >= 0")

        def clusters(self, keep, ctx):
            return np.minimum(np.arange(len(ctx.counts_E)), keep - 1)

    yield FirstK
    MERGE_METHODS._classes.pop("first_k")


def test_a_new_method_is_its_class_and_nothing_else(first_k, tmp_path):
    from moejax.cli import build_parser
    from moejax.experiments import hydra_defaults
    from moejax.experiments.toy3 import Toy3Config, layout
    from moejax.merging.layer import merge_layer

    assert "first_k" in MERGE_METHODS and parse("first_k", spread=2) == first_k(spread=2)
    merge = next(a for a in build_parser()._actions if a.dest == "command").choices["merge"]
    assert "first_k" in next(a for a in merge._actions if a.dest == "method").choices
    assert hydra_defaults("prune_real")["merge"]["first_k"] == {"spread": 0}
    cfg = Toy3Config.from_mapping({"merges": ["hc_smoe", "first_k"], "merge": {"first_k": {"spread": 1}},
                                   "keep": [4], "n_experts": 8, "eq6_pairs": 0})
    assert cfg.merges == (HcSmoe(), first_k(spread=1))
    assert [name for name, _ in layout(cfg).labels([])][-4:] == ["hc_smoe:shrunk", "first_k:shrunk", "hc_smoe:tied",
                                                                "first_k:tied"]
    rng = np.random.default_rng(0)
    weights = {"gate": rng.normal(size=(6, 4, 3)), "up": rng.normal(size=(6, 4, 3)), "down": rng.normal(size=(6, 3, 4))}
    counts = np.array([5.0, 1.0, 2.0, 3.0, 0.0, 4.0])
    lm = merge_layer(parse("first_k"), 3, MergeContext(None, counts), weights)
    assert lm.labels_E.tolist() == [0, 1, 2, 2, 2, 2] and lm.leaders.tolist() == [0, 1, 5]
    shares = counts[2:] / counts[2:].sum()
    np.testing.assert_allclose(lm.weights["gate"][2], np.tensordot(shares, weights["gate"][2:], 1), rtol=1e-6)
    with pytest.raises(ConfigError, match="spread=-1"):
        Toy3Config.from_mapping({"merges": ["first_k"], "merge": {"first_k": {"spread": -1}}})


def test_a_method_without_its_algorithm_is_refused_when_registered():
    """A class that leaves `leaders` or `averaging` unwritten is refused at its `@register`, naming
    what it lacks, and the registry keeps no entry for it."""
    from moejax.merging.method import MergeMethod

    class Half(MergeMethod):
        def clusters(self, keep, ctx):
            return np.zeros(len(ctx.counts_E), np.int64)

    with pytest.raises(TypeError, match=r"merge method 'half' \(Half\) does not define \['averaging', 'leaders'\]"):
        register("half")(Half)
    assert "half" not in MERGE_METHODS
