"""`fashionjax speedrun`: the record check. Train one recipe for N named seeds, then report every
seed, the mean and spread, how many reached the target and how fast.

Each seed is an ordinary run directory (OUT/seed-S) trained by the train command's own code, so
locks, signals, checkpoints and resume behave exactly as there. Running the same command again
keeps the seeds that finished and resumes the ones that were interrupted.
"""

from __future__ import annotations

import argparse
import math
import statistics
from pathlib import Path

from fashionjax import artifacts, environment, models, rundir
from fashionjax.config import ConfigError
from fashionjax.signals import Interrupted

SPEEDRUN_JSON = "speedrun.json"


def seed_row(summary: dict, target: float) -> dict:
    """One seed's line of the record: its accuracy, time and whether it reached the target."""
    return {
        "seed": summary["seed"],
        "test_accuracy": summary["test_accuracy"],
        "test_accuracy_no_tta": summary["test_accuracy_no_tta"],
        "train_seconds": summary["train_seconds"],
        "compile_seconds": summary["compile_seconds"],
        "train_examples_per_sec": summary["train_examples_per_sec"],
        "reached_target": summary["test_accuracy"] >= target,
        "params_digest": summary["params_digest"],
        "run_dir": summary["run_dir"],
    }


def aggregate(rows: list[dict], target: float) -> dict:
    """Mean and sample standard deviation (n - 1) of the accuracies, the fraction of seeds at or over
    the target, and the median training time to the target, where a seed that missed it counts as
    never arriving (so the median is None when half or more missed)."""
    accuracies = [row["test_accuracy"] for row in rows]
    plain = [row["test_accuracy_no_tta"] for row in rows]
    times = sorted(row["train_seconds"] if row["reached_target"] else math.inf for row in rows)
    median_time = statistics.median(times)
    return {
        "seeds": [row["seed"] for row in rows],
        "test_accuracy_mean": statistics.fmean(accuracies),
        "test_accuracy_std": statistics.stdev(accuracies) if len(rows) > 1 else 0.0,
        "test_accuracy_no_tta_mean": statistics.fmean(plain),
        "test_accuracy_no_tta_std": statistics.stdev(plain) if len(rows) > 1 else 0.0,
        "target": target,
        "reached_fraction": sum(row["reached_target"] for row in rows) / len(rows),
        "median_seconds_to_target": None if math.isinf(median_time) else median_time,
        "train_seconds_median": statistics.median(row["train_seconds"] for row in rows),
    }


def seed_arguments(args: argparse.Namespace, run_dir: Path, resume: bool) -> argparse.Namespace:
    """The train command's arguments for one seed's run directory (single process)."""
    return argparse.Namespace(**vars(args), run_dir=str(run_dir), resume=resume, overwrite=False, coordinator=None,
                              num_processes=None, process_id=None, auto_distributed=False, coordinator_timeout=60.0)


def finished_summary(run_dir: Path, wanted: dict) -> dict | None:
    """A seed's summary from an earlier invocation, if it finished with the same recipe; else None."""
    summary_path = run_dir / "summary.json"
    if not summary_path.is_file():
        return None
    saved = artifacts.read_json(run_dir / "config.json")["config"]
    if any(saved.get(name) != value for name, value in wanted.items()):
        raise ConfigError(f"{run_dir}: finished with other settings; choose another --out")
    return dict(artifacts.read_json(summary_path), run_dir=str(run_dir))


def run(args, explicit: dict, out, stops, train_one) -> dict:
    """Train (or keep, or resume) every seed, then write speedrun.json and its page; returns the document.

    train_one(seed_args, explicit, out, stops) -> summary is the train command's core.
    """
    first_seed = explicit.get("seed", 0)
    out_dir = artifacts.ensure_dir(Path(args.out) if args.out else Path("runs") / f"speedrun-{artifacts.utc_stamp()}")
    rows = []
    for seed in range(first_seed, first_seed + args.seeds):
        seed_config = dict(explicit, seed=seed)
        run_dir = out_dir / f"seed-{seed}"
        summary = finished_summary(run_dir, seed_config)
        if summary is not None:
            out.note(f"seed {seed}: finished earlier in {run_dir}; keeping it")
        else:
            resume = rundir.has_checkpoint(run_dir)
            out.note(f"seed {seed}: {'resuming' if resume else 'training'} in {run_dir}")
            try:
                summary = train_one(seed_arguments(args, run_dir, resume), {} if resume else seed_config, out, stops)
            except Interrupted as stop:
                stop.outcome = (f"seed {seed}: {stop.outcome or 'stopped'}; to finish every seed, run the same "
                                "speedrun command again (it keeps the seeds that finished and goes on from here)")
                raise
        rows.append(seed_row(summary, args.target))
    return write(out_dir, rows, args.target, summary)


def write(out_dir: Path, rows: list[dict], target: float, last_summary: dict) -> dict:
    from fashionjax.report import plots, render

    model = models.get(last_summary["model"])
    config = artifacts.read_json(Path(last_summary["run_dir"]) / "config.json")["config"]
    document = {
        "model": model.name,
        "config": {name: value for name, value in config.items() if name != "seed"},
        "per_seed": rows,
        **aggregate(rows, target),
        "train_flops_per_run": (model.run_flops_per_example(config["whiten"]) * last_summary["steps"]
                                * last_summary["batch_size"]),
        "tta": last_summary["tta"],
        "tta_shift": last_summary.get("tta_shift", 0),
        "cpu_model": environment.cpu_model(),
        "environment": environment.describe(),
        "charts": ["speedrun.png"],
    }
    plots.strip([row["test_accuracy"] for row in rows], [row["seed"] for row in rows], target,
                f"{model.name}: test accuracy per seed", out_dir / "speedrun.png")
    artifacts.atomic_write_json(out_dir / SPEEDRUN_JSON, document)
    document["page"] = str(render.render_speedrun(out_dir))
    return document
