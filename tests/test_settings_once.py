"""Each setting's default is declared once (issue 44): where a setting still appears in two places
(a command's flag and the library function it calls, an experiment's config and the pass it runs,
the Hydra defaults and the settings objects), the two agree, and a test here fails the day they
do not. A flag whose default is None takes the library's (a merge method's setting, router
distillation's `RerouteSettings`)."""

import dataclasses
import inspect

import numpy as np
import pytest

from moejax.allocation import ALLOCATIONS
from moejax.cli import MERGE_SETTING_FLAGS, build_parser
from moejax.experiments import hydra_defaults
from moejax.experiments.eval_tasks import EvalTasksConfig
from moejax.experiments.prune_real import PruneRealConfig
from moejax.merging.method import MERGE_METHODS
from moejax.training.reroute_settings import RerouteSettings


def command_defaults(command: str) -> dict:
    """{dest: default} of a `moejax COMMAND`'s flags."""
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]
    return {a.dest: a.default for a in sub._actions if a.dest != "help"}


def function_defaults(fn) -> dict:
    return {name: p.default for name, p in inspect.signature(fn).parameters.items()
            if p.default is not inspect.Parameter.empty}


def same(a, b) -> bool:
    """Equal, a dtype as a name or a type alike ("float32" and jnp.float32)."""
    if a == b:
        return True
    try:
        return isinstance(a, str) != isinstance(b, str) and np.dtype(a) == np.dtype(b)
    except TypeError:
        return False


def disagreements(declared: dict, library: dict) -> dict:
    """The settings both declare with different defaults (a None declaration defers to the library)."""
    return {k: (declared[k], library[k]) for k in set(declared) & set(library)
            if declared[k] is not None and not same(declared[k], library[k])}


def test_the_check_finds_a_disagreement():
    """Planted: a flag default of 16 beside a function default of 8 is reported; None defers."""
    def fn(*, batch_size=8, seed=0):
        return batch_size, seed

    assert disagreements({"batch_size": 16, "seed": 0}, function_defaults(fn)) == {"batch_size": (16, 8)}
    assert disagreements({"batch_size": None}, function_defaults(fn)) == {}
    assert same("float32", np.float32) and not same("float32", np.float64) and not same("a", "b")


@pytest.mark.parametrize("command, function", [
    ("prune", "moejax.surgery.prune:prune_checkpoint"),
    ("prune", "moejax.surgery.substitute:substitute_checkpoint"),
    ("merge", "moejax.surgery.merge:merge_checkpoint"),
    ("reroute", "moejax.surgery.reroute:reroute_checkpoint"),
    ("score", "moejax.scoring.score_checkpoint:score_checkpoint"),
])
def test_command_flags_agree_with_the_library(command, function):
    import importlib

    module, name = function.split(":")
    fn = getattr(importlib.import_module(module), name)
    assert disagreements(command_defaults(command), function_defaults(fn)) == {}


def test_settings_objects_own_their_defaults():
    """The flags of a merge method's and of router distillation's settings default to None, so the
    settings object's declaration is the one that applies; a command run with no flag gets exactly
    the object's defaults."""
    merge = command_defaults("merge")
    assert all(merge[flag[2:].replace("-", "_")] is None for flag in MERGE_SETTING_FLAGS)
    reroute = command_defaults("reroute")
    assert {f.name: reroute[f.name] for f in dataclasses.fields(RerouteSettings)} == \
        dict.fromkeys((f.name for f in dataclasses.fields(RerouteSettings)), None)
    assert set(MERGE_SETTING_FLAGS.values()) == {s for d in MERGE_METHODS.defaults().values() for s in d}


def test_experiments_agree_with_the_pass_and_the_registry():
    """prune_real's settings against the carried pass's keyword defaults; eval_tasks composes
    prune_real's config (one declaration, except the scores it evaluates by default and its workers:
    one per core, where prune_real runs in one process unless asked); the Hydra
    defaults' `merge` and `router_distillation` blocks are the settings objects' own defaults."""
    from moejax.evaluation.carried import evaluate_pruning

    config = {f.name: getattr(PruneRealConfig(), f.name) for f in dataclasses.fields(PruneRealConfig)}
    assert disagreements(config, function_defaults(evaluate_pruning)) == {}
    composed = EvalTasksConfig().prune_real
    assert (composed.workers, PruneRealConfig().workers) == (0, 1)
    assert dataclasses.replace(composed, scores=None, workers=1) == PruneRealConfig()
    own = {f.name for f in dataclasses.fields(EvalTasksConfig)}
    assert not own & {f.name for f in dataclasses.fields(PruneRealConfig)}
    for name in ("prune_real", "eval_tasks", "toy3"):
        defaults = hydra_defaults(name)
        assert defaults["merge"] == MERGE_METHODS.defaults()
        if name != "toy3":
            assert defaults["allocations"] == ALLOCATIONS.defaults()
            assert defaults["router_distillation"] == dataclasses.asdict(RerouteSettings())


@pytest.mark.parametrize("experiment,name", [("prune_real", "prune_real"), ("eval_tasks", "eval_tasks"),
                                             ("eval_skills", "eval_tasks"), ("cliff_skills", "eval_tasks"),
                                             ("train_skills", "train_tiny")])
def test_workers_is_one_top_level_setting(experiment, name):
    """docs/experiments.md's `workers=W` composes for every experiment that has workers and reaches
    its settings (it once sat in `lm_eval` for eval_tasks and in `data` for prune_real)."""
    from pathlib import Path

    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from moejax import experiments

    import moejax.experiments.runner  # noqa: F401  (registers the experiments' defaults)

    conf = Path(__file__).resolve().parents[1] / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        cfg = OmegaConf.to_container(compose("config", overrides=[f"experiment={experiment}", "workers=3"]),
                                     resolve=True)
    assert cfg["name"] == name and cfg["workers"] == 3
    if name != "train_tiny":
        assert experiments.get(name).settings_from(cfg)["workers"] == 3
