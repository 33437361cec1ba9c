"""Checkpoints with orbax-checkpoint: save, restore the newest intact one, and the resume checks.

A checkpoint holds the whole TrainState (parameters, optimizer state, step) plus JSON metadata: the
resolved config, the plan, the training figures so far and the versions. Orbax writes each step to
a temporary directory and renames it when complete, so only finalized checkpoints are listed.
Readers (`eval`, `report`, the resume checks) open the directory read-only: they never create,
clean or delete anything in a run that may still be training.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from collections.abc import Callable
from pathlib import Path

import jax
import orbax.checkpoint as ocp

import fashionjax
from fashionjax import config as config_lib
from fashionjax import plan as plan_lib
from fashionjax.config import TRAJECTORY_FIELDS, TrainConfig

# Orbax logs every save at INFO, its option adjustments at WARNING and a failed write at ERROR with a
# traceback per thread (about 100 lines on a full disk), all through absl. Each fault also reaches us as
# an exception, which the CLI names in one line (--debug: the whole chain): keep stderr for that line.
logging.getLogger("absl").setLevel(logging.CRITICAL)


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read."""


class ResumeError(RuntimeError):
    """A resume that would not continue the same run."""


class _Removed(CheckpointError):
    """A checkpoint was removed (a live training keeps only --keep of them) while it was listed or read."""


# How many times a reader opens the checkpoints again after the training removed one it was reading:
# each time, a newer one has been finalized.
READ_TRIES = 20


def _manager(directory: Path, keep: int = 3, writer: bool = True) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep, create=writer, read_only=not writer,
        enable_async_checkpointing=False,  # the next chunk donates these buffers: save must finish first
        cleanup_tmp_directories=writer,  # only the run's owner may remove a half-written save
    )
    # Handlers named up front, so that a step's metadata (its arrays' shapes) reads before any restore
    handlers = {"state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()}
    return ocp.CheckpointManager(directory.absolute(), options=options, item_handlers=handlers)


def _newest_first(manager: ocp.CheckpointManager) -> list[int]:
    return sorted(manager.all_steps(), reverse=True)


def _param_shapes(params) -> dict[str, tuple]:
    return {jax.tree_util.keystr(path): tuple(leaf.shape) for path, leaf in jax.tree_util.tree_leaves_with_path(params)}


def _check_same_network(manager, step: int, checkpoint_dir: Path, wanted: dict[str, tuple]) -> None:
    """Refuse, in one line, a whole checkpoint of another network (a run of an earlier model version):
    its stored parameter shapes, read from the step's metadata, differ from this version's (`wanted`,
    as `_param_shapes` gives them). Unreadable metadata says nothing here; the restore that follows
    judges that checkpoint."""
    try:
        stored = _param_shapes(manager.item_metadata(step)["state"]["params"])
    except Exception:  # damaged or absent metadata: not this check's concern
        return
    if stored == wanted:
        return
    leaf = next(name for name in sorted(wanted.keys() | stored.keys()) if stored.get(name) != wanted.get(name))
    raise CheckpointError(f"{checkpoint_dir}: trained by another version of the model (parameter {leaf} stored as "
                          f"{stored.get(leaf, 'absent')}, this version's is {wanted.get(leaf, 'absent')}); "
                          "train it again with this version, or use the fashionjax that trained it")


def _restore_newest(manager, checkpoint_dir: Path, args_for: Callable[[], dict], note: Callable[[str], None],
                    template_params=None) -> tuple[int, dict, list[int]]:
    """(step, restored items, unreadable newer steps) of the newest checkpoint that reads back whole;
    with template_params, a checkpoint of another network is refused rather than called damaged."""
    broken: list[int] = []
    errors = []
    wanted = None if template_params is None else _param_shapes(template_params)
    listed = _newest_first(manager)
    for step in listed:
        if wanted is not None:
            _check_same_network(manager, step, checkpoint_dir, wanted)
        try:
            restored = manager.restore(step, args=ocp.args.Composite(**args_for()))
        except Exception as err:  # orbax reports damage as many types; any of them means "not this one"
            if _superseded(checkpoint_dir, step, listed[0]):
                raise _Removed(f"{checkpoint_dir}: step {step} was removed while it was read") from err
            broken.append(step)
            errors.append(f"step {step}: {_first_line(err)}")
            continue
        if broken:
            note(f"{checkpoint_dir}: checkpoint{'s' if len(broken) > 1 else ''} at step "
                 f"{', '.join(map(str, broken))} unreadable ({errors[0]}); using the one at step {step}")
        return step, restored, broken
    if errors:
        raise CheckpointError(f"{checkpoint_dir}: no checkpoint reads back whole ({'; '.join(errors)})")
    raise CheckpointError(f"{checkpoint_dir}: no finalized checkpoint")


def _superseded(checkpoint_dir: Path, step: int, newest_listed: int) -> bool:
    """Whether a step that failed to read is being removed rather than damaged: it is gone, or a live
    training has finalized a step newer than any listed (and so is removing the oldest)."""
    return not (checkpoint_dir / str(step)).exists() or any(
        path.name.isdigit() and int(path.name) > newest_listed for path in checkpoint_dir.iterdir())


# What orbax raises for a step directory removed under it: gone, or (it checks that the path exists,
# then that it is a directory) "not a directory" when it went between the two checks.
_VANISHED = (FileNotFoundError, NotADirectoryError)


def _read(checkpoint_dir: Path, read: Callable):
    """read(manager) with a read-only manager of checkpoint_dir, which a live training may be changing:
    when it removes a checkpoint while the manager lists or reads it, the directory is opened again."""
    for _ in range(READ_TRIES):
        try:
            manager = _manager(checkpoint_dir, writer=False)
            try:
                return read(manager)
            finally:
                manager.close()
        except _Removed:
            continue
        except _VANISHED:  # a step removed while orbax listed, checked or opened it, outside a restore
            if not checkpoint_dir.is_dir():
                raise
    raise CheckpointError(f"{checkpoint_dir}: the training removed each checkpoint before it could be read "
                          f"({READ_TRIES} tries); try again, or train with a larger --keep")


def latest_meta(checkpoint_dir: str | Path, note: Callable[[str], None] = lambda message: None) -> dict | None:
    """The metadata of the newest readable checkpoint (read-only), or None when there is none."""
    checkpoint_dir = Path(checkpoint_dir)
    if not checkpoint_dir.is_dir():
        return None

    def newest_meta(manager):
        if not manager.all_steps():
            return None
        _, restored, _ = _restore_newest(manager, checkpoint_dir, lambda: {"meta": ocp.args.JsonRestore()}, note)
        return restored["meta"]

    return _read(checkpoint_dir, newest_meta)


def _saved_fields(state) -> dict:
    """A TrainState as checkpoints hold it: its fields, less those a run does not use (None), which a
    restore fills in again with their defaults; so runs without them keep their checkpoints' layout."""
    return {name: value for name, value in state._asdict().items() if value is not None}


def _state_args(template_state) -> dict:
    abstract = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, _saved_fields(template_state))
    return {"state": ocp.args.StandardRestore(abstract), "meta": ocp.args.JsonRestore()}


