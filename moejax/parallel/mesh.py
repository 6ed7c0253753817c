"""The device mesh: a data axis and an expert axis (a tensor axis can join them later)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys

import numpy as np

from moejax.errors import ConfigError

AXES = ("data", "expert")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """data x expert devices. Tokens are split over both axes, routed experts over `expert`;
    everything else is replicated."""

    data: int = 1
    expert: int = 1

    def __post_init__(self):
        for name in AXES:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"mesh.{name}={value!r}: expected a positive integer")

    @property
    def n_devices(self) -> int:
        return self.data * self.expert

    @property
    def expert_parallel(self) -> bool:
        return self.expert > 1

    def check_experts(self, n_experts: int, where: str) -> None:
        """Routed experts must split evenly over the expert axis; refused before any work."""
        if n_experts % self.expert:
            raise ConfigError(f"mesh.expert={self.expert} (--mesh-expert) does not divide the {n_experts} routed "
                              f"experts of {where}; choose a divisor of {n_experts}")

    @classmethod
    def from_dict(cls, d) -> "MeshConfig":
        d = dict(d or {})
        unknown = sorted(set(d) - set(AXES) - {"simulated_cpu_devices"})
        if unknown:
            raise ConfigError(f"mesh: unknown key(s) {unknown}; expected {list(AXES)}")
        return cls(**{k: d[k] for k in AXES if k in d})


def request_cpu_devices(n: int) -> None:
    """Ask XLA:CPU for n simulated devices; only possible before JAX is imported (it changes
    nothing on GPU/TPU). Later, make_mesh says what is missing."""
    flags = os.environ.get("XLA_FLAGS", "")
    if n > 1 and "jax" not in sys.modules and "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


def mesh_context(cfg: MeshConfig):
    """`with mesh_context(cfg):` runs under jax.set_mesh(make_mesh(cfg)), or plainly on one device."""
    if cfg.n_devices == 1:
        return contextlib.nullcontext()
    import jax

    return jax.set_mesh(make_mesh(cfg))


def make_mesh(cfg: MeshConfig, devices=None):
    """A `jax.sharding.Mesh` of cfg.data x cfg.expert devices (the first n of jax.devices()). In a
    multi-process job (moejax.parallel.distributed) it must span every process's devices: process p's
    devices follow process p-1's, so each holds a contiguous block of the expert axis."""
    import jax

    if devices is None and jax.process_count() > 1 and cfg.n_devices != jax.device_count():
        raise ConfigError(
            f"mesh data={cfg.data} x expert={cfg.expert} is {cfg.n_devices} device(s), but this job's "
            f"{jax.process_count()} processes have {jax.device_count()}: a multi-process mesh spans every device "
            f"(set mesh.data x mesh.expert = {jax.device_count()})")
    devices = list(jax.devices() if devices is None else devices)
    if len(devices) < cfg.n_devices:
        raise ConfigError(
            f"mesh data={cfg.data} x expert={cfg.expert} needs {cfg.n_devices} devices, JAX sees {len(devices)} "
            f"({devices[0].platform}); on CPU set XLA_FLAGS=--xla_force_host_platform_device_count={cfg.n_devices} "
            "before JAX starts (the mesh presets and `moejax score --mesh-expert` do this)")
    grid = np.asarray(devices[:cfg.n_devices], dtype=object).reshape(cfg.data, cfg.expert)
    return jax.sharding.Mesh(grid, AXES, axis_types=(jax.sharding.AxisType.Auto,) * len(AXES))
