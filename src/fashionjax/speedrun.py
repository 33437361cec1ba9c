"""`fashionjax speedrun`: the record check. Train one recipe for N named seeds, then report every
seed, the mean and spread, how many reached the target and how fast.

Each seed is an ordinary run directory (OUT/seed-S) trained by the train command's own code, so
locks, signals, checkpoints and resume behave exactly as there. Running the same command again
keeps the seeds that finished, resumes the ones that were interrupted and starts again one stopped
before its first checkpoint; a seed's directory from another recipe is refused, never mixed in.

With --blend OUT2 each seed is scored together with OUT2's run of the same seed (another speedrun's
output, of any recipe): the record is then the blend's accuracy and both runs' training.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
from pathlib import Path

from fashionjax import artifacts, data, environment, models, rundir
from fashionjax import blend as blend_lib
from fashionjax import config as config_lib
from fashionjax import run as run_lib
from fashionjax.checkpoint import CheckpointError
from fashionjax.config import ConfigError
from fashionjax.signals import Interrupted
from fashionjax.train_command import fresh_config

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


def seed_arguments(args: argparse.Namespace, run_dir: Path, resume: bool, overwrite: bool = False) -> argparse.Namespace:
    """The train command's arguments for one seed's run directory (single process)."""
    return argparse.Namespace(**vars(args), run_dir=str(run_dir), resume=resume, overwrite=overwrite, coordinator=None,
                              num_processes=None, process_id=None, auto_distributed=False, coordinator_timeout=60.0)


# What a seed's earlier run must share with this command to be kept or resumed: its trajectory, its
# length and how its test accuracy is scored.
RECIPE_FIELDS = (*config_lib.TRAJECTORY_FIELDS, "epochs", "steps", "tta", "tta_shift")


def earlier_run(run_dir: Path, wanted: dict) -> str | None:
    """What an earlier invocation left of one seed: None (nothing), "finished", "resumable" (a
    checkpoint to go on from) or "restart" (stopped before its first checkpoint: nothing to keep).
    A finished or resumable run of any other recipe is refused: `wanted` is this command's config."""
    if (run_dir / "summary.json").is_file():
        state = "finished"
    elif rundir.has_checkpoint(run_dir):
        state = "resumable"
    else:
        return "restart" if run_dir.exists() else None
    differences = config_lib.differences(rundir.read_config(run_dir)[0]["config"], wanted,
                                         RECIPE_FIELDS)
    if differences:
        raise ConfigError(f"{run_dir}: {'finished' if state == 'finished' else 'started'} with other settings "
                          f"({', '.join(differences)}); choose another --out")
    return state


def blend_partners(blend_dir: Path, out_dir: Path, seeds: range) -> dict[int, tuple[dict, run_lib.Trained]]:
    """The finished run of each seed in another speedrun's output (seed -> (its summary with run_dir, its
    parameters)), read before anything trains: a seed without one, or whose checkpoint does not read
    back, is refused, naming its directory, rather than after this speedrun's own training."""
    if blend_dir.resolve() == out_dir.resolve():
        raise ConfigError(f"--blend {blend_dir}: that is this speedrun's own --out; name another speedrun's output")
    summary_paths = {seed: blend_dir / f"seed-{seed}" / "summary.json" for seed in seeds}
    for seed, summary_path in summary_paths.items():
        if not summary_path.is_file():
            raise ConfigError(f"--blend {blend_dir}: no finished run of seed {seed} ({summary_path} is missing); "
                              f"run `fashionjax speedrun --out {blend_dir}` for these seeds first")
    return {seed: (dict(artifacts.read_json(path), run_dir=str(path.parent)), partner_run(blend_dir, path.parent))
            for seed, path in summary_paths.items()}


def partner_run(blend_dir: Path, run_dir: Path) -> run_lib.Trained:
    """A --blend run's parameters; what stops them loading is refused as it is, its line naming --blend."""
    try:
        return run_lib.load_trained(run_dir)
    except (ConfigError, CheckpointError) as err:
        raise type(err)(f"--blend {blend_dir}: {err}") from err


def blended_row(row: dict, partner: tuple[dict, run_lib.Trained], weight: float, dataset, target: float) -> dict:
    """A seed's line of the record as its run and its partner (summary, parameters) score together: the
    blend's accuracy (each run with its own TTA, and neither with any), the two runs' training summed,
    each run's own."""
    partner_summary, partner_trained = partner
    scored = blend_lib.score([run_lib.load_trained(row["run_dir"]), partner_trained],
                             [1.0, weight], dataset.test.images_u8, dataset.test.labels)
    for part, summary in zip(scored["runs"], (row, partner_summary), strict=True):
        part.update(train_seconds=summary["train_seconds"], compile_seconds=summary["compile_seconds"],
                    train_examples_per_sec=summary["train_examples_per_sec"])
    return {**row, "test_accuracy": scored["test_accuracy"], "test_accuracy_no_tta": scored["test_accuracy_no_tta"],
            "train_seconds": row["train_seconds"] + partner_summary["train_seconds"],
            "compile_seconds": row["compile_seconds"] + partner_summary["compile_seconds"],
            "train_examples_per_sec": None,  # two runs of different networks: each part has its own
            "reached_target": scored["test_accuracy"] >= target, "blend": scored["runs"]}


