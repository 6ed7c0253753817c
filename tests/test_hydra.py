"""The Hydra entry point: overrides compose, a two-job sweep runs, the loader reads it, the
notebook runs on it, and conf/ is found from an installed wheel too."""

import dataclasses
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from moejax.errors import ConfigError
from moejax.experiments.runner import experiment_config
from moejax.results import load

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
TINY = ["toy.n_calib=300", "toy.n_heldout=200", "toy.balance_steps=5"]


def typed(overrides):
    from omegaconf import OmegaConf

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    return experiment_config(OmegaConf.to_container(cfg, resolve=True))[1]


@pytest.mark.parametrize("overrides,check", [
    (["seeds=8"], lambda c: c.seeds == 8 and c.seed == 0),
    (["seed=3"], lambda c: c.seed == 3),
    (["keep=16"], lambda c: c.keep_counts() == [16]),
    (["keep=0.25"], lambda c: c.keep_counts() == [16]),
    (["keep=[8,16]"], lambda c: c.keep_counts() == [8, 16]),
    ([], lambda c: c.keep_counts() == [8, 16, 32, 48] and c.n_calib == 6000 and c.balance_steps == 300
     and c.seeds == 8 and c.scores == ("frequency", "signed", "l1", "random", "reap", "ean")),
])
def test_overrides_compose_into_typed_config(overrides, check):
    assert check(typed(["experiment=toy3", *overrides]))


def _leaves(d, prefix=""):
    """Dotted keys of a nested mapping's values."""
    return {k for key, v in d.items()
            for k in (_leaves(v, f"{prefix}{key}.") if isinstance(v, dict) and v else {f"{prefix}{key}"})}


@pytest.mark.parametrize("name", ["toy3", "score", "train_tiny", "prune_real", "eval_tasks"])
def test_composed_defaults_are_the_dataclass_defaults(name):
    """One source: every experiment's composed defaults are its dataclass's (registered in
    Hydra's ConfigStore by moejax.experiments.register_configs), and conf/experiment/NAME.yaml
    repeats none of them (toy.backend=auto is a Hydra-only value: settings_from resolves it)."""
    import yaml
    from omegaconf import OmegaConf

    from moejax.experiments import EXPERIMENTS, _plain, get, hydra_defaults
    from moejax.merging.method import MERGE_METHODS

    assert name in EXPERIMENTS
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=[f"experiment={name}", "++model.path=/ckpt"])
    module = get(name)
    settings = module.settings_from(OmegaConf.to_container(cfg, resolve=True))
    default = module.Config()
    flat = {}
    for f in dataclasses.fields(default):   # eval_tasks composes prune_real's config: its fields sit beside its own
        value = getattr(default, f.name)
        flat.update({g.name: getattr(value, g.name) for g in dataclasses.fields(value)} if f.name == "prune_real"
                    else {f.name: value})
    expected = {k: _plain(v) for k, v in flat.items()}
    if "merges" in expected:   # the `merge` block: every registered merge method's default settings
        expected["merge"] = {m: dataclasses.asdict(MERGE_METHODS.parse(m)) for m in MERGE_METHODS.names()}
        assert set(expected["merge"]) == {"hc_smoe", "m_smoe", "ream"}
    if "allocation" in expected:   # the `allocations` block: every allocation's default settings
        from moejax.allocation import ALLOCATIONS

        expected["allocations"] = {m: dataclasses.asdict(ALLOCATIONS.parse(m)) for m in ALLOCATIONS.names()}
        assert set(expected["allocations"]) == {"uniform", "global", "shape", "evo_esap"}
    assert set(settings) <= set(expected)
    for key, value in expected.items():
        if key != "path":  # model.path: the model group's (or ??? = required)
            assert _plain(settings.get(key)) == value, key
    own = yaml.safe_load((CONF / "experiment" / f"{name}.yaml").read_text())
    own = {k: v for k, v in own.items() if k not in ("defaults", "name", "model")}
    repeated = _leaves(own) & _leaves(hydra_defaults(name))
    assert repeated <= {"toy.backend"}, f"conf/experiment/{name}.yaml repeats dataclass defaults: {repeated}"


def test_no_experiment_or_bad_keep_is_refused():
    with pytest.raises(ConfigError, match="experiment=NAME.*toy3"):
        typed([])
    with pytest.raises(ConfigError, match="below top_k"):
        typed(["experiment=toy3", "keep=2"])


