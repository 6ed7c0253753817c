"""Never a silent wrong result: results follow the umask, `load` keeps what is good and says what
was not, a killed job says so, and a user's mistake reads as one line (single runs and sweeps)."""

import json
import os
import signal
import stat
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pandas as pd
import pytest

from moejax.errors import ConfigError, MoejaxError
from moejax.results import load, write_json_atomic, write_parquet_atomic

ROOT = Path(__file__).resolve().parents[1]
TINY = ["seeds=1", "toy.n_calib=300", "toy.n_heldout=200", "toy.balance_steps=5"]


def env():
    return {**os.environ, "PYTHONPATH": str(ROOT)}


def run_cli(args, cwd, extra_env=None):
    return subprocess.run([sys.executable, "-m", "moejax.run", *args], cwd=cwd, env={**env(), **(extra_env or {})},
                          capture_output=True, text=True, timeout=600)


def debris(d: Path) -> list[str]:
    return sorted(p.name for p in d.rglob(".*.tmp"))


# --- 1. files follow the umask ---------------------------------------------------------------------

@pytest.mark.parametrize("umask,mode", [(0o022, 0o644), (0o002, 0o664), (0o077, 0o600)])
def test_results_files_follow_the_umask(tmp_path, umask, mode):
    old = os.umask(umask)
    try:
        write_json_atomic(tmp_path / "status.json", {"status": "completed"})
        write_parquet_atomic(pd.DataFrame({"value": [1.0]}), tmp_path / "results.parquet")
        write_json_atomic(tmp_path / "status.json", {"status": "completed", "again": True})  # replace
    finally:
        os.umask(old)
    for name in ("status.json", "results.parquet"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == mode, name
    assert debris(tmp_path) == []


def test_a_failed_write_leaves_no_temporary_file(tmp_path):
    from moejax.results import _atomic_write

    def write(tmp):
        Path(tmp).write_text("half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        _atomic_write(tmp_path / "results.parquet", write)
    assert list(tmp_path.iterdir()) == []


# --- 2. load keeps what is good -------------------------------------------------------------------

def job(root: Path, num: int, value, status="completed", overrides=None, **status_extra) -> Path:
    d = root / str(num)
    (d / ".hydra").mkdir(parents=True)
    (d / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides or [f"keep={8 * (num + 1)}"]))
    if value is not None:
        pd.DataFrame({"metric": ["rel_error"] * len(value), "value": value}).to_parquet(d / "results.parquet")
    if status is not None:
        (d / "status.json").write_text(json.dumps({"status": status, **status_extra}))
    return d


def load_warning(path, **kw):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        df = load(path, **kw)
    messages = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    return df, "\n".join(messages)


def test_value_stays_float_across_job_schemas(tmp_path):
    job(tmp_path, 0, [0.5, 1.5])
    job(tmp_path, 1, [1, 2])  # int64
    job(tmp_path, 2, pd.array([3, None], dtype="Int64"))  # nullable ints
    job(tmp_path, 3, [True, False])
    job(tmp_path, 4, ["4.5", None])  # numbers written as text
    df, warned = load_warning(tmp_path)
    assert df["value"].dtype == "float64"
    assert df.job.tolist() == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4] and df["value"].tolist() == pytest.approx(
        [0.5, 1.5, 1.0, 2.0, 3.0, float("nan"), 1.0, 0.0, 4.5, float("nan")], nan_ok=True)
    assert warned == ""  # nothing was lost: None is missing, "4.5" is a number


def test_non_numeric_values_are_named_not_silently_nan(tmp_path):
    job(tmp_path, 0, [0.5])
    bad = job(tmp_path, 1, ["1.5", "n/a", "oops"])
    df, warned = load_warning(tmp_path)
    assert df["value"].dtype == "float64" and len(df) == 4
    assert str(bad) in warned and "2 non-numeric" in warned and "'n/a'" in warned
    assert df[df.job == 1]["value"].tolist() == pytest.approx([1.5, float("nan"), float("nan")], nan_ok=True)


@pytest.mark.parametrize("breakage,why", [
    (lambda d: (d / "results.parquet").write_bytes(b"PAR1 not really"), "results.parquet is unreadable"),
    (lambda d: (d / "status.json").write_bytes(b"\xff\xfe{"), "status.json is unreadable"),
    (lambda d: (d / "status.json").write_text('{"status": "compl'), "status.json is unreadable"),
    (lambda d: (d / "status.json").write_text("[1, 2]"), "status.json is not a status record"),
    (lambda d: (d / "results.parquet").unlink(), "results.parquet is missing"),
    (lambda d: (d / ".hydra" / "overrides.yaml").write_text("- keep=[8,\n  oops: {"), "overrides.yaml is unreadable"),
])
def test_one_corrupt_job_does_not_abort_the_load(tmp_path, breakage, why):
    job(tmp_path, 0, [0.5])
    broken = job(tmp_path, 1, [9.0])
    job(tmp_path, 2, [2.5])
    breakage(broken)
    df, warned = load_warning(tmp_path)
    assert sorted(df.job.unique()) == [0, 2] and df["value"].tolist() == [0.5, 2.5]
    assert f"{broken}: " in warned and why in warned