def run(args, explicit: dict, out, stops, train_one) -> dict:
    """Train (or keep, or resume) every seed, then write speedrun.json and its page; returns the document.

    train_one(seed_args, explicit, out, stops) -> summary is the train command's core.
    """
    first_seed = explicit.get("seed", 0)
    seeds = range(first_seed, first_seed + args.seeds)
    out_dir = Path(args.out) if args.out else Path("runs") / f"speedrun-{artifacts.utc_stamp()}"
    partners = blend_partners(Path(args.blend), out_dir, seeds) if args.blend else None
    rundir.ensure_out_dir(out_dir)
    rows = []
    for seed in seeds:
        seed_config = dict(explicit, seed=seed)
        run_dir = out_dir / f"seed-{seed}"
        earlier = earlier_run(run_dir, dataclasses.asdict(fresh_config(seed_config)))
        if earlier == "finished":
            out.note(f"seed {seed}: finished earlier in {run_dir}; keeping it")
            summary = dict(artifacts.read_json(run_dir / "summary.json"), run_dir=str(run_dir))
        else:
            resume = earlier == "resumable"
            out.note(f"seed {seed}: {'resuming' if resume else 'training'} in {run_dir}")
            # a run stopped before its first checkpoint holds only what fashionjax wrote: start it again
            seed_args = seed_arguments(args, run_dir, resume, overwrite=earlier == "restart")
            try:
                summary = train_one(seed_args, seed_config, out, stops)
            except rundir.RunDirBusy:
                raise rundir.busy(run_dir, "--out") from None  # speedrun's flag for the folder
            except Interrupted as stop:
                stop.outcome = (f"seed {seed}: {stop.outcome or 'stopped'}; to finish every seed, run the same "
                                "speedrun command again (it keeps the seeds that finished and goes on from here)")
                raise
        rows.append(seed_row(summary, args.target))
    if partners is None:
        return write(out_dir, rows, args.target, summary)
    dataset = data.load(args.data_dir, offline=args.offline, log=out.note)
    weight = 1.0 if args.blend_weight is None else args.blend_weight  # OUT2's, against this run's 1
    out.note(f"scoring each seed blended with {args.blend} (weight {weight})")
    rows = [blended_row(row, partners[row["seed"]], weight, dataset, args.target) for row in rows]
    partner_summary, partner_trained = partners[first_seed]
    return write(out_dir, rows, args.target, summary,
                 blend={"out": args.blend, "weight": weight, "model": partner_summary["model"],
                        "train_flops_per_run": run_flops(partner_summary, partner_trained.config.whiten)})


def run_flops(summary: dict, whiten: bool) -> int:
    """The training FLOPs of a finished run, from its summary and whether its first layer was whitened
    (frozen, so its weight gradient is not computed)."""
    return models.get(summary["model"]).run_flops_per_example(whiten) * summary["steps"] * summary["batch_size"]


def write(out_dir: Path, rows: list[dict], target: float, last_summary: dict, blend: dict | None = None) -> dict:
    """speedrun.json and its page. With a blend (its folder, weight, model and the partner's training
    FLOPs per run), each seed's training FLOPs include its partner's."""
    from fashionjax.report import plots, render

    model = models.get(last_summary["model"])
    config = rundir.read_config(Path(last_summary["run_dir"]))[0]["config"]
    document = {
        "model": model.name,
        "config": {name: value for name, value in config.items() if name != "seed"},
        "blend": blend,
        "per_seed": rows,
        **aggregate(rows, target),
        "train_flops_per_run": run_flops(last_summary, config["whiten"]) + (blend["train_flops_per_run"] if blend else 0),
        "tta": last_summary["tta"],
        "tta_shift": last_summary.get("tta_shift", 0),
        "cpu_model": environment.cpu_model(),
        "environment": environment.describe(),
        "charts": ["speedrun.png"],
    }
    title = model.name if blend is None else f"{model.name} blended with {blend['model']}"
    plots.strip([row["test_accuracy"] for row in rows], [row["seed"] for row in rows], target,
                f"{title}: test accuracy per seed", out_dir / "speedrun.png")
    artifacts.atomic_write_json(out_dir / SPEEDRUN_JSON, document)
    document["page"] = str(render.render_speedrun(out_dir))
    return document
