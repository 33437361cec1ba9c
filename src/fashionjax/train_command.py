"""The `train` command around the library: who owns the run directory, in which order things are
checked and written, and what a signal at each phase leaves behind.

Order: flags (exit 2, nothing touched) -> the directory's lock (exit 1 at once if busy) -> the saved
config of a resumed run -> data, mesh and plan -> only then --overwrite's removals -> training
(signals deferred to the next chunk end) -> evaluation and artifacts (signals stop at once; the final
checkpoint is down, so --resume completes the run).
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import signal
from pathlib import Path

from fashionjax import (
    capacity,
    checkpoint,
    console,
    data,
    distributed,
    environment,
    rundir,
    tensorboard,
)
from fashionjax import config as config_lib
from fashionjax import plan as plan_lib
from fashionjax import run as run_lib
from fashionjax import train as train_lib
from fashionjax.checkpoint import ResumeError
from fashionjax.config import ConfigError, TrainConfig
from fashionjax.report import render
from fashionjax.signals import Interrupted, StopRequests, interruption


def fresh_config(explicit: dict) -> TrainConfig:
    """The model's recipe with the flags given on top. --steps replaces the recipe's epochs (and --epochs
    its steps), and --no-tta its shifted test views (views of the TTA it turns off), unless --tta-shift
    is given too."""
    explicit = config_lib.one_length(explicit)
    if explicit.get("tta") is False and "tta_shift" not in explicit:
        explicit = dict(explicit, tta_shift=0)
    return dataclasses.replace(config_lib.default(explicit.get("model", "mlp")), **explicit)


def resume_command(args, run_dir: Path) -> str:
    """The exact, shell-quoted command that continues this run."""
    words = ["fashionjax", "train", "--resume", "--run-dir", str(run_dir)]
    if args.data_dir:
        words += ["--data-dir", args.data_dir]
    if args.offline:
        words.append("--offline")
    return shlex.join(words)


def run(args, explicit: dict, out, stops: StopRequests) -> dict:
    """Train as the flags say and return the summary (with run_dir); `explicit` holds the TrainConfig
    fields the user typed."""
    if args.resume and not args.run_dir:
        raise ConfigError("--resume needs --run-dir")
    if args.resume and args.overwrite:
        raise ConfigError("--resume and --overwrite contradict each other")
    if not args.resume:
        config_lib.validate(fresh_config(explicit))  # flag faults first: before any file is touched
    multi = args.coordinator or args.num_processes or args.auto_distributed
    if multi and not args.run_dir:
        raise ConfigError("--run-dir is required with several processes (all of them write checkpoints there)")
    if args.resume and not Path(args.run_dir).is_dir():
        raise ResumeError(f"{Path(args.run_dir) / 'checkpoints'}: no finalized checkpoint to resume from "
                          "(no such run directory)")
    if args.resume and not rundir.has_checkpoint(Path(args.run_dir)):  # a folder of runs is named as such
        rundir.require_run(args.run_dir)

    distributed.initialize(args.coordinator, args.num_processes, args.process_id, _stop_for_a_lost_process(out),
                           auto=args.auto_distributed, timeout=args.coordinator_timeout)
    writer = distributed.process_index() == 0
    owned = None
    if writer:  # one training per directory: refused at once, before any data is loaded
        owned = rundir.RunDir.claim(args.run_dir) if args.run_dir else \
            rundir.RunDir.new_default(explicit.get("model", "mlp"))
    run_dir = owned.path if owned else Path(args.run_dir)
    try:
        return _train_owned(args, out, stops, explicit, owned, owned or rundir.RunDir(run_dir))
    finally:
        if owned is not None:
            owned.release()


def _train_owned(args, out, stops: StopRequests, explicit: dict, owned, target) -> dict:
    """The training itself, once the directory is ours (owned: process 0) or a view of it (target)."""
    run_dir = target.path
    checkpoints = run_dir / "checkpoints"
    hint = resume_command(args, run_dir)
    meta = None
    try:
        if args.resume:
            config, meta = run_lib.resumed_config(checkpoints, explicit)
            config_lib.validate(config)
        else:
            config = config_lib.validate(fresh_config(explicit))
            if owned is not None:
                owned.check_new_run(args.overwrite)
            if config.tta and not config.augment:  # measured: 89.51% with TTA against 92.39% without
                out.note("--tta without --augment: the model never sees a mirrored image in training, so its "
                         "flip TTA figure is likely the lower one (both are reported)")
        if config.tensorboard:
            tensorboard.require()
        environment.enable_compile_cache()
        dataset = data.load(args.data_dir, offline=args.offline, log=out.note)
        mesh = distributed.make_mesh(args.devices)
        saved_plan = (meta or {}).get("plan")
        plan = plan_lib.resolve(config, len(dataset.train.labels), int(mesh.devices.size),
                                schedule_steps=saved_plan["schedule_steps"] if saved_plan else None)
        if meta is not None:
            checkpoint.check_length(config, plan, meta)
        if plan.members > 1:  # before anything compiles: do N models' states fit?
            train_data = dataset.train.images_u8.nbytes + dataset.train.labels.nbytes
            capacity.check(config, plan.schedule_steps, train_data, mesh.devices.flat[0], plan.num_examples)
        if owned is not None and args.overwrite:
            owned.clear()  # only now: every flag is valid and the data is here
        progress = console.Progress(out, plan.total_steps)
        with progress:
            hooks = train_lib.Hooks(on_log=progress.update, stop_signal=stops.pending, on_note=out.note)
            with stops.deferred():
                result = run_lib.train(config, plan, dataset, target, mesh, resume=args.resume, hooks=hooks)
        stops.raise_pending(plan.total_steps)  # a signal during the last chunk: its checkpoint is down
        summary = run_lib.finish(config, result, dataset, target, mesh)
        if owned is not None:
            out.note(f"report: {render.render(run_dir, target=owned.file('report.html'))}")
    except BaseException as err:
        stop = interruption(err)
        if stop is not None:
            _report_interrupt(out, stop, owned, hint)
            raise stop from None
        if owned is not None and not args.resume and not rundir.has_checkpoint(run_dir):
            owned.discard_unresumable()
        raise
    return dict(summary, run_dir=str(run_dir))


def _stop_for_a_lost_process(out):
    """What a process does when another of its run fails, is stopped alone or dies (rendezvous' watch,
    in a thread): say so in one line and leave at once, where it would wait in a collective for JAX's
    timeout or abort. A stop ends every process with that signal's exit code, as an agreed one does."""
    def stop(process_id: int, kind: str, detail: str) -> None:
        kept = "its finalized checkpoints kept (start every process again with --resume)"
        code, error_kind = 1, "runtime"
        if kind == "failed":
            message = f"process {process_id} of this run failed ({detail}); this one stops too"
        elif kind == "stopped" and detail in signal.Signals.__members__:
            message = f"process {process_id} of this run was stopped by {detail}; this one stops too, {kept}"
            code, error_kind = 128 + signal.Signals[detail], "interrupted"
        else:
            message = f"process {process_id} of this run ended without a word (killed or crashed); this one stops too, {kept}"
        out.fail(f"fashionjax train: {message}", code, error_kind)
        os._exit(code)  # the main thread may be waiting in a collective that will never complete
    return stop


def _report_interrupt(out, stop: Interrupted, owned, hint: str) -> None:
    """Say what an interrupt left behind, and how to go on from it."""
    if owned is not None and rundir.has_checkpoint(owned.path):
        stop.outcome = f"checkpoint saved, resume with: {hint}"
        out.facts.update(run_dir=str(owned.path), step=stop.step, resume_command=hint)
    elif owned is not None:
        owned.discard_unresumable()  # nothing resumable yet: leave no half-written directory
        stop.outcome = "before training began; nothing was kept"
