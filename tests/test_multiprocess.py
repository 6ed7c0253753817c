"""Multi-process JAX for real, on one machine: two processes (tests/multiprocess_worker.py), each
with 4 simulated CPU devices, joined by `jax.distributed.initialize` through a coordinator on a
free 127.0.0.1 port (gloo collectives), run one 8-way expert mesh spanning both. One launch does
every check, to share the start-up and compile cost:

  sharded loading   process p reads only the routed experts of its own devices (4p .. 4p+3) and
                    holds only their blocks;
  the forward       logits of the tiny DeepSeek-V3 (one MoE layer, experts split 8 ways);
  the scoring pass  every score of `moejax score` from the streamed, expert-parallel pass;
  toy3              a small expert-parallel toy3 run;

each equal, bit for bit and on both processes, to one process with 8 devices (a third process
with the same XLA flags, run beside them: the same program on the same mesh, only the
collectives cross a process boundary). Process 0 joins with explicit arguments, process 1 from
the variables of an `srun` task (the slurm_multinode preset's way).

A hang fails the test (the job has a deadline; every process group is killed), and a failure shows
each process's output. Below, the settings and the runner's part (only process 0 writes the job
folder) without a second process.
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import FAST_COMPILE

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).with_name("multiprocess_worker.py")
DEADLINE_S = 120  # the whole job, start-up included: a hang fails instead of blocking the suite
PROCESSES, LOCAL_DEVICES = 2, 4
# The job's cost is compilation; at -O0 (conftest's FAST_COMPILE) XLA:CPU compiles about twice as
# fast. The reference process compiles with the same flags, so bitwise equality still means the same
# program.

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="gloo collectives: Linux and macOS")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_env(devices: int, extra: dict | None = None) -> dict:
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", os.environ.get("XLA_FLAGS", ""))
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}  # no job joins by accident
    return {**env, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
            "XLA_FLAGS": f"{flags} {FAST_COMPILE} --xla_force_host_platform_device_count={devices}".strip(),
            "JAX_PLATFORMS": "cpu", "MOEJAX_JAX_CACHE": "", "PYTHONUNBUFFERED": "1", **(extra or {})}


def launch(ckpt, tokens, out: Path, logs: Path):
    """Start the reference (one process, 8 devices) and the two-process job together; wait for all
    three within DEADLINE_S. Returns the seconds they took.

    Process 0 joins with explicit arguments (as the README's one-machine command does), process 1
    from the variables `srun` gives task 1 of 2 on one node (as a slurm_multinode job does; JAX
    reads SLURM_STEP_NODELIST's first host and, here, JAX_COORDINATOR_PORT), so both ways meet."""
    port = free_port()
    slurm = {"SLURM_JOB_ID": "4242", "SLURM_STEP_NODELIST": "127.0.0.1", "SLURM_STEP_NUM_NODES": "1",
             "SLURM_NTASKS": str(PROCESSES), "SLURM_PROCID": "1", "SLURM_LOCALID": "1",
             "JAX_COORDINATOR_PORT": str(port)}
    runs = [("reference", 8, [], None),
            ("process0", LOCAL_DEVICES, ["--coordinator", f"127.0.0.1:{port}", "--processes", str(PROCESSES),
                                         "--process-id", "0"], None),
            ("process1", LOCAL_DEVICES, [], slurm)]
    procs = {}
    t0 = time.perf_counter()
    try:
        for name, devices, args, extra in runs:
            (out / name).mkdir()
            with open(logs / f"{name}.log", "w") as log:
                command = [sys.executable, str(WORKER), str(ckpt), str(tokens), str(out / name), *args]
                procs[name] = subprocess.Popen(command, cwd=ROOT, env=worker_env(devices, extra), stdout=log,
                                               stderr=subprocess.STDOUT,
                                               start_new_session=True)  # its own process group, killed as one
        while any(p.poll() is None for p in procs.values()):
            failed = [n for n, p in procs.items() if p.returncode not in (None, 0)]
            if failed or time.perf_counter() - t0 > DEADLINE_S:
                why = f"{', '.join(failed)} failed" if failed else f"no result within {DEADLINE_S} s"
                pytest.fail(f"multi-process job: {why}\n{report(procs, logs)}")
            time.sleep(0.1)
        if any(p.returncode for p in procs.values()):
            pytest.fail(f"multi-process job failed\n{report(procs, logs)}")
        return time.perf_counter() - t0
    finally:
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def report(procs, logs: Path) -> str:
    parts = []
    for name, p in procs.items():
        text = (logs / f"{name}.log").read_text(errors="replace")
        lines = [line for line in text.splitlines() if not line.startswith("[Gloo]")]
        parts.append(f"--- {name} (exit status {p.poll()}) ---\n" + "\n".join(lines[-40:]))
    return "\n".join(parts)


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    pytest.importorskip("transformers")
    from hf_fixtures import make_checkpoint

    root = tmp_path_factory.mktemp("multiprocess")
    ckpt, tokens, out, logs = root / "ckpt", root / "ids.npy", root / "out", root / "logs"
    out.mkdir(), logs.mkdir()
    make_checkpoint(ckpt, seed=8, num_hidden_layers=1, first_k_dense_replace=0)  # one MoE layer: less to compile
    np.save(tokens, np.random.default_rng(3).integers(0, 96, size=(4, 12)))
    seconds = launch(ckpt, tokens, out, logs)
    results = {}
    for name in ["reference"] + [f"process{i}" for i in range(PROCESSES)]:
        (arrays,), (facts,) = (out / name).glob("*.npz"), (out / name).glob("*.json")  # one process's results
        results[name] = dict(np.load(arrays)), json.loads(facts.read_text())
    print(f"\nmulti-process job: {seconds:.1f} s; per process: "
          + "; ".join(f"{n} {f['total_s']} s (cpu {f['cpu_s']} s; wall, cpu per stage {f['timings']})"
                      for n, (_, f) in results.items()))
    return results


def test_the_job_spans_both_processes(job):
    _, ref = job["reference"]
    assert ref["process_count"] == 1 and ref["devices"] == ref["local_devices"] == 8
    for i in range(PROCESSES):
        _, facts = job[f"process{i}"]
        assert facts["process_index"] == i and facts["process_count"] == PROCESSES
        assert facts["devices"] == 8 and facts["local_devices"] == LOCAL_DEVICES
        # the mesh's expert axis: process 0's devices hold shards 0-3, process 1's shards 4-7
        assert facts["mesh_devices_local"] == [d // LOCAL_DEVICES == i for d in range(8)]


def test_sharded_loading_reads_only_own_experts(job):
    _, ref = job["reference"]
    assert ref["read_experts"] == list(range(8)) and ref["local_gate_blocks"] == list(range(8))
    for i in range(PROCESSES):
        _, facts = job[f"process{i}"]
        own = list(range(LOCAL_DEVICES * i, LOCAL_DEVICES * (i + 1)))
        assert facts["read_experts"] == own and facts["local_gate_blocks"] == own
        assert facts["expert_tensor_reads"] == ref["expert_tensor_reads"] // PROCESSES  # each of its own once


@pytest.mark.parametrize("what", ["logits", "score", "toy3"])
def test_results_equal_one_process_bitwise(job, what):
    want, _ = job["reference"]
    keys = [k for k in want if k == what or k.startswith(f"{what}_")]
    for i in range(PROCESSES):
        got, _ = job[f"process{i}"]
        for k in keys:
            assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, (i, k)
            diff = np.abs(got[k] - want[k]).max() if got[k].dtype.kind == "f" else ""
            assert np.array_equal(got[k], want[k]), (i, k, diff)
    value = want["logits" if what == "logits" else f"{what}_value"]
    assert value.size and np.isfinite(value).all() and np.unique(value).size > 1  # something was computed


# --- the settings, and the runner's part (no second process) -----------------------------------

SRUN_TASK = {"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "node[01-02]", "SLURM_NTASKS": "16", "SLURM_PROCID": "9",
             "SLURM_LOCALID": "1"}


def test_distributed_settings():
    from moejax.errors import ConfigError
    from moejax.parallel.distributed import DistributedConfig

    one = DistributedConfig()
    assert one.process_count({}) == 1 and one.process_index({}) == 0 and one.local_device_count(8, {}) == 8
    assert one.process_count(SRUN_TASK) == 16 and one.process_index(SRUN_TASK) == 9  # a task of srun -n 16
    assert one.process_count({k: v for k, v in SRUN_TASK.items() if k != "SLURM_STEP_NODELIST"}) == 1  # sbatch, no srun
    assert one.local_device_count(32, SRUN_TASK) == 2
    with pytest.raises(ConfigError, match=r"24 device\(s\) do not split evenly over the job's 16 processes"):
        one.local_device_count(24, SRUN_TASK)
    explicit = DistributedConfig.from_dict({"coordinator_address": "h:1", "num_processes": 2, "process_id": 1,
                                            "local_device_ids": [0, 1], "initialization_timeout": None})
    assert explicit.process_count(SRUN_TASK) == 2 and explicit.process_index(SRUN_TASK) == 1
    assert explicit.local_device_ids == (0, 1) and explicit.initialization_timeout == 300
    for bad, match in [({"coordinator_address": "h:1"}, "together"), ({"num_processes": 0, "process_id": 0,
                        "coordinator_address": "h:1"}, "num_processes=0"),
                       ({"coordinator_address": "h:1", "num_processes": 2, "process_id": 2}, "process_id=2"),
                       ({"coordinator_address": "h", "num_processes": 2, "process_id": 0}, "host:port"),
                       ({"coordinator": "h:1"}, "unknown key")]:
        with pytest.raises(ConfigError, match=match):
            DistributedConfig.from_dict(bad)


def test_only_process_zero_writes_the_job_folder(tmp_path, monkeypatch):
    """Every process runs the job; process 0 writes results and status, the others return the same
    table and write nothing, failed or not (joining is stubbed: one process plays each part)."""
    import pandas as pd

    from moejax.experiments import runner, toy3

    joined = []
    monkeypatch.setattr(runner, "initialize", joined.append)
    monkeypatch.setattr(toy3, "run", lambda cfg, progress=None, job_dir=None: (
        pd.DataFrame({"offset": ["ones"], "load": ["skewed"], "seed": [0], "score": ["l1"], "keep": [8],
                      "metric": ["rel_error"], "value": [0.5]}), {}))

    def job(process_id, **extra):
        return {"name": "toy3", "seed": 0, "seeds": 1, "mesh": {"data": 1, "expert": 2}, **extra,
                "distributed": {"coordinator_address": "127.0.0.1:1", "num_processes": 2, "process_id": process_id}}

    for pid in (0, 1):
        df = runner.run_job(job(pid), tmp_path / f"p{pid}")
        assert len(df) == 1 and joined[-1].process_id == pid
    assert {p.name for p in (tmp_path / "p0").iterdir()} == {"resolved_config.yaml", "results.parquet",
                                                               "timings.json", "status.json"}
    assert not list((tmp_path / "p1").iterdir())
    for pid in (0, 1):
        with pytest.raises(Exception, match="keep"):
            runner.run_job(job(pid, keep="x"), tmp_path / f"f{pid}")
    assert json.loads((tmp_path / "f0" / "status.json").read_text())["status"] == "failed"
    assert not list((tmp_path / "f1").iterdir())


@pytest.mark.slow  # 30 s: two `python -m moejax.run` processes; the default run covers the library path above
def test_the_readme_two_process_command(tmp_path):
    """The README's one-machine command: two `python -m moejax.run` processes with the `distributed`
    settings (each asking for 4 of the mesh's 8 CPU devices) give process 0's job folder, whose
    table equals a one-process run's."""
    import pandas as pd

    tiny = ["experiment=toy3", "mesh.expert=8", "seeds=1", "toy.n_calib=256", "toy.n_heldout=256",
            "toy.balance_steps=5", "toy.merges=[]", "toy.eq6_pairs=0"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k != "XLA_FLAGS"}
    env.update(PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", MOEJAX_JAX_CACHE="")
    port, procs, logs = free_port(), [], []
    try:
        for i in range(PROCESSES):
            logs.append(open(tmp_path / f"log{i}", "w+"))
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "moejax.run", *tiny, f"hydra.run.dir={tmp_path / 'two'}",
                 f"distributed.coordinator_address=127.0.0.1:{port}", f"distributed.num_processes={PROCESSES}",
                 f"distributed.process_id={i}"], cwd=tmp_path, env=env, stdout=logs[i], stderr=subprocess.STDOUT,
                start_new_session=True))
        one = subprocess.run([sys.executable, "-m", "moejax.run", *tiny, f"hydra.run.dir={tmp_path / 'one'}"],
                             cwd=tmp_path, env=env, capture_output=True, text=True, timeout=DEADLINE_S)
        assert one.returncode == 0, one.stdout + one.stderr
        for p in procs:
            p.wait(timeout=DEADLINE_S)
        for i, p in enumerate(procs):
            logs[i].seek(0)
            assert p.returncode == 0, logs[i].read()[-5000:]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        for f in logs:
            f.close()
    assert json.loads((tmp_path / "two" / "status.json").read_text())["status"] == "completed"
    pd.testing.assert_frame_equal(pd.read_parquet(tmp_path / "two" / "results.parquet"),
                                  pd.read_parquet(tmp_path / "one" / "results.parquet"), check_exact=True)