def test_unfinished_jobs_are_named(tmp_path):
    job(tmp_path, 0, [0.5])
    failed = job(tmp_path, 1, None, status="failed", error="ConfigError: keep=2 is below top_k=4")
    killed = job(tmp_path, 2, None, status="killed", signal="SIGTERM", seconds=12.5)
    running = job(tmp_path, 3, [1.0], status=None)
    df, warned = load_warning(tmp_path)
    assert df.job.tolist() == [0]
    assert f"{failed}: failed: ConfigError: keep=2 is below top_k=4" in warned
    assert f"{killed}: killed by SIGTERM after 12.5 s" in warned
    assert f"{running}: no status.json" in warned


def test_nothing_loadable_is_an_error_naming_why(tmp_path):
    d = job(tmp_path, 0, [0.5])
    (d / "results.parquet").write_bytes(b"garbage")
    with pytest.raises(MoejaxError, match="results.parquet is unreadable"):
        load(tmp_path)


# --- 3. SIGTERM / SIGINT ---------------------------------------------------------------------------

@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_killed_job_says_so(tmp_path, sig):
    """Slurm's time limit and `timeout` send SIGTERM, Ctrl-C SIGINT: status.json says killed, with the
    signal and how far the job got; no results.parquet, no temporary files; exit status 128+signum."""
    out = tmp_path / "job"
    proc = subprocess.Popen(
        [sys.executable, "-m", "moejax.run", "experiment=toy3", f"hydra.run.dir={out}"],  # ~20 s of work
        cwd=tmp_path, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # not ignored, as in a terminal
    try:
        while not (out / "resolved_config.yaml").exists():  # validated, now computing
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.05)
        time.sleep(0.5)
        proc.send_signal(sig)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    name = signal.Signals(sig).name
    assert proc.returncode == 128 + sig, stderr
    status = json.loads((out / "status.json").read_text())
    assert status["status"] == "killed" and status["signal"] == name, status
    assert status["seconds"] > 0 and status["stage"] in ("start", "compute") and status["experiment"] == "toy3"
    assert not (out / "results.parquet").exists() and debris(out) == []
    assert f"moejax.run: killed by {name}" in stderr
    with pytest.raises(MoejaxError, match=f"killed by {name}"):
        load(out)


def test_kill_switch_raises_even_where_a_handler_exception_would_be_lost(monkeypatch):
    """A signal that lands in a gc callback (JAX registers one) or a __del__ loses the handler's
    exception; the switch sends the signal again until the job raises Killed."""
    import gc

    from moejax.signals import KillSwitch, Killed

    lost = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: lost.append(u.exc_type))
    before = signal.getsignal(signal.SIGTERM)

    class Finalised:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGTERM)
            sum(range(1000))  # the handler runs here; its exception cannot leave __del__

    from moejax.signals import _unsafe_to_raise

    seen_unsafe = []

    def in_gc(phase, info):
        if phase == "start":
            seen_unsafe.append(_unsafe_to_raise(sys._getframe()))
            os.kill(os.getpid(), signal.SIGTERM)
            sum(range(1000))

    for trigger in ("gc", "del"):
        gc.collect()  # no earlier garbage left whose finalizer the collection below would run
        lost.clear()
        with pytest.raises(Killed) as killed:
            with KillSwitch() as switch:
                try:
                    if trigger == "gc":
                        gc.callbacks.append(in_gc)
                        try:
                            gc.collect()
                        finally:
                            gc.callbacks.remove(in_gc)
                    else:
                        Finalised()
                    deadline = time.monotonic() + 10
                    while time.monotonic() < deadline:  # ordinary work: the resend lands here
                        sum(range(1000))
                    raise AssertionError("no Killed after the exception was lost")
                except Killed:
                    switch.stopped = True
                    raise
        assert killed.value.signum == signal.SIGTERM and killed.value.signal_name == "SIGTERM"
        # in a gc callback the handler does not even try; a resend may still land in some other
        # object's finalizer or weakref callback during a collection, which loses only that copy
        assert set(lost) <= {Killed}
        if trigger == "gc":
            assert seen_unsafe and all(seen_unsafe)
        else:
            assert Killed in lost
        assert signal.getsignal(signal.SIGTERM) is before


# --- 4, 5. a user's mistake is one line ------------------------------------------------------------

def clean_error(out) -> str:
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1 and "Traceback" not in out.stderr + out.stdout, out.stderr
    assert lines[0].startswith("moejax.run: error: ")
    return lines[0]