@pytest.mark.parametrize("experiment,override,match", [
    ("toy3", "toy.merges=[hc_smoe,hc_smoe]", r"toy3: merges=\['hc_smoe', 'hc_smoe'\] names \['hc_smoe'\] more "
                                             "than once; give each at most once"),
    ("toy3", "toy.scores=[l1,reap,l1]", r"toy3: scores=\['l1', 'reap', 'l1'\] names \['l1'\]"),
    ("toy3", "keep=[8,0.125]", r"toy3: keep=\[8, 0.125\] names \[8\] \(as expert counts\) more than once"),
    ("toy3", "toy.offsets=[ones,ones]", r"toy3: offsets=\['ones', 'ones'\] names"),
    ("prune_real", "merges=[hc_smoe,hc_smoe]", r"prune_real: merges=\['hc_smoe', 'hc_smoe'\] names \['hc_smoe'\]"),
    ("prune_real", "scores=[l1,l1]", r"prune_real: scores=\['l1', 'l1'\] names \['l1'\]"),
    ("prune_real", "keep=[4,0.5]", r"prune_real: keep=\[4, 0.5\] names \[4\] \(as expert counts\)"),
    ("eval_tasks", "merges=[m_smoe,m_smoe]", r"eval_tasks: merges=\['m_smoe', 'm_smoe'\] names"),
    ("eval_tasks", "tasks=[stdlib_mc,stdlib_mc]", r"eval_tasks: tasks=\['stdlib_mc', 'stdlib_mc'\] names"),
    ("score", "scores=[l1,l1]", r"score: scores=\['l1', 'l1'\] names \['l1'\]"),
])
def test_every_experiment_refuses_a_list_setting_naming_something_twice(tmp_path, experiment, override, match):
    """A repeated score, merge method, keep (as an expert count) or task would run the same variant
    again and write its result rows twice: refused by name in every experiment, before any work."""
    from hf_fixtures import full_config

    (tmp_path / "config.json").write_text(json.dumps(full_config()))  # E = 8, top-2
    path = [] if experiment == "toy3" else [f"++model.path={tmp_path}"]
    with pytest.raises(ConfigError, match=match):
        typed([f"experiment={experiment}", *path, override])


def run_cli(args, cwd, env_extra=None, check=True):
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env_extra or {})}
    out = subprocess.run([sys.executable, "-m", "moejax.run", *args], cwd=cwd, env=env,
                         capture_output=True, text=True, timeout=600)
    if check and out.returncode:
        raise AssertionError(out.stdout + out.stderr)
    return out


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sweep")
    out = run_cli(["-m", "experiment=toy3", "seeds=2", "keep=8,16", *TINY, f"hydra.sweep.dir={tmp / 'sw'}"], tmp)
    assert "keep=8" in out.stdout and "keep=16" in out.stdout  # the summary table of each job
    return tmp / "sw"


def test_two_job_multirun_writes_every_file(sweep):
    for job, keep in ((0, 8), (1, 16)):
        d = sweep / str(job)
        assert json.loads((d / "status.json").read_text())["status"] == "completed"
        for name in ("results.parquet", "resolved_config.yaml", ".hydra/overrides.yaml"):
            assert (d / name).is_file(), name
        assert f"keep: {keep}" in (d / "resolved_config.yaml").read_text()


def test_loader_returns_one_frame_with_swept_overrides(sweep):
    df = load(sweep)
    assert {"offset", "load", "seed", "score", "keep", "metric", "value", "job", "override.keep",
            "experiment", "seeds"} <= set(df.columns)
    assert sorted(df["override.keep"].unique()) == [8, 16]
    assert (df.dropna(subset=["keep"]).keep == df.dropna(subset=["keep"])["override.keep"]).all()
    assert sorted(df.seed.unique()) == [0, 1] and set(df.experiment) == {"toy3"}
    single = load(sweep / "0")
    assert len(single) == len(df) // 2
    code = "import sys, moejax.results; moejax.results.load(sys.argv[1]); print('jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code, str(sweep)], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, check=True)
    assert out.stdout.strip() == "False"  # loading results never imports JAX


def test_ratio_sweep_and_failed_job_status(tmp_path):
    out = run_cli(["experiment=toy3", "seeds=1", "keep=2", *TINY, f"hydra.run.dir={tmp_path / 'bad'}"],
                  tmp_path, check=False)
    assert out.returncode != 0 and "below top_k=4" in out.stdout + out.stderr
    status = json.loads((tmp_path / "bad" / "status.json").read_text())
    assert status["status"] == "failed" and (tmp_path / "bad" / "error.txt").is_file()
    assert not (tmp_path / "bad" / "results.parquet").exists()


