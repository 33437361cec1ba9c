"""The command line: the only argv parser. Each subcommand builds a config and calls the library.

Exit codes: 0 ok; 1 runtime failure (data, divergence, I/O); 2 bad usage or config (before any
file is written); 130/143 interrupted by SIGINT/SIGTERM after saving.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
import time
from pathlib import Path

from fashionjax import __version__, artifacts, console, data
from fashionjax.config import DTYPES, MODELS, OPTIMIZERS, SCHEDULES, ConfigError

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2


class UsageError(Exception):
    """Bad flags; reported in one line with exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not argparse's two-line usage dump
        raise UsageError(f"{self.prog}: {message}")


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print exactly one JSON document on stdout")
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    parser.add_argument("--quiet", action="store_true", help="no progress output")


def _data_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data-dir", help="directory with the four .gz files (no fallback if invalid)")
    parser.add_argument("--offline", action="store_true", default=None, help="never use the network")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="fashionjax", description="Train and evaluate Fashion-MNIST classifiers with JAX.")
    parser.add_argument("--version", action="version", version=f"fashionjax {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    doctor = sub.add_parser("doctor", help="versions, backend and devices")
    doctor.add_argument("--require-gpu", action="store_true", help="exit 1 when no GPU is visible")
    _common(doctor)

    data_cmd = sub.add_parser("data", help="obtain, verify and describe the dataset")
    data_cmd.add_argument("--out", default="runs/data", help="where samples.png goes (default runs/data)")
    _data_flags(data_cmd)
    _common(data_cmd)

    train_cmd = sub.add_parser("train", help="train a model, evaluate it, write a run directory")
    train_cmd.add_argument("--model", default="mlp", help=f"one of {', '.join(MODELS)} (default mlp)")
    length = train_cmd.add_mutually_exclusive_group()
    length.add_argument("--epochs", type=int, help="passes over the training set (default: recipe's)")
    length.add_argument("--steps", type=int, help="optimizer steps (instead of --epochs)")
    train_cmd.add_argument("--batch-size", type=int, help="global batch size (default 512)")
    train_cmd.add_argument("--optimizer", help=f"one of {', '.join(OPTIMIZERS)} (default adamw)")
    train_cmd.add_argument("--lr", type=float, help="peak learning rate (default 3e-3)")
    train_cmd.add_argument("--schedule", help=f"one of {', '.join(SCHEDULES)} (default cosine)")
    train_cmd.add_argument("--weight-decay", type=float, help="decoupled weight decay (default 1e-4)")
    train_cmd.add_argument("--clip-norm", type=float, help="clip gradients to this global norm")
    train_cmd.add_argument("--dtype", help=f"compute dtype: {', '.join(DTYPES)} (default float32)")
    train_cmd.add_argument("--augment", action=argparse.BooleanOptionalAction, default=None,
                           help="random flips and 2-pixel shifts (default: on for cnn, off for mlp)")
    train_cmd.add_argument("--seed", type=int, help="root of all randomness (default 0)")
    train_cmd.add_argument("--log-every", type=int, help="steps per compiled chunk and log point (25)")
    train_cmd.add_argument("--checkpoint-every", type=int, help="steps between checkpoints (an epoch)")
    train_cmd.add_argument("--keep", type=int, help="checkpoints to keep (default 3)")
    train_cmd.add_argument("--run-dir", help="output directory (default runs/<UTC time>-<model>)")
    train_cmd.add_argument("--overwrite", action="store_true", help="replace a non-empty run directory")
    train_cmd.add_argument("--resume", action="store_true", help="continue --run-dir from its latest checkpoint")
    train_cmd.add_argument("--devices", default="all", help="how many local devices to use, or 'all'")
    train_cmd.add_argument("--coordinator", help="HOST:PORT of process 0, for multi-process runs")
    train_cmd.add_argument("--num-processes", type=int, help="number of processes (multi-process)")
    train_cmd.add_argument("--process-id", type=int, help="this process's index (multi-process)")
    train_cmd.add_argument("--auto-distributed", action="store_true",
                           help="start jax.distributed from the cluster environment (SLURM, MPI, TPU pods)")
    _data_flags(train_cmd)
    _common(train_cmd)

    eval_cmd = sub.add_parser("eval", help="re-score a run's final parameters on all 10,000 test images")
    eval_cmd.add_argument("run_dir", help="a run directory written by `fashionjax train`")
    _data_flags(eval_cmd)
    _common(eval_cmd)

    bench_cmd = sub.add_parser("bench", help="measure training throughput honestly (modes, dtypes, batches, MFU)")
    bench_cmd.add_argument("--model", default="mlp", help="model to measure (default mlp)")
    bench_cmd.add_argument("--batch-sizes", help="comma-separated global batch sizes (default 128,512,2048,8192)")
    bench_cmd.add_argument("--dtypes", help="comma-separated compute dtypes (default float32,bfloat16)")
    bench_cmd.add_argument("--steps", type=int, help="timed steps per repeat (default 100)")
    bench_cmd.add_argument("--repeats", type=int, help="timed repeats per case (default 5)")
    bench_cmd.add_argument("--quick", action="store_true", help="a smaller sweep that ends within a minute")
    bench_cmd.add_argument("--devices", default="all", help="how many local devices to use, or 'all'")
    bench_cmd.add_argument("--out", help="output directory (default runs/bench-<UTC time>)")
    _data_flags(bench_cmd)
    _common(bench_cmd)

    report_cmd = sub.add_parser("report", help="write RUN_DIR/report.html from the run's saved files")
    report_cmd.add_argument("run_dir", help="a run directory written by `fashionjax train`")
    report_cmd.add_argument("--bench", help="a bench.json to include (default: RUN_DIR/bench.json if present)")
    _common(report_cmd)
    return parser


# ---------------------------------------------------------------- commands


def cmd_doctor(args, out: console.Output) -> int:
    from fashionjax import environment

    info = environment.describe(with_git=True)
    has_gpu = any(d["platform"] == "gpu" for d in info["devices"])
    info["gpu"] = has_gpu
    rows = [(k, info[k]) for k in ("python", "jax_version", "jaxlib_version", "optax_version",
                                   "fashionjax_version", "backend", "device_kind", "device_count",
                                   "process_count", "cpu_model", "cpu_cores", "matmul_precision")]
    out.show(console.table("fashionjax doctor", ["item", "value"], rows))
    out.show(console.table("devices", ["id", "platform", "kind", "memory"],
                    [(d["id"], d["platform"], d["kind"], console.human_bytes(d["memory_bytes"])) for d in info["devices"]]))
    out.document(info)
    if args.require_gpu and not has_gpu:
        out.error(f"fashionjax doctor: no GPU visible (backend is {info['backend']}); "
                         "install with the cuda extra: pip install 'fashionjax[cuda]'")
        return EXIT_FAILURE
    return EXIT_OK


def _load_data(args, out: console.Output) -> data.Dataset:
    return data.load(args.data_dir, offline=args.offline, log=out.note)


def cmd_data(args, out: console.Output) -> int:
    from fashionjax.report import plots

    dataset = _load_data(args, out)
    summary = data.summarize(dataset)
    out_dir = artifacts.ensure_dir(args.out)
    samples = plots.samples(dataset.train.images_u8, dataset.train.labels, dataset.class_names,
                            out_dir / "samples.png")
    summary["samples_png"] = str(samples)
    rows = [(name, f"{s['images']:,}", tuple(s["shape"]), f"{s['labels']:,}") for name, s in summary["splits"].items()]
    out.show(console.table("Fashion-MNIST", ["split", "images", "image shape", "labels"], rows))
    out.show(console.table("images per class", ["class", "train", "test"],
                    [(name, summary["splits"]["train"]["class_counts"][i], summary["splits"]["test"]["class_counts"][i])
                     for i, name in enumerate(dataset.class_names)]))
    source = dataset.source
    verified = sorted({f["verified_by"] for f in source.get("files", [])})
    out.show(f"source: {source.get('kind')} {source.get('path')} (verified by {', '.join(verified) or 'cached digests'})")
    out.show(f"samples: {samples}")
    out.document(summary)
    return EXIT_OK


def _train_config(args, num_examples: int | None):
    from fashionjax import config as config_lib

    base = config_lib.default(args.model)
    overrides = {
        "epochs": args.epochs, "steps": args.steps, "batch_size": args.batch_size, "optimizer": args.optimizer,
        "lr": args.lr, "schedule": args.schedule, "weight_decay": args.weight_decay, "clip_norm": args.clip_norm,
        "dtype": args.dtype, "augment": args.augment, "seed": args.seed, "log_every": args.log_every,
        "checkpoint_every": args.checkpoint_every, "keep": args.keep,
    }
    overrides = {k: v for k, v in overrides.items() if v is not None}
    if args.steps is not None:
        overrides["epochs"] = None
    return config_lib.validate(dataclasses.replace(base, **overrides), num_examples)


class SignalCatcher:
    """Turn the first SIGINT/SIGTERM into a request to stop at the next chunk end."""

    def __init__(self):
        self.signum = None
        self.previous = {}

    def __enter__(self):
        for signum in (signal.SIGINT, signal.SIGTERM):
            self.previous[signum] = signal.signal(signum, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.signum is not None:  # a second signal: stop now
            signal.signal(signum, self.previous[signum])
            os.kill(os.getpid(), signum)
        self.signum = signum

    def __exit__(self, *exc):
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)
        return False


def cmd_train(args, out: console.Output) -> int:
    from fashionjax import distributed
    from fashionjax import run as run_lib
    from fashionjax import train as train_lib

    _train_config(args, None)  # flag faults first: before loading data or touching any file
    if args.resume and not args.run_dir:
        raise ConfigError("--resume needs --run-dir")
    distributed.initialize(args.coordinator, args.num_processes, args.process_id, auto=args.auto_distributed)
    _enable_compile_cache()
    dataset = _load_data(args, out)
    config = _train_config(args, len(dataset.train.labels))
    mesh = distributed.make_mesh(args.devices)
    distributed.check_batch(config.batch_size, mesh)
    run_dir = Path(args.run_dir) if args.run_dir else run_lib.default_run_dir(config.model)
    if run_lib.is_writer():
        artifacts.prepare_run_dir(run_dir, overwrite=args.overwrite, resume=args.resume)
    progress = console.Progress(out, config, len(dataset.train.labels))
    with SignalCatcher() as catcher, progress:
        hooks = train_lib.Hooks(on_log=progress.update, stop_signal=lambda: catcher.signum, on_note=out.note)
        try:
            summary = run_lib.train_and_evaluate(config, dataset, run_dir, mesh, resume=args.resume, hooks=hooks)
        except train_lib.Interrupted as stop:
            progress.close()
            out.error(f"fashionjax train: interrupted at step {stop.step}, checkpoint saved; resume with: "
                             f"fashionjax train --resume --run-dir {run_dir}")
            return 128 + stop.signum
    if run_lib.is_writer():
        _render_report(run_dir, out)
    console.show_summary(out, summary, run_dir)
    out.document(dict(summary, run_dir=str(run_dir)))
    return EXIT_OK


def _render_report(run_dir: Path, out: console.Output) -> Path:
    from fashionjax.report import render

    path = render.render(run_dir)
    out.note(f"report: {path}")
    return path


def cmd_report(args, out: console.Output) -> int:
    from fashionjax.report import render

    run_dir = Path(args.run_dir)
    if not (run_dir / "config.json").is_file():
        raise ConfigError(f"{run_dir}: not a run directory (no config.json)")
    if args.bench and not Path(args.bench).is_file():
        raise ConfigError(f"{args.bench}: no such bench.json")
    path = render.render(run_dir, args.bench)
    out.show(f"report: {path}")
    out.document({"report": str(path)})
    return EXIT_OK


def cmd_eval(args, out: console.Output) -> int:
    from fashionjax import distributed
    from fashionjax import run as run_lib

    run_dir = Path(args.run_dir)
    if not (run_dir / "config.json").is_file():
        raise ConfigError(f"{run_dir}: not a run directory (no config.json)")
    _enable_compile_cache()
    dataset = _load_data(args, out)
    scored = run_lib.rescore(run_dir, dataset, distributed.make_mesh("all"))
    report = scored["report"]
    out.show(console.table(f"evaluation of {run_dir}", ["", ""], [
        ("test accuracy", f"{100 * report['accuracy']:.2f}% ({report['correct']:,} of {report['examples']:,})"),
        ("test loss", f"{report['loss']:.4f}"), ("checkpoint step", report["step"]),
        ("params digest", report["params_digest"][:16])]))
    out.document(report)
    return EXIT_OK


def _csv(text: str | None, cast, flag: str):
    if text is None:
        return None
    try:
        return tuple(cast(item) for item in text.split(",") if item.strip())
    except ValueError:
        raise ConfigError(f"{flag}: expected a comma-separated list, got {text!r}") from None


def cmd_bench(args, out: console.Output) -> int:
    from fashionjax import bench, distributed

    base = bench.quick() if args.quick else bench.BenchConfig()
    overrides = {"model": args.model, "batch_sizes": _csv(args.batch_sizes, int, "--batch-sizes"),
                 "dtypes": _csv(args.dtypes, str, "--dtypes"), "steps": args.steps, "repeats": args.repeats}
    config = dataclasses.replace(base, **{k: v for k, v in overrides.items() if v is not None})
    if config.compare_batch not in config.batch_sizes:
        config = dataclasses.replace(config, compare_batch=config.batch_sizes[0])
    bench.validate(config, 60000)  # flag faults before loading anything
    out_dir = artifacts.ensure_dir(args.out or Path("runs") / f"bench-{artifacts.utc_stamp()}")
    _enable_compile_cache()
    dataset = _load_data(args, out)
    document = bench.run(config, dataset.train.images_u8, dataset.train.labels,
                         distributed.make_mesh(args.devices), log=out.note)
    document = bench.write(document, out_dir)
    console.show_bench(out, document)
    out.show(f"bench.json and charts: {out_dir}")
    out.document(document)
    return EXIT_OK


def _enable_compile_cache() -> None:
    """A persistent XLA cache under the user cache dir: later runs skip most compiling."""
    if os.environ.get("FASHIONJAX_NO_COMPILE_CACHE"):
        return
    import jax

    jax.config.update("jax_compilation_cache_dir", str(data.cache_root() / "xla-cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


COMMANDS = {"doctor": cmd_doctor, "data": cmd_data, "train": cmd_train, "eval": cmd_eval,
            "bench": cmd_bench, "report": cmd_report}


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand; returns the exit code."""
    argv = sys.argv[1:] if argv is None else argv
    debug = "--debug" in argv
    try:
        args = build_parser().parse_args(argv)
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USAGE
    out = console.Output(args)
    started = time.perf_counter()
    try:
        return COMMANDS[args.command](args, out)
    except KeyboardInterrupt:
        out.error(f"fashionjax {args.command}: interrupted")
        return 130
    except Exception as err:
        if debug:
            raise
        lines = str(err).strip().splitlines() or [type(err).__name__]
        more = " (--debug shows the rest)" if len(lines) > 1 else ""
        out.error(f"fashionjax {args.command}: {lines[0]}{more}")
        return exit_code(err)
    finally:
        out.close()
        if debug:
            out.error(f"[{time.perf_counter() - started:.2f}s]")


def exit_code(err: Exception) -> int:
    """2 for usage and config faults, 1 for everything that went wrong at run time."""
    if isinstance(err, ConfigError | UsageError):
        return EXIT_USAGE
    return EXIT_FAILURE


if __name__ == "__main__":
    sys.exit(main())
