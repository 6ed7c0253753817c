"""The submitit launcher presets (hydra/launcher=slurm_gpu, slurm_multinode, local_gpu): they compose
from the command line, keep their GPU/time settings, take overrides, render the sbatch script a
Slurm cluster would get (with a stand-in sbatch), run a real two-job sweep through submitit_local,
and ship in the wheel. Nothing here imports JAX in the test process."""

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="needs the slurm extra")

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
SLURM = "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"
LOCAL = "hydra_plugins.hydra_submitit_launcher.submitit_launcher.LocalLauncher"
TINY = ["seeds=1", "toy.n_calib=300", "toy.n_heldout=200", "toy.balance_steps=5"]


def run_cli(args, cwd, env_extra=None):
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", "moejax.run", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)


def launcher_cfg(tmp_path, *overrides):
    """The resolved hydra.launcher node, as `--cfg hydra --resolve -p hydra.launcher` prints it."""
    out = run_cli(["experiment=toy3", *overrides, f"hydra.sweep.dir={tmp_path / 'sw'}",
                   "--cfg", "hydra", "--resolve", "-p", "hydra.launcher"], tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    return yaml.safe_load(out.stdout)


def test_slurm_preset_composes(tmp_path):
    c = launcher_cfg(tmp_path, "hydra/launcher=slurm_gpu")
    assert c["_target_"] == SLURM
    assert c["gpus_per_node"] == 1 and c["tasks_per_node"] == 1 and c["nodes"] == 1
    assert c["timeout_min"] == 240 and c["max_num_timeout"] == 0
    assert c["cpus_per_task"] >= 2 and c["mem_gb"] >= 16
    assert 1 <= c["array_parallelism"] <= 64
    assert c["partition"] is None  # sbatch's default unless overridden
    assert c["submitit_folder"] == f"{tmp_path / 'sw'}/.submitit/%j"


def test_local_gpu_preset_composes(tmp_path):
    c = launcher_cfg(tmp_path, "hydra/launcher=local_gpu")
    assert c["_target_"] == LOCAL
    assert c["gpus_per_node"] == 1  # unset, submitit_local hides every GPU (CUDA_VISIBLE_DEVICES="")
    assert c["tasks_per_node"] == 1 and c["timeout_min"] == 240
    assert c["submitit_folder"] == f"{tmp_path / 'sw'}/.submitit/%j"


def test_slurm_preset_takes_overrides(tmp_path):
    c = launcher_cfg(tmp_path, "hydra/launcher=slurm_gpu", "hydra.launcher.partition=gpu",
                     "hydra.launcher.timeout_min=30", "hydra.launcher.account=proj42",
                     "hydra.launcher.array_parallelism=2", "hydra.launcher.setup=[module load cuda]")
    assert c["partition"] == "gpu" and c["timeout_min"] == 30 and c["account"] == "proj42"
    assert c["array_parallelism"] == 2 and c["setup"] == ["module load cuda"]
    assert c["gpus_per_node"] == 1  # the rest of the preset stays
    c = launcher_cfg(tmp_path, "hydra/launcher=local_gpu", "hydra.launcher.timeout_min=30")
    assert c["timeout_min"] == 30 and c["gpus_per_node"] == 1


def render_sbatch(tmp_path, *args) -> set[str]:
    """The sbatch script submitit writes for `-m *args`, through the real plugin, up to the sbatch call:
    a stand-in sbatch keeps the script and fails, so nothing waits for a cluster."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text("#!/bin/sh\nexit 1\n")  # submitit only checks that srun exists
    (bin_dir / "sbatch").write_text('#!/bin/sh\ncp "$1" "$SBATCH_COPY"\necho "stand-in sbatch" >&2\nexit 1\n')
    for f in bin_dir.iterdir():
        f.chmod(f.stat().st_mode | stat.S_IXUSR)
    script = tmp_path / "job.sbatch"
    out = run_cli(["-m", *args, f"hydra.sweep.dir={tmp_path / 'sw'}"], tmp_path,
                  {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "SBATCH_COPY": str(script)})
    assert out.returncode != 0 and "stand-in sbatch" in out.stderr, out.stdout + out.stderr
    return set(script.read_text().splitlines())


@pytest.mark.skipif(sys.platform == "win32", reason="stand-in sbatch/srun are shell scripts")
def test_slurm_sweep_renders_one_gpu_array_job(tmp_path):
    """`-m ... keep=8,16,32,48 hydra/launcher=slurm_gpu` through the real plugin and submitit, up to
    the sbatch call."""
    sweep = tmp_path / "sw"
    lines = render_sbatch(tmp_path, "experiment=toy3", "keep=8,16,32,48", "hydra/launcher=slurm_gpu",
                          "hydra.launcher.partition=gpu", "hydra.launcher.timeout_min=30")
    for opt in ("--array=0-3%4", "--gpus-per-node=1", "--ntasks-per-node=1", "--nodes=1", "--partition=gpu",
                "--time=30", "--cpus-per-task=8", "--mem=64GB", "--job-name=moejax",
                f"--output={sweep}/.submitit/%A_%a/%A_%a_0_log.out"):
        assert f"#SBATCH {opt}" in lines, opt
    # each array task runs the controller's interpreter, so its environment must exist on the nodes
    assert any(line.startswith("srun ") and f"{sys.executable} -u -m submitit.core._submit" in line
               for line in lines)


@pytest.mark.skipif(sys.platform == "win32", reason="stand-in sbatch/srun are shell scripts")
def test_slurm_multinode_renders_one_job_of_many_tasks(tmp_path):
    """The preset composes and each job is 2 nodes x 8 tasks, one GPU each (no per-task binding:
    every task sees its node's GPUs and JAX takes GPU SLURM_LOCALID), started by one srun, so every
    task has the SLURM_NTASKS / SLURM_PROCID / SLURM_STEP_NODELIST that jax.distributed.initialize()
    reads (tests/test_multiprocess.py joins a real two-process job from those variables)."""
    lines = render_sbatch(tmp_path, "experiment=score", "model.path=/shared/ckpt", "data.tokens=/shared/ids.npy",
                          "mesh.expert=16", "hydra/launcher=slurm_multinode", "hydra.launcher.partition=gpu")
    for opt in ("--nodes=2", "--ntasks-per-node=8", "--gpus-per-node=8", "--cpus-per-task=8", "--mem=512GB",
                "--partition=gpu", "--time=240"):
        assert f"#SBATCH {opt}" in lines, opt
    assert not any("gpus-per-task" in line or "--array" in line for line in lines)  # one job (one sweep point)
    (srun,) = [line for line in lines if line.startswith("srun ")]  # one step: every task of the job
    assert f"{sys.executable} -u -m submitit.core._submit" in srun
    assert "_%t_log.out" in srun  # a log per task


@pytest.mark.slow  # 30 s: the launcher's rendering is checked by the default run; this runs a real sweep
def test_local_gpu_sweep_runs_each_job_in_its_own_process(tmp_path):
    from moejax.results import load  # JAX-free

    sweep = tmp_path / "sw"
    out = run_cli(["-m", "experiment=toy3", "keep=8,16", *TINY, "hydra/launcher=local_gpu",
                   "hydra.sweeper.max_batch_size=1", f"hydra.sweep.dir={sweep}"], tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert len(list((sweep / ".submitit").glob("*/*_result.pkl"))) == 2  # two submitit jobs
    df = load(sweep)
    assert sorted(df["override.keep"].unique()) == [8, 16] and sorted(df.job.unique()) == [0, 1]


def test_presets_ship_in_the_wheel():
    """The conf/ package-data globs of pyproject.toml cover the presets (the wheel test in
    test_hydra.py checks the mechanism itself)."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["moejax.conf"]
    shipped = {p for g in globs for p in CONF.glob(g)}
    for name in ("slurm_gpu", "slurm_multinode", "local_gpu", "local_procs"):
        assert CONF / "hydra" / "launcher" / f"{name}.yaml" in shipped, name
