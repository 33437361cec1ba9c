"""A training run end to end: run directory, fit, evaluation, artifacts and report.

The CLI calls these; tests and the notebook can too. Only process 0 writes files.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import numpy as np

import fashionjax
from fashionjax import (
    artifacts,
    checkpoint,
    data,
    distributed,
    environment,
    evaluate,
    models,
    rundir,
    tensorboard,
)
from fashionjax import config as config_lib
from fashionjax import train as train_lib
from fashionjax.config import TRAJECTORY_FIELDS, ConfigError, TrainConfig
from fashionjax.plan import Plan
from fashionjax.report import plots
from fashionjax.rundir import RunDir

PREDICTION_SEED = 7  # the codelab's choice of 25 test images


def is_writer() -> bool:
    return jax.process_index() == 0


def write_config(run_dir: RunDir, config: TrainConfig, plan: Plan, dataset: data.Dataset, mesh) -> None:
    """config.json: the fashionjax marker, the resolved config and plan, and what the report describes."""
    model = models.get(config.model)
    params = jax.eval_shape(model.init, jax.random.key(0))
    document = {
        "fashionjax": rundir.marker(),
        "config": dataclasses.asdict(config),
        "plan": plan.to_dict(),
        "environment": environment.describe(with_git=True),
        "mesh_devices": int(mesh.devices.size),
        "dataset": data.summarize(dataset),
        "model": {"name": model.name, "description": model.description,
                  "params": models.count_params(params), "leaves": models.param_table(params),
                  "train_flops_per_example": model.run_flops_per_example(config.whiten)},
    }
    artifacts.atomic_write_json(run_dir.file("config.json"), document)


def resumed_config(checkpoint_dir: Path, explicit: dict, note=lambda message: None) -> tuple[TrainConfig, dict]:
    """The saved run's config with the explicitly given flags applied on top, and the checkpoint's metadata.

    Trajectory flags that differ are refused (every difference named); the length and the cadences
    may be given. `explicit` holds only flags the user typed.
    """
    meta = checkpoint.latest_meta(checkpoint_dir, note)
    if meta is None:
        raise checkpoint.ResumeError(f"{checkpoint_dir}: no finalized checkpoint to resume from (the run stopped "
                                     "before its first one: start it again with --overwrite)")
    differences = config_lib.differences(meta["config"], {**meta["config"], **explicit}, TRAJECTORY_FIELDS)
    if differences:
        raise checkpoint.ResumeError("cannot resume with a different config: " + ", ".join(differences))
    saved = rundir.saved_config(meta["config"], checkpoint_dir)
    return dataclasses.replace(saved, **config_lib.one_length(explicit)), meta


def train(config: TrainConfig, plan: Plan, dataset: data.Dataset, run_dir: RunDir, mesh, resume: bool = False,
          hooks: train_lib.Hooks | None = None) -> train_lib.FitResult:
    """Fit from scratch or from the newest intact checkpoint, writing config.json and metrics.jsonl."""
    hooks = hooks or train_lib.Hooks()
    if is_writer() and not resume:  # config.json first: it marks the directory as a fashionjax run
        write_config(run_dir, config, plan, dataset, mesh)
    metrics_path = run_dir.file("metrics.jsonl") if is_writer() else None
    checkpoints = run_dir.file("checkpoints") if is_writer() else run_dir.path / "checkpoints"
    checkpointer = checkpoint.Checkpointer(checkpoints, config, keep=config.keep)
    events = None
    try:
        start = None
        if resume:
            template = train_lib.initial_state(config, plan.schedule_steps, num_examples=plan.num_examples)
            step, state, meta = checkpointer.restore_latest(template, hooks.on_note)
            checkpoint.check_resume(meta, config, plan)
            if is_writer():  # log points past the checkpoint will be run (and logged) again
                artifacts.truncate_jsonl(metrics_path, lambda record: record["step"] <= step)
            done = " (training had finished: evaluating)" if step == plan.total_steps else ""
            hooks.on_note(f"resuming from the checkpoint at step {step}{done}")
            start = (state, train_lib.TrainStats(**meta.get("stats", {})))
            if is_writer():  # the checks passed: the config now says how the run goes on
                write_config(run_dir, config, plan, dataset, mesh)
        elif is_writer():
            plots.samples(dataset.train.images_u8, dataset.train.labels, dataset.class_names,
                          run_dir.file("samples.png"))
        if config.tensorboard and is_writer():  # after the resume cut metrics.jsonl back: the events mirror it
            events = tensorboard.Events.restart(run_dir.file(tensorboard.DIRECTORY), artifacts.read_jsonl(metrics_path))
            hooks = dataclasses.replace(hooks, on_log=lambda record, log=hooks.on_log: (events.log(record), log(record)))
        if plan.dropped_per_epoch:
            hooks.on_note(f"each epoch drops the last {plan.dropped_per_epoch} training examples (a partial batch)")
        return train_lib.fit(config, dataset.train.images_u8, dataset.train.labels, mesh=mesh, plan=plan,
                             metrics_path=metrics_path, checkpointer=checkpointer, hooks=hooks, start=start)
    finally:
        checkpointer.close()
        if events is not None:
            events.close()


def finish(config: TrainConfig, result: train_lib.FitResult, dataset: data.Dataset, run_dir: RunDir, mesh) -> dict:
    """Evaluate on the whole test set and write every artifact; returns summary.json."""
    params = train_lib.evaluated_params(config, result.state)
    scored = score(config, params, dataset, mesh)
    summary = make_summary(config, result, params, scored["report"], mesh)
    if is_writer():
        write_eval_artifacts(run_dir, scored, dataset)
        plots.curve(artifacts.read_jsonl(run_dir.path / "metrics.jsonl"), run_dir.file("curve.png"))
        if config.tensorboard:
            events = tensorboard.Events(run_dir.file(tensorboard.DIRECTORY), "test")
            events.finish(config, summary)
            events.close()
        artifacts.atomic_write_json(run_dir.file("summary.json"), summary)  # last: the run is complete
    return summary


def score(config: TrainConfig, params, dataset: data.Dataset, mesh) -> dict:
    """Evaluate on the whole test set: the model, or every member of a multi-model run and their ensemble."""
    test = dataset.test
    members = config_lib.member_configs(config)
    if len(members) == 1:
        return evaluate.run(params, config.model, test.images_u8, test.labels, config.dtype,
                            config.eval_batch_size, mesh, config.tta, config.tta_shift)
    host_params = distributed.fetch(params)  # each member's digest below slices these: no device program
    scored = evaluate.run_members(host_params, config.model, test.images_u8, test.labels,
                                  [member.seed for member in members], config.dtype, config.eval_batch_size, config.tta,
                                  config.tta_shift)
    for row, member, member_params in zip(scored["report"]["members"], members,
                                          train_lib.unstack(host_params, len(members)), strict=True):
        row["params_digest"] = train_lib.params_digest(member_params)
        row.update({name: getattr(member, name) for name, _ in config.sweep})
    return scored


def member_figures(report: dict, config: TrainConfig) -> dict:
    """summary.json's keys for a multi-model run: the finite members' mean ± sample std, each member, the
    ensemble, and for a sweep one row per member with its values and the best row."""
    members = report["members"]
    finite = [m for m in members if m["finite"]]
    accuracies = np.array([m["test_accuracy"] for m in finite])
    return {
        "test_accuracy": float(accuracies.mean()),
        "test_accuracy_std": float(accuracies.std(ddof=1)) if len(finite) > 1 else None,
        "test_accuracy_no_tta": float(np.mean([m["test_accuracy_no_tta"] for m in finite])),
        "test_loss": float(np.mean([m["test_loss"] for m in finite])),
        "per_seed": [{key: m[key] for key in ("seed", "test_accuracy", "test_loss", "params_digest")}
                     for m in members],
        "diverged_seeds": [m["seed"] for m in members if not m["finite"]],
        "ensemble_test_accuracy": report["accuracy"],
        "ensemble_members": report["ensemble_members"],
        **(sweep_rows(members, config, report["examples"]) if config.sweep else {}),
    }


def sweep_rows(members: list[dict], config: TrainConfig, examples: int) -> dict:
    """One row per member: its swept values under their config names, its seed and accuracy; and the best."""
    names = [name for name, _ in config.sweep]
    rows = [{**{name: m[name] for name in names}, "seed": m["seed"], "test_accuracy": m["test_accuracy"],
             "test_examples": examples, "diverged": not m["finite"]} for m in members]
    finite = [row for row in rows if not row["diverged"]]
    return {"sweep": rows, "best": max(finite, key=lambda row: row["test_accuracy"])}


def make_summary(config: TrainConfig, result: train_lib.FitResult, scored_params, report: dict, mesh) -> dict:
    env = environment.describe()
    plan, stats = result.plan, result.stats
    return {
        "model": config.model,
        "params": models.count_params(result.state.params) // config_lib.member_count(config),  # per model
        "steps": plan.total_steps,
        "epochs": round(plan.epochs(plan.total_steps), 4),
        "batch_size": config.batch_size,
        "dtype": config.dtype,
        "optimizer": config.optimizer,
        "lr": config.lr,
        "schedule": config.schedule,
        "seed": config.seed,
        "test_accuracy": report["accuracy"],  # with test-time augmentation when config.tta
        "test_accuracy_no_tta": report.get("accuracy_no_tta", report["accuracy"]),
        "tta": config.tta,
        "tta_shift": config.tta_shift,
        "test_loss": report["loss"],
        "test_examples": report["examples"],
        "train_examples_per_sec": stats.steady_examples_per_sec(),
        "compile_seconds": stats.compile_seconds,
        "train_seconds": stats.train_seconds,
        "wall_seconds": stats.wall_seconds,
        "final_train_loss": stats.final_train_loss,
        "params_digest": train_lib.params_digest(scored_params),
        "backend": env["backend"],
        "device_kind": env["device_kind"],
        "device_count": int(mesh.devices.size),
        "process_count": env["process_count"],
        "jax_version": env["jax_version"],
        "fashionjax_version": fashionjax.__version__,
        "seeds": config.seeds,
        **(member_figures(report, config) if config_lib.member_count(config) > 1 else {}),
    }


def write_eval_artifacts(run_dir: RunDir, scored: dict, dataset: data.Dataset) -> None:
    """eval.json, confusion.png, predictions.png and mistakes.png."""
    report, predictions, confidence = scored["report"], scored["predictions"], scored["confidence"]
    test = dataset.test
    names = dataset.class_names
    artifacts.atomic_write_json(run_dir.file("eval.json"), dict(report, class_names=list(names)))
    plots.confusion(np.asarray(report["confusion"]), names, run_dir.file("confusion.png"))
    finite = [m for m in report.get("members", []) if m["finite"]]
    if finite:
        plots.strip([m["test_accuracy"] for m in finite], [m["seed"] for m in finite], report["accuracy"],
                    "Each member's test accuracy", run_dir.file("members.png"), target_name="ensemble")
    swept = [name for name in config_lib.SWEEPABLE if finite and name in finite[0]]
    if swept:
        plots.sweep(finite, swept, run_dir.file("sweep.png"))
    sample = np.random.default_rng(PREDICTION_SEED).choice(len(test.labels), size=25, replace=False)
    plots.image_grid(test.images_u8[sample], test.labels[sample], predictions[sample], names,
                     run_dir.file("predictions.png"), "Sample test predictions")
    wrong = np.flatnonzero(predictions != test.labels)
    worst = wrong[np.argsort(-confidence[wrong], kind="stable")][:25]
    plots.image_grid(test.images_u8[worst], test.labels[worst], predictions[worst], names,
                     run_dir.file("mistakes.png"), "Most confident mistakes",
                     notes=[f"{100 * confidence[i]:.1f}% sure" for i in worst])


@dataclasses.dataclass(frozen=True)
class Trained:
    """A run's saved config and the parameters of its newest intact checkpoint."""

    run_dir: Path
    config: TrainConfig
    step: int
    params: dict
    member: int | None = None  # which model of a multi-model run these parameters are; None: all of them


