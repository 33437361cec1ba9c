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
    environment,
    evaluate,
    models,
    train,
)
from fashionjax.config import TrainConfig
from fashionjax.report import plots

PREDICTION_SEED = 7  # the codelab's choice of 25 test images


def default_run_dir(model: str) -> Path:
    return Path("runs") / f"{artifacts.utc_stamp()}-{model}"


def is_writer() -> bool:
    return jax.process_index() == 0


def write_config(run_dir: Path, config: TrainConfig, dataset: data.Dataset, mesh) -> None:
    """config.json: the resolved config plus what the report needs to describe the run."""
    model = models.get(config.model)
    params = jax.eval_shape(model.init, jax.random.key(0))
    document = {
        "config": dataclasses.asdict(config),
        "environment": environment.describe(with_git=True),
        "mesh_devices": int(mesh.devices.size),
        "dataset": data.summarize(dataset),
        "model": {"name": model.name, "description": model.description,
                  "params": models.count_params(params), "leaves": models.param_table(params),
                  "train_flops_per_example": model.train_flops_per_example},
    }
    artifacts.atomic_write_json(run_dir / "config.json", document)


def train_and_evaluate(config: TrainConfig, dataset: data.Dataset, run_dir: Path, mesh, resume: bool = False,
                       hooks: train.Hooks | None = None) -> dict:
    """Fit, evaluate on the whole test set, and write every artifact; returns summary.json."""
    hooks = hooks or train.Hooks()
    metrics_path = run_dir / "metrics.jsonl"
    if resume:
        meta = checkpoint.check_resume(run_dir / "checkpoints", config)
        if is_writer():  # log points past the checkpoint will be run (and logged) again
            artifacts.truncate_jsonl(metrics_path, lambda record: record["step"] <= meta["step"])
        hooks.on_note(f"resuming from the checkpoint at step {meta['step']}")
    elif is_writer():
        plots.samples(dataset.train.images_u8, dataset.train.labels, dataset.class_names, run_dir / "samples.png")
    if is_writer():
        write_config(run_dir, config, dataset, mesh)
    dropped = len(dataset.train.labels) % config.batch_size
    if dropped:
        hooks.on_note(f"each epoch drops the last {dropped} training examples (a partial batch)")
    _, data_key = train.root_keys(config.seed)
    checkpointer = checkpoint.Checkpointer(run_dir / "checkpoints", config, every=config.checkpoint_every,
                                           keep=config.keep, data_key=data_key)
    try:
        result = train.fit(config, dataset.train.images_u8, dataset.train.labels, mesh=mesh,
                           metrics_path=metrics_path, checkpointer=checkpointer, hooks=hooks)
    finally:
        checkpointer.close()
    scored = evaluate.run(result.state.params, config.model, dataset.test.images_u8, dataset.test.labels,
                          config.dtype, config.eval_batch_size, mesh)
    summary = make_summary(config, result, scored["report"], mesh)
    if is_writer():
        write_eval_artifacts(run_dir, scored, dataset)
        artifacts.atomic_write_json(run_dir / "summary.json", summary)
        plots.curve(artifacts.read_jsonl(metrics_path), run_dir / "curve.png")
    return summary


def make_summary(config: TrainConfig, result: train.FitResult, report: dict, mesh) -> dict:
    env = environment.describe()
    return {
        "model": config.model,
        "params": models.count_params(result.state.params),
        "steps": result.total_steps,
        "epochs": round(result.total_steps / result.steps_per_epoch, 4),
        "batch_size": config.batch_size,
        "dtype": config.dtype,
        "optimizer": config.optimizer,
        "lr": config.lr,
        "schedule": config.schedule,
        "seed": config.seed,
        "test_accuracy": report["accuracy"],
        "test_loss": report["loss"],
        "test_examples": report["examples"],
        "train_examples_per_sec": result.steady_examples_per_sec,
        "compile_seconds": result.compile_seconds,
        "wall_seconds": result.wall_seconds,
        "final_train_loss": result.final_train_loss,
        "params_digest": train.params_digest(result.state.params),
        "backend": env["backend"],
        "device_kind": env["device_kind"],
        "device_count": int(mesh.devices.size),
        "process_count": env["process_count"],
        "jax_version": env["jax_version"],
        "fashionjax_version": fashionjax.__version__,
    }


def write_eval_artifacts(run_dir: Path, scored: dict, dataset: data.Dataset) -> None:
    """eval.json, confusion.png, predictions.png and mistakes.png."""
    report, predictions, confidence = scored["report"], scored["predictions"], scored["confidence"]
    test = dataset.test
    names = dataset.class_names
    artifacts.atomic_write_json(run_dir / "eval.json", dict(report, class_names=list(names)))
    plots.confusion(np.asarray(report["confusion"]), names, run_dir / "confusion.png")
    sample = np.random.default_rng(PREDICTION_SEED).choice(len(test.labels), size=25, replace=False)
    plots.image_grid(test.images_u8[sample], test.labels[sample], predictions[sample], names,
                     run_dir / "predictions.png", "Sample test predictions")
    wrong = np.flatnonzero(predictions != test.labels)
    worst = wrong[np.argsort(-confidence[wrong], kind="stable")][:25]
    plots.image_grid(test.images_u8[worst], test.labels[worst], predictions[worst], names,
                     run_dir / "mistakes.png", "Most confident mistakes",
                     notes=[f"{100 * confidence[i]:.1f}% sure" for i in worst])


def rescore(run_dir: Path, dataset: data.Dataset, mesh) -> dict:
    """Evaluate the final saved parameters of a finished run again on the whole test set."""
    saved = artifacts.read_json(run_dir / "config.json")["config"]
    config = TrainConfig(**saved)
    model = models.get(config.model)
    optimizer = train.make_optimizer(config, config.total_steps(len(dataset.train.labels)))
    template, _ = train.init_state(model, optimizer, config.seed)
    meta = checkpoint.read_meta(run_dir / "checkpoints")
    if meta is None:
        raise checkpoint.CheckpointError(f"{run_dir / 'checkpoints'}: no finalized checkpoint to evaluate")
    checkpointer = checkpoint.Checkpointer(run_dir / "checkpoints", config, keep=config.keep)
    try:
        state = checkpointer.restore(template)
    finally:
        checkpointer.close()
    scored = evaluate.run(state.params, config.model, dataset.test.images_u8,
                          dataset.test.labels, config.dtype, config.eval_batch_size, mesh)
    scored["report"]["step"] = meta["step"]
    scored["report"]["params_digest"] = train.params_digest(state.params)
    return scored