def test_config_error_is_one_line_exit_2(tmp_path):
    line = clean_error(run_cli(["experiment=toy3", "keep=2", *TINY, f"hydra.run.dir={tmp_path / 'bad'}"], tmp_path))
    assert "keep=2 is below top_k=4" in line
    status = json.loads((tmp_path / "bad" / "status.json").read_text())
    assert status["status"] == "failed" and "ConfigError" in status["error"]
    assert "Traceback" in (tmp_path / "bad" / "error.txt").read_text()  # kept for whoever debugs it
    line = clean_error(run_cli(["experiment=toy3", "+toy.colour=blue", f"hydra.run.dir={tmp_path / 'unknown'}"],
                               tmp_path))
    assert "unknown setting(s) ['colour']" in line
    line = clean_error(run_cli(["experiment=toy3", "seed=${nope}", f"hydra.run.dir={tmp_path / 'interp'}"], tmp_path))
    assert line == "moejax.run: error: the config does not resolve at seed: Interpolation key 'nope' not found"
    assert json.loads((tmp_path / "interp" / "status.json").read_text())["status"] == "failed"


def test_full_error_env_shows_the_traceback(tmp_path):
    out = run_cli(["experiment=toy3", "keep=2", f"hydra.run.dir={tmp_path / 'bad'}"], tmp_path,
                  {"HYDRA_FULL_ERROR": "1"})
    assert out.returncode == 1 and "Traceback" in out.stderr and "ConfigError" in out.stderr


def test_a_bug_keeps_its_traceback(tmp_path):
    code = ("import sys, moejax.experiments.toy3 as t, moejax.run\n"
            "def run(*a, **k): raise ZeroDivisionError('a real bug')\n"
            "t.run = run\n"
            f"sys.argv = ['moejax.run', 'experiment=toy3', 'hydra.run.dir={tmp_path / 'bug'}']\n"
            "moejax.run.main()\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env(), capture_output=True, text=True)
    assert out.returncode == 1 and "Traceback" in out.stderr and "ZeroDivisionError: a real bug" in out.stderr
    assert "moejax.run: error" not in out.stderr
    assert json.loads((tmp_path / "bug" / "status.json").read_text())["status"] == "failed"


@pytest.mark.parametrize("experiment", ["score", "prune_real", "eval_tasks"])
def test_unset_model_path_says_how_to_set_it(tmp_path, experiment):
    line = clean_error(run_cli([f"experiment={experiment}", f"hydra.run.dir={tmp_path / 'job'}"], tmp_path))
    assert "model.path is not set: add model.path=/path/to/checkpoint" in line and "???" not in line
    assert json.loads((tmp_path / "job" / "status.json").read_text())["status"] == "failed"


def test_unset_model_path_in_process():
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from moejax.experiments.runner import experiment_config

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["experiment=prune_real"])
    with pytest.raises(ConfigError, match=r"^model.path is not set: add model.path="):
        experiment_config(OmegaConf.to_container(cfg, resolve=True))


# --- 6. sweeps ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("batch", [None, 1])
def test_sweep_config_errors_are_one_line_per_job(tmp_path, batch):
    """Every job of Hydra's batch runs (the basic sweeper's one batch is the whole sweep); after a
    batch with a failed job Hydra launches no further batch and exits 1, without a traceback."""
    sweep = tmp_path / "sw"
    extra = [] if batch is None else [f"hydra.sweeper.max_batch_size={batch}"]
    out = run_cli(["-m", "experiment=toy3", "keep=2,3", *TINY, *extra, f"hydra.sweep.dir={sweep}"], tmp_path)
    assert out.returncode == 1 and "Traceback" not in out.stderr + out.stdout, out.stderr
    errors = [line for line in out.stderr.splitlines() if line.startswith("moejax.run: error: ")]
    ran = [0, 1] if batch is None else [0]
    assert [e.split(":")[2].strip().split()[:2] for e in errors] == [["job", str(j)] for j in ran]
    assert all("is below top_k=4" in e for e in errors)
    assert "moejax.run: job 0 failed: keep=2 is below top_k=4" in out.stderr and str(sweep / "0" / "status.json") in out.stderr
    for j in ran:
        assert json.loads((sweep / str(j) / "status.json").read_text())["status"] == "failed"
    assert (sweep / "1").exists() == (batch is None)


@pytest.mark.parametrize("where", ["model", "model/run", "."])
def test_a_job_folder_never_lies_inside_or_holds_the_model_it_reads(tmp_path, where):
    """hydra.run.dir=MODEL (or inside it, or holding it): the job writes nothing there, before any
    work; for train_tiny, whose output model.path is, the job folder would be deleted with it."""
    from moejax.experiments.runner import run_job

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    for experiment in ("score", "train_tiny"):
        cfg = {"name": experiment, "model": {"path": str(model)}, "data": {"text": []}}
        with pytest.raises(MoejaxError, match=r"the job folder \(hydra.run.dir / hydra.sweep.dir\) (is|is inside|holds) "
                                              f"the input {model}"):
            run_job(cfg, tmp_path / where)
        assert sorted(p.name for p in model.iterdir()) == ["config.json"]
    notes = tmp_path / "notes"
    notes.mkdir()
    with pytest.raises(MoejaxError, match=f"is inside the input {notes}"):
        run_job({"name": "train_tiny", "model": {"path": str(model)}, "data": {"text": [str(notes)]}}, notes / "job")
    assert not (notes / "job").exists()