def test_unknown_experiment_lists_valid_ones(tmp_path):
    out = run_cli(["experiment=toy9"], tmp_path, check=False)
    assert out.returncode != 0 and "toy3" in out.stdout + out.stderr


def test_notebook_code_runs_on_the_sweep(sweep, tmp_path):
    import nbformat

    nb = nbformat.read(ROOT / "experiments" / "toy3" / "toy3.ipynb", as_version=4)
    code = "\n\n".join(c.source for c in nb.cells if c.cell_type == "code")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MPLBACKEND": "Agg", "MOEJAX_TOY3_RESULTS": str(sweep),
           "MOEJAX_TOY3_FIGURE": str(tmp_path / "fig.png")}
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "fig.png").stat().st_size > 10_000


def test_joblib_launcher_preset_composes(tmp_path):
    out = run_cli(["hydra/launcher=local_procs", "experiment=toy3", "--cfg", "hydra", "-p", "hydra.launcher"],
                  tmp_path)
    assert "JoblibLauncher" in out.stdout and "n_jobs: 2" in out.stdout


def test_conf_found_from_an_installed_wheel(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path / "dist"), str(ROOT)], check=True, capture_output=True)
    wheel = next((tmp_path / "dist").glob("moejax-*.whl"))
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    assert (site / "moejax" / "conf" / "experiment" / "toy3.yaml").is_file()
    source_modules = {p.relative_to(ROOT).as_posix() for p in (ROOT / "moejax").rglob("*.py")}
    wheel_modules = {p.relative_to(site).as_posix() for p in (site / "moejax").rglob("*.py")}
    assert source_modules <= wheel_modules, f"not in the wheel: {sorted(source_modules - wheel_modules)}"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(site)
    out = subprocess.run([sys.executable, "-m", "moejax.run", "experiment=toy3", "keep=0.25", "--cfg", "job"],
                         cwd=tmp_path, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "name: toy3" in out.stdout and "keep: 0.25" in out.stdout
    assert str(site) in subprocess.run(
        [sys.executable, "-c", "import moejax.run as r; print(r.__file__, r.CONFIG_PATH)"],
        cwd=tmp_path, env=env, capture_output=True, text=True).stdout


def typed_as_run(overrides):
    """The typed config as `python -m moejax.run` hands it to the job (mixes replaced whole)."""
    from omegaconf import OmegaConf

    from moejax.run import replace_whole

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    return experiment_config(replace_whole(OmegaConf.to_container(cfg, resolve=True), overrides))[1]


@pytest.mark.parametrize("override,mix", [
    ("data.mix={code: 1.0}", {"code": 1.0}),                 # only code (Hydra alone: sum 1.38, refused)
    ("data.mix={}", {}),                                       # no skills: code only (Hydra alone: a no-op)
    ("data.mix={code: 0.5, kv: 0.5}", {"code": 0.5, "kv": 0.5}),
])
def test_a_mix_on_the_command_line_replaces_the_whole_mix(override, mix):
    assert typed_as_run(["experiment=train_skills", "model.path=/x", override]).data.mix == mix
    last = typed_as_run(["experiment=train_skills", "model.path=/x", "data.mix={add: 1.0}", override])
    assert last.data.mix == mix                               # the last override of the mix wins, as in Hydra
    one = typed_as_run(["experiment=train_skills", "model.path=/x", "data.mix.add=0.12", "data.mix.code=0.53"])
    assert one.data.mix["add"] == 0.12 and one.data.mix["code"] == 0.53 and one.data.mix["kv"] == 0.02


def test_an_unquoted_mix_is_refused_showing_the_quoting(tmp_path):
    out = subprocess.run([sys.executable, "-m", "moejax.run", "experiment=prune_real", "calibration=code=0.5,kv=0.5"],
                         capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 2
    assert out.stderr == ("moejax.run: error: calibration=code=0.5,kv=0.5: a value holding '=' must be quoted for Hydra "
                          "(and ',' would start a sweep): write 'calibration=\"code=0.5,kv=0.5\"' (single quotes for "
                          "the shell, double quotes for Hydra)\n")
    with pytest.raises(ConfigError, match="data.mix shares sum to 1.38.*data.mix={code: 1.0} is code only"):
        typed(["experiment=train_skills", "model.path=/x", "data.mix={code: 1.0}"])   # composed without moejax.run
