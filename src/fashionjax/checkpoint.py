"""Checkpoints with orbax-checkpoint: save, restore, and the checks that make resume safe.

A checkpoint holds the whole TrainState (parameters, optimizer state, step) plus JSON metadata:
the resolved config, the versions, the data-order key and position. Orbax writes each step to a
temporary directory and renames it when complete, so only finalized checkpoints are ever listed.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp

import fashionjax
from fashionjax.config import TRAJECTORY_FIELDS, TrainConfig

# Orbax logs every save at INFO through absl; keep the terminal for our own progress lines.
logging.getLogger("absl").setLevel(logging.WARNING)


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read."""


class ResumeError(RuntimeError):
    """A resume that would not continue the same run."""


def _manager(directory: Path, keep: int = 3, writer: bool = True) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep, create=writer,
        enable_async_checkpointing=False,  # the next chunk donates these buffers: save must finish first
        cleanup_tmp_directories=writer,  # a save killed half-way leaves only a tmp dir: remove it
    )
    return ocp.CheckpointManager(directory.absolute(), options=options)


def describe_config(config: TrainConfig) -> dict:
    return dataclasses.asdict(config)


class Checkpointer:
    """Saves TrainStates of one run; restores the latest finalized one."""

    def __init__(self, directory: str | Path, config: TrainConfig, every: int | None = None, keep: int = 3,
                 data_key=None):
        self.directory = Path(directory)
        self.config = config
        self.every = every
        self.data_key = data_key
        try:
            self.manager = _manager(self.directory, keep)
        except OSError as err:
            raise CheckpointError(f"{self.directory}: cannot create checkpoint directory ({err})") from err

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def due(self, step: int, num_steps: int, steps_per_epoch: int) -> bool:
        """Whether the chunk that just ended crossed a checkpoint boundary."""
        every = self.every or steps_per_epoch
        return step // every > (step - num_steps) // every

    def save(self, step: int, state) -> None:
        meta = {
            "step": step,
            "config": describe_config(self.config),
            "fashionjax_version": fashionjax.__version__,
            "jax_version": jax.__version__,
            "data_key": None if self.data_key is None else np.asarray(jax.random.key_data(self.data_key)).tolist(),
        }
        try:
            self.manager.save(step, args=ocp.args.Composite(
                state=ocp.args.StandardSave(state._asdict()), meta=ocp.args.JsonSave(meta)), force=True)
            self.manager.wait_until_finished()
        except Exception as err:  # orbax surfaces I/O faults as many types; name the step and the cause
            raise CheckpointError(f"checkpoint at step {step} could not be written: {_first_line(err)}") from err

    def restore(self, template_state):
        """Restore the latest checkpoint into the structure (and types) of template_state."""
        step = self.latest_step()
        abstract = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, template_state._asdict())
        try:
            restored = self.manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract)))
        except Exception as err:
            raise CheckpointError(f"checkpoint at step {step} could not be read: {_first_line(err)}") from err
        return type(template_state)(**restored["state"])

    def close(self) -> None:
        self.manager.close()


def read_meta(checkpoint_dir: str | Path) -> dict | None:
    """The metadata of the latest finalized checkpoint, or None when there is none."""
    checkpoint_dir = Path(checkpoint_dir)
    if not checkpoint_dir.is_dir():
        return None
    manager = _manager(checkpoint_dir, writer=False)
    try:
        step = manager.latest_step()
        if step is None:
            return None
        return manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    finally:
        manager.close()


def check_resume(checkpoint_dir: str | Path, config: TrainConfig) -> dict:
    """Refuse a resume with no checkpoint or with a different trajectory; returns the metadata."""
    meta = read_meta(checkpoint_dir)
    if meta is None:
        raise ResumeError(f"{checkpoint_dir}: no finalized checkpoint to resume from")
    saved = meta["config"]
    wanted = describe_config(config)
    differences = [f"{name} {saved.get(name)!r} -> {wanted[name]!r}" for name in TRAJECTORY_FIELDS
                   if saved.get(name) != wanted[name]]
    if differences:
        raise ResumeError("cannot resume with a different config: " + ", ".join(differences))
    return meta


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0]}" if text else type(err).__name__
