"""Orbax checkpoints of a training run (not Hugging Face checkpoints): the `Trainer`'s state and
the run's metadata (step, loss history, the settings' fingerprint) in `<model.path>.orbax/`,
saved every `train.checkpoint_every` steps and restored to resume, refusing other settings."""

from __future__ import annotations

from moejax.errors import ConfigError
from moejax.training.config import TrainTinyConfig
from moejax.training.trainer import Trainer


def checkpoint_manager(cfg: TrainTinyConfig):
    """The orbax manager of `cfg.orbax_dir`: the latest `train.keep_checkpoints` checkpoints, each
    a "state" item (the Trainer's state as a pure dict) and a "meta" item (JSON), saved synchronously."""
    import orbax.checkpoint as ocp

    options = ocp.CheckpointManagerOptions(max_to_keep=cfg.train.keep_checkpoints, create=True,
                                           enable_async_checkpointing=False)
    return ocp.CheckpointManager(cfg.orbax_dir.resolve(), options=options, item_names=("state", "meta"))


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def restore(cfg: TrainTinyConfig, manager, trainer: Trainer) -> dict | None:
    """Load the latest checkpoint into `trainer`; its metadata, or None when there is none."""
    import jax
    import orbax.checkpoint as ocp

    step = manager.latest_step()
    if step is None:
        return None
    meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    if meta.get("fingerprint") != cfg.fingerprint():
        old, new = _flat(meta.get("fingerprint") or {}), _flat(cfg.fingerprint())
        diff = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
        raise ConfigError(f"train_tiny: the checkpoint at step {step} in {cfg.orbax_dir} was made with different "
                          f"settings ({', '.join(diff) or 'unknown'}); rerun with the same settings, or with "
                          "train.resume=false to start over (deletes that folder)")
    if step > cfg.train.steps:
        raise ConfigError(f"train_tiny: {cfg.orbax_dir} already holds step {step}, past train.steps="
                          f"{cfg.train.steps}; ask for at least {step} steps, or train.resume=false to start over")
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, trainer.pure_state())
    state = manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))["state"]
    trainer.load_pure_state(state)
    return meta


def save_checkpoint(manager, trainer: Trainer, step: int, meta: dict) -> None:
    """Save `trainer`'s state and `meta` as checkpoint `step` and wait until it is written (nothing
    when the latest checkpoint already is that step)."""
    import orbax.checkpoint as ocp

    if manager.latest_step() == step:
        return
    manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(trainer.pure_state()),
                                               meta=ocp.args.JsonSave(meta)))
    manager.wait_until_finished()