def read_latest(checkpoint_dir: str | Path, template_state, note: Callable[[str], None] = lambda m: None):
    """(step, state, meta) of the newest intact checkpoint, opened read-only (for eval)."""
    checkpoint_dir = Path(checkpoint_dir)
    if not checkpoint_dir.is_dir():
        raise CheckpointError(f"{checkpoint_dir}: no finalized checkpoint")
    step, restored, _ = _read(checkpoint_dir, lambda manager: _restore_newest(
        manager, checkpoint_dir, lambda: _state_args(template_state), note, template_state.params))
    return step, type(template_state)(**restored["state"]), restored["meta"]


class Checkpointer:
    """Saves the TrainStates of the one run that owns the directory; restores the newest intact one."""

    def __init__(self, directory: str | Path, config: TrainConfig, keep: int = 3):
        self.directory = Path(directory)
        self.config = config
        try:
            self.manager = _manager(self.directory, keep)
        except OSError as err:
            raise CheckpointError(f"{self.directory}: cannot create checkpoint directory ({err})") from err

    def save(self, step: int, state, plan: plan_lib.Plan, stats: dict) -> None:
        meta = {
            "step": step,
            "config": dataclasses.asdict(self.config),
            "plan": plan.to_dict(),
            "stats": stats,
            "fashionjax_version": fashionjax.__version__,
            "jax_version": jax.__version__,
        }
        try:
            self.manager.save(step, args=ocp.args.Composite(
                state=ocp.args.StandardSave(_saved_fields(state)), meta=ocp.args.JsonSave(meta)), force=True)
            self.manager.wait_until_finished()
        except Exception as err:  # orbax surfaces I/O faults as many types; name the step and the cause
            raise CheckpointError(f"checkpoint at step {step} could not be written to {self.directory}: "
                                  f"{_first_line(err)}") from err

    def restore_latest(self, template_state, note: Callable[[str], None] = lambda message: None):
        """(step, state, meta) of the newest intact checkpoint; unreadable newer ones are removed,
        so that the steps they held can be saved again."""
        step, restored, broken = _restore_newest(self.manager, self.directory,
                                                 lambda: _state_args(template_state), note, template_state.params)
        for bad in broken:
            self.manager.delete(bad)
        return step, type(template_state)(**restored["state"]), restored["meta"]

    def close(self) -> None:
        self.manager.close()


def check_resume(meta: dict, config: TrainConfig, plan: plan_lib.Plan) -> None:
    """Refuse a resume that would not continue the saved run's trajectory, naming every difference."""
    # A field a checkpoint lacks did not exist when it was written: the run had its neutral default.
    saved = {**dataclasses.asdict(TrainConfig()), **meta["config"]}
    differences = config_lib.differences(saved, dataclasses.asdict(config), TRAJECTORY_FIELDS)
    if "plan" in meta:  # checkpoints of fashionjax 0.1 have none
        differences += plan_lib.differences(meta["plan"], plan)
    if differences:
        raise ResumeError("cannot resume with a different config: " + ", ".join(differences))


def _first_line(err: BaseException) -> str:
    """The cause in a few words: the OS's own for an I/O fault (tensorstore wraps it in a paragraph
    that names its internal files), else the error's first line."""
    if isinstance(err, OSError) and err.strerror:
        return f"{err.strerror}: {err.filename}" if err.filename else err.strerror
    os_error = re.search(r"os_error_code='?(\d+)", str(err))
    if os_error:
        return os.strerror(int(os_error.group(1)))
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0]}" if text else type(err).__name__


def check_length(config: TrainConfig, plan: plan_lib.Plan, meta: dict) -> None:
    """A run is not shortened past its checkpoint, and a decaying schedule laid out for N steps is not
    silently re-stretched: refuse another length."""
    if plan.total_steps < meta["step"]:
        raise ResumeError(f"--steps {plan.total_steps} is below the checkpoint's step {meta['step']}: "
                          "a run cannot be shortened past where it is")
    saved = meta.get("plan")
    if saved and config.decaying and plan.total_steps != saved["schedule_steps"]:
        raise ResumeError(
            f"the {config.schedule} schedule of this run is laid out for {saved['schedule_steps']} steps; running "
            f"{plan.total_steps} would change its learning rates (only constant-schedule runs can be extended)")
