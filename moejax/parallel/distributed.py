"""Several JAX processes as one job (several hosts, or several processes on one host):
`jax.distributed.initialize` from explicit settings, from Slurm's environment, or not at all.

    from moejax.parallel.distributed import DistributedConfig, initialize
    initialize(DistributedConfig())                                    # under `srun` with several tasks:
                                                                       # from Slurm's environment; else one process
    initialize(DistributedConfig("127.0.0.1:1234", num_processes=2, process_id=0))   # explicit

Call it before anything touches a JAX device (`python -m moejax.run` does, from its `distributed.*` settings);
then `jax.devices()` lists every process's devices, `make_mesh` spans them, and each process
computes on its own (addressable) devices. On CPU the cross-process collectives are gloo's.

Under Slurm, JAX gives process i of a node the one GPU SLURM_LOCALID (one task per GPU, as the
`slurm_multinode` launcher preset runs); with one task per node, name its GPUs in local_device_ids.

Importing this module does not import JAX (the process count is read before JAX may start, to
split simulated CPU devices between processes).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Mapping

from moejax.errors import ConfigError

log = logging.getLogger(__name__)

# What JAX's Slurm cluster detection reads (jax._src.clusters.slurm_cluster): present inside an
# `srun` step, which is where submitit runs each task.
SLURM_VARS = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")
KEYS = ("coordinator_address", "num_processes", "process_id", "local_device_ids", "initialization_timeout")


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """coordinator_address ("host:port" of process 0) with num_processes and process_id: explicit;
    all three None: from Slurm's environment inside a multi-task `srun` step, otherwise one process.
    local_device_ids: the GPUs this process uses (None: JAX's choice, under Slurm GPU SLURM_LOCALID)."""

    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    local_device_ids: tuple[int, ...] | None = None
    initialization_timeout: int = 300  # seconds to wait for every process to reach the coordinator

    def __post_init__(self):
        explicit = [self.coordinator_address, self.num_processes, self.process_id]
        if any(v is not None for v in explicit) and any(v is None for v in explicit):
            raise ConfigError("distributed: give coordinator_address, num_processes and process_id together "
                              f"(got {dict(zip(KEYS, explicit))}), or none of them (Slurm's environment)")
        for key in ("num_processes", "initialization_timeout"):
            value = getattr(self, key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ConfigError(f"distributed.{key}={value!r}: expected a positive integer")
        pid = self.process_id
        if pid is not None and (isinstance(pid, bool) or not isinstance(pid, int) or not 0 <= pid < self.num_processes):
            raise ConfigError(f"distributed.process_id={self.process_id!r}: expected 0 .. num_processes-1 "
                              f"({self.num_processes - 1})")
        if self.coordinator_address is not None and ":" not in str(self.coordinator_address):
            raise ConfigError(f"distributed.coordinator_address={self.coordinator_address!r}: expected host:port")
        if self.local_device_ids is not None:
            object.__setattr__(self, "local_device_ids", tuple(int(i) for i in self.local_device_ids))

    @classmethod
    def from_dict(cls, d) -> "DistributedConfig":
        d = dict(d or {})
        unknown = sorted(set(d) - set(KEYS))
        if unknown:
            raise ConfigError(f"distributed: unknown key(s) {unknown}; expected {list(KEYS)}")
        return cls(**{k: v for k, v in d.items() if v is not None})

    def process_count(self, environ: Mapping[str, str] | None = None) -> int:
        """How many processes the job has: num_processes, else SLURM_NTASKS inside an srun step, else 1
        (known before JAX starts)."""
        if self.num_processes is not None:
            return self.num_processes
        return slurm_tasks(os.environ if environ is None else environ)

    def process_index(self, environ: Mapping[str, str] | None = None) -> int:
        """This process's index: process_id, else SLURM_PROCID inside a multi-task srun step, else 0."""
        environ = os.environ if environ is None else environ
        if self.process_id is not None:
            return self.process_id
        return int(environ["SLURM_PROCID"]) if slurm_tasks(environ) > 1 else 0

    def local_device_count(self, mesh_devices: int, environ: Mapping[str, str] | None = None) -> int:
        """Devices each process brings to a mesh of mesh_devices spanning the job (simulated CPU
        devices are requested per process); refused when the processes cannot share it evenly."""
        n = self.process_count(environ)
        if mesh_devices % n:
            raise ConfigError(f"the mesh's {mesh_devices} device(s) do not split evenly over the job's {n} processes: "
                              f"a multi-process mesh spans every process's devices; set mesh.data x mesh.expert to "
                              f"a multiple of {n}")
        return mesh_devices // n


def slurm_tasks(environ: Mapping[str, str]) -> int:
    """SLURM_NTASKS inside an srun step (where JAX's Slurm detection works), else 1."""
    if all(v in environ for v in SLURM_VARS):
        return int(environ["SLURM_NTASKS"])
    return 1


def initialize(cfg: DistributedConfig | None = None) -> tuple[int, int]:
    """Join the job's processes (`jax.distributed.initialize`) when it has more than one; returns
    (this process's index, process count). A second call, or one after JAX was initialised
    elsewhere, changes nothing."""
    cfg = cfg or DistributedConfig()
    n = cfg.process_count()
    if n == 1:
        return 0, 1
    import jax

    if not jax.distributed.is_initialized():
        jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU collectives across processes
        kw = dict(local_device_ids=list(cfg.local_device_ids) if cfg.local_device_ids is not None else None,
                  initialization_timeout=cfg.initialization_timeout)
        if cfg.coordinator_address is not None:
            jax.distributed.initialize(cfg.coordinator_address, cfg.num_processes, cfg.process_id, **kw)
        else:
            jax.distributed.initialize(cluster_detection_method="slurm", **kw)
        log.info("process %d of %d (%d local device(s) of %d)", jax.process_index(), jax.process_count(),
                 jax.local_device_count(), jax.device_count())
    return jax.process_index(), jax.process_count()


def to_host(tree):
    """`jax.device_get` that also takes arrays spanning other processes' devices: those are gathered
    (`multihost_utils.process_allgather`), so every process gets the whole value. Every process must
    make the same calls in the same order (each gather is a collective); with one process this is
    `jax.device_get`."""
    import jax

    def one(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable and not x.is_fully_replicated:
            from jax.experimental import multihost_utils

            return multihost_utils.process_allgather(x, tiled=True)
        return jax.device_get(x)

    return jax.tree.map(one, tree)