def load_trained(run_dir: str | Path, note=lambda message: None, member: int | None = None) -> Trained:
    """The newest intact checkpoint's parameters, opened read-only (safe on a run still training); with
    member, only that model of a multi-model run, as a run of its own would hold it (one_member)."""
    run_dir = rundir.require_run(run_dir)
    document, config = rundir.read_config(run_dir)
    single = None if member is None else member_config(config, member, run_dir)  # refused before the read
    template = train_lib.initial_state(config, 1, num_examples=document.get("plan", {}).get("num_examples"))
    try:
        step, state, _ = checkpoint.read_latest(run_dir / "checkpoints", template, note)
    except checkpoint.CheckpointError:
        live = rundir.is_live(run_dir)
        if live is None or rundir.has_checkpoint(run_dir):
            raise
        raise checkpoint.CheckpointError(f"{run_dir / 'checkpoints'}: no finalized checkpoint yet: the training in "
                                         f"this run (pid {live[0]}) has not written its first; try again after it "
                                         "does") from None
    trained = Trained(run_dir, config, step, train_lib.evaluated_params(config, state))
    return trained if member is None else one_member(trained, member, single)


def member_config(config: TrainConfig, member: int, run_dir: Path) -> TrainConfig:
    """The single-run config of the run's model number `member` (summary.json's per_seed order, from 0)."""
    members = config_lib.member_configs(config)
    if not 0 <= member < len(members):
        held = f"{len(members)} models, numbered 0-{len(members) - 1}" if len(members) > 1 else "one model, numbered 0"
        raise ConfigError(f"--member {member}: {run_dir} holds {held}")
    return members[member]


def one_member(trained: Trained, member: int, single: TrainConfig) -> Trained:
    """Model number `member` of a run's models, with its single-run config (member_config: its seed and
    swept values): predicted, exported and evaluated as a single run's model, not the ensemble."""
    count = config_lib.member_count(trained.config)
    params = trained.params if count == 1 else jax.tree.map(lambda leaf: leaf[member], trained.params)
    if not all(np.isfinite(np.asarray(leaf)).all() for leaf in jax.tree.leaves(params)):
        raise ConfigError(f"--member {member}: model {member} of {trained.run_dir} diverged (its parameters are not "
                          "finite); choose another")
    return dataclasses.replace(trained, config=single, params=params, member=member)


def rescore(run_dir: Path, dataset: data.Dataset, mesh, note=lambda message: None, member: int | None = None) -> dict:
    """Evaluate the newest intact checkpoint of a run (or one of its models) again on the whole test
    set, touching nothing."""
    trained = load_trained(run_dir, note, member)
    scored = score(trained.config, trained.params, dataset, mesh)
    scored["report"]["step"] = trained.step
    scored["report"]["member"] = trained.member
    scored["report"]["params_digest"] = train_lib.params_digest(trained.params)
    return scored
