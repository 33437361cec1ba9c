"""The command line: the only argv parser. Each subcommand builds a config and calls the library.

Exit codes: 0 ok; 1 runtime failure (data, divergence, I/O, a busy run directory); 2 bad usage or
config (before any file is written); 130/143 interrupted by SIGINT/SIGTERM.

This module imports nothing heavy at the top: main() installs the signal handlers first, so a
Ctrl-C while NumPy and JAX load still ends the command cleanly.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import os
import signal
import sys
import time
from pathlib import Path

from fashionjax import __version__, read_commands, rendezvous
from fashionjax.config import MODELS, ConfigError, TrainConfig, require_sweepable
from fashionjax.exits import EXIT_FAILURE, EXIT_OK, EXIT_USAGE
from fashionjax.signals import STOP_SIGNALS, Interrupted, StopRequests, interruption


class UsageError(Exception):
    """Bad flags; reported in one line with exit code 2, after the name of the (sub)command that refused them."""

    def __init__(self, message: str, command: str):
        super().__init__(message)
        self.command = command


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):  # flags in full: --epoch is not --epochs, and new flags break no command
        super().__init__(*args, allow_abbrev=False, **kwargs)

    def error(self, message):  # one line, not argparse's two-line usage dump
        raise UsageError(message, self.prog)

    def parse_args(self, args=None, namespace=None):
        # argparse reports a subcommand's unknown flags from the top-level parser; name the subcommand
        parsed, unknown = self.parse_known_args(args, namespace)
        if unknown:
            command = getattr(parsed, "command", None)
            raise UsageError(f"unrecognized arguments: {' '.join(unknown)}",
                             f"{self.prog} {command}" if command else self.prog)
        return parsed


def _devices(text: str) -> str | int:
    if text == "all":
        return text
    try:
        count = int(text)
    except ValueError:
        count = 0
    if count < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer or 'all', got {text!r}")
    return count


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print exactly one JSON document on stdout")
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    parser.add_argument("--quiet", action="store_true", help="no progress output")


def _member_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--member", type=int, metavar="K",
                        help="only model K of a multi-model run (--seeds, --sweep), counted from 0 in the order of "
                             "summary.json's per_seed (default: all of them, as one ensemble)")


def _data_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data-dir", help="directory with the four .gz files (no fallback if invalid)")
    parser.add_argument("--offline", action="store_true", default=None, help="never use the network")


def _recipe_model(argv: list[str]) -> str:
    """The --model named on the command line (so --help can show that model's recipe defaults)."""
    for i, arg in enumerate(argv):
        value = arg.split("=", 1)[1] if arg.startswith("--model=") else (
            argv[i + 1] if arg == "--model" and i + 1 < len(argv) else None)
        if value in MODELS:
            return value
    return "mlp"


def _config_flags(parser: argparse.ArgumentParser, recipe: TrainConfig, skip: tuple[str, ...] = ()) -> None:
    """One flag per TrainConfig field that carries help metadata; defaults shown are the recipe's."""
    length = parser.add_mutually_exclusive_group()
    for field in dataclasses.fields(TrainConfig):
        if "help" not in field.metadata or field.name in skip:
            continue
        flag = "--" + field.name.replace("_", "-")
        default = getattr(recipe, field.name)
        text = f"{field.metadata['help']} (default: {'unset' if default is None else default})"
        target = length if field.metadata.get("group") == "length" else parser
        if field.type == "bool":
            target.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=text)
        else:
            kind = int if field.type.startswith("int") else float if field.type.startswith("float") else str
            target.add_argument(flag, type=kind, help=text)


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    from fashionjax import config as config_lib

    parser = _Parser(prog="fashionjax", description="Train and evaluate Fashion-MNIST classifiers with JAX.")
    parser.add_argument("--version", action="version", version=f"fashionjax {__version__}")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)  # a missing one: _run says which exist

    doctor = sub.add_parser("doctor", help="versions, backend and devices")
    doctor.add_argument("--require-gpu", action="store_true", help="exit 1 when no GPU is visible")
    _common(doctor)

    data_cmd = sub.add_parser("data", help="obtain, verify and describe the dataset")
    data_cmd.add_argument("--out", default="runs/data", help="where samples.png goes (default runs/data)")
    _data_flags(data_cmd)
    _common(data_cmd)

    model = _recipe_model(argv or [])
    train_cmd = sub.add_parser(
        "train", help="train a model, evaluate it, write a run directory",
        epilog=f"Defaults shown are the {model} recipe's; `fashionjax train --model NAME --help` shows another "
               "model's. With --resume, every setting comes from the saved run; only the length and the "
               "cadences may be given.")
    _config_flags(train_cmd, config_lib.default(model))
    train_cmd.add_argument("--sweep", action="append", metavar="NAME=V1,V2,...",
                           help="train one model per value (repeat for a grid; with --seeds, every seed at every "
                                "point) in one program: NAME is lr, weight-decay or momentum")
    train_cmd.add_argument("--run-dir", help="output directory (default runs/<UTC time>-<model>-<suffix>)")
    train_cmd.add_argument("--overwrite", action="store_true",
                           help="replace the fashionjax run in --run-dir (never deletes other files)")
    train_cmd.add_argument("--resume", action="store_true", help="continue --run-dir from its newest checkpoint")
    train_cmd.add_argument("--devices", type=_devices, default="all", help="how many local devices to use, or 'all'")
    train_cmd.add_argument("--coordinator", help="HOST:PORT of process 0, for multi-process runs")
    train_cmd.add_argument("--num-processes", type=int, help="number of processes (multi-process)")
    train_cmd.add_argument("--process-id", type=int, help="this process's index (multi-process)")
    train_cmd.add_argument("--coordinator-timeout", type=float, default=60.0,
                           help="seconds to wait for the coordinator and the other processes (default 60)")
    train_cmd.add_argument("--auto-distributed", action="store_true",
                           help="start jax.distributed from the cluster environment (SLURM, MPI, TPU pods)")
    _data_flags(train_cmd)
    _common(train_cmd)

    eval_cmd = sub.add_parser("eval", help="re-score a run's newest checkpoint on all 10,000 test images")
    eval_cmd.add_argument("run_dir", help="a run directory written by `fashionjax train` (may still be training)")
    _member_flag(eval_cmd)
    _data_flags(eval_cmd)
    _common(eval_cmd)

    bench_cmd = sub.add_parser("bench", help="measure training throughput honestly (modes, dtypes, batches, MFU)")
    bench_cmd.add_argument("--model", default="mlp", help=f"model to measure: {', '.join(MODELS)} (default mlp)")
    bench_cmd.add_argument("--batch-sizes", help="comma-separated global batch sizes (default 128,512,2048,8192)")
    bench_cmd.add_argument("--dtypes", help="comma-separated compute dtypes (default float32,bfloat16)")
    bench_cmd.add_argument("--steps", type=int, help="timed steps per repeat (default 100)")
    bench_cmd.add_argument("--repeats", type=int, help="timed repeats per case (default 5)")
    bench_cmd.add_argument("--members", help="comma-separated model counts trained at once "
                                             "(default 1,2,4,8; on a GPU also 16,32,64)")
    bench_cmd.add_argument("--modes", help="comma-separated ways to run the step: eager, jit-step, fused (default all)")
    bench_cmd.add_argument("--quick", action="store_true", help="a smaller sweep that ends within a minute")
    bench_cmd.add_argument("--devices", type=_devices, default="all", help="how many local devices to use, or 'all'")
    bench_cmd.add_argument("--out", help="output directory (default runs/bench-<UTC time>)")
    _data_flags(bench_cmd)
    _common(bench_cmd)

    speedrun_model = model if "--model" in " ".join(argv or []) else "speedrun"
    speedrun_cmd = sub.add_parser(
        "speedrun", help="the time-to-accuracy record: one recipe over N seeds, each reported",
        epilog="Each seed trains in OUT/seed-S like `fashionjax train`; running the same command again keeps "
               "the seeds that finished, resumes the interrupted ones and starts again one stopped before its "
               "first checkpoint. A seed of another recipe is refused.")
    speedrun_cmd.add_argument("--seeds", type=int, default=5, help="how many seeds, from --seed on (default 5)")
    speedrun_cmd.add_argument("--target", type=float, default=0.94,
                              help="test accuracy a seed must reach (default 0.94)")
    speedrun_cmd.add_argument("--out", help="output directory (default runs/speedrun-<UTC time>)")
    speedrun_cmd.add_argument("--blend", metavar="OUT2",
                              help="score each seed together with OUT2's run of the same seed (another speedrun's "
                                   "output): the mean of their probabilities, and both runs' training time")
    speedrun_cmd.add_argument("--blend-weight", type=float,
                              help="--blend: the weight of OUT2's probabilities against this run's 1 (default 1)")
    _config_flags(speedrun_cmd, config_lib.default(speedrun_model), skip=("seeds",))  # its own --seeds: one run each
    speedrun_cmd.add_argument("--devices", type=_devices, default="all", help="how many local devices to use, or 'all'")
    _data_flags(speedrun_cmd)
    _common(speedrun_cmd)

    predict_cmd = sub.add_parser(
        "predict", help="classify your own images (PNG, JPEG, ...) with a trained run",
        epilog="Each picture is made to look like Fashion-MNIST first: grayscale, inverted when its background "
               "is light, trimmed to the object, scaled to 28 px on its longest edge and centred.")
    predict_cmd.add_argument("run_dir", help="a run directory written by `fashionjax train`")
    predict_cmd.add_argument("paths", nargs="+", metavar="PATH", help="image files, or folders of them")
    predict_cmd.add_argument("--top-k", type=int, default=3, help="classes listed per image (default 3)")
    _member_flag(predict_cmd)
    predict_cmd.add_argument("--save-preprocessed", metavar="FILE",
                             help="write a PNG grid of what the model saw, with its predictions")
    _common(predict_cmd)

    export_cmd = sub.add_parser(
        "export", help="write a run's model as ONNX, StableHLO or safetensors (checked against JAX)",
        epilog="ONNX and StableHLO take images (batch, 28, 28) float32 in [0, 1] and return logits (batch, 10); "
               "both are checked on all 10,000 test images after writing. Needs pip install 'fashionjax[export]' "
               "for onnx and safetensors.")
    export_cmd.add_argument("run_dir", help="a run directory written by `fashionjax train`")
    export_cmd.add_argument("--format", default="all", help="onnx, stablehlo, safetensors or all (default all)")
    export_cmd.add_argument("--out", required=True, help="output directory")
    _member_flag(export_cmd)
    _data_flags(export_cmd)
    _common(export_cmd)

    report_cmd = sub.add_parser("report", help="write report.html from a run's saved files")
    report_cmd.add_argument("run_dir", help="a run directory written by `fashionjax train`")
    report_cmd.add_argument("--bench", help="a bench.json to include (default: RUN_DIR/bench.json if present)")
    report_cmd.add_argument("--out", help="write the report here instead of RUN_DIR/report.html "
                                          "(needed while the run is still training)")
    _common(report_cmd)
    return parser


# ---------------------------------------------------------------- commands


def cmd_doctor(args, out) -> int:
    from fashionjax import console, environment

    info = environment.describe(with_git=True)
    has_gpu = any(d["platform"] == "gpu" for d in info["devices"])
    info["gpu"] = has_gpu
    rows = [(k, info[k]) for k in ("python", "jax_version", "jaxlib_version", "optax_version",
                                   "fashionjax_version", "backend", "device_kind", "device_count",
                                   "process_count", "cpu_model", "cpu_cores", "cpu_amx", "matmul_precision")]
    out.show(console.table("fashionjax doctor", ["item", "value"], rows))
    out.show(console.table("devices", ["id", "platform", "kind", "memory"],
                           [(d["id"], d["platform"], d["kind"], console.human_bytes(d["memory_bytes"]))
                            for d in info["devices"]]))
    if args.require_gpu and not has_gpu:
        raise RuntimeError(f"no GPU visible (backend is {info['backend']}); install with the cuda extra: "
                           "pip install 'fashionjax[cuda]'")
    out.document(info)
    return EXIT_OK


def cmd_data(args, out) -> int:
    from fashionjax import console, data, rundir
    from fashionjax.report import plots

    dataset = read_commands.load_data(args, out)
    summary = data.summarize(dataset)
    out_dir = rundir.ensure_out_dir(args.out)
    samples = plots.samples(dataset.train.images_u8, dataset.train.labels, dataset.class_names,
                            out_dir / "samples.png")
    summary["samples_png"] = str(samples)
    rows = [(name, f"{s['images']:,}", tuple(s["shape"]), f"{s['labels']:,}") for name, s in summary["splits"].items()]
    out.show(console.table("Fashion-MNIST", ["split", "images", "image shape", "labels"], rows))
    out.show(console.table("images per class", ["class", "train", "test"],
                           [(name, summary["splits"]["train"]["class_counts"][i],
                             summary["splits"]["test"]["class_counts"][i])
                            for i, name in enumerate(dataset.class_names)]))
    source = dataset.source
    verified = sorted({f["verified_by"] for f in source.get("files", [])})
    out.show(f"source: {source.get('kind')} {source.get('path')} (verified by {', '.join(verified) or 'cached digests'})")
    out.show(f"samples: {samples}")
    out.document(summary)
    return EXIT_OK


def cmd_train(args, out, stops: StopRequests) -> int:
    from fashionjax import console, train_command

    explicit = _explicit_config(args)
    if args.sweep:
        explicit["sweep"] = tuple(_sweep(text) for text in args.sweep)
    summary = train_command.run(args, explicit, out, stops)
    console.show_summary(out, summary, Path(summary["run_dir"]))
    out.document(summary)
    return EXIT_OK


def _sweep(text: str) -> tuple[str, tuple[float, ...]]:
    """NAME=V1,V2,... -> (config field name, values)."""
    name, _, values = text.partition("=")
    name = name.strip().lstrip("-").replace("-", "_")
    if not name or not values:
        raise ConfigError(f"--sweep: expected NAME=V1,V2,..., got {text!r}")
    require_sweepable(name)  # before its values are read as numbers: `--sweep model=mlp,cnn`
    return name, _csv(values, float, f"--sweep {name.replace('_', '-')}")


def _explicit_config(args, skip: tuple[str, ...] = ()) -> dict:
    """The TrainConfig fields given on the command line."""
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)
            if "help" in f.metadata and f.name not in skip and getattr(args, f.name) is not None}


def cmd_speedrun(args, out, stops: StopRequests) -> int:
    from fashionjax import config as config_lib
    from fashionjax import console, speedrun, train_command

    explicit = {"model": "speedrun", **_explicit_config(args, skip=("seeds",))}  # its --seeds: separate runs
    config = config_lib.validate(train_command.fresh_config(explicit))
    if args.seeds < 1 or config.seed + args.seeds - 1 > config_lib.MAX_SEED:
        raise ConfigError(f"--seeds must be at least 1 and end at seed {config_lib.MAX_SEED} or below, got {args.seeds}")
    if not 0 < args.target <= 1:
        raise ConfigError(f"--target is a fraction of the test set in (0, 1], got {args.target}")
    if args.blend_weight is not None:
        if not args.blend:
            raise ConfigError("--blend-weight weighs the runs of --blend: add --blend OUT2")
        if not (math.isfinite(args.blend_weight) and args.blend_weight > 0):
            raise ConfigError(f"--blend-weight must be a positive finite number, got {args.blend_weight}")
    document = speedrun.run(args, explicit, out, stops, train_command.run)
    console.show_speedrun(out, document)
    out.document(document)
    return EXIT_OK


def _csv(text: str | None, cast, flag: str):
    if text is None:
        return None
    items = [item.strip() for item in text.split(",")]
    try:
        values = tuple(cast(item) for item in items)
    except ValueError:
        values = ()
    if not values or any(item == "" for item in items):
        raise ConfigError(f"{flag}: expected a comma-separated list, got {text!r}")
    return values


def cmd_bench(args, out) -> int:
    from fashionjax import artifacts, bench, console, distributed, environment, rundir

    base = bench.quick() if args.quick else bench.BenchConfig()
    overrides = {"model": args.model, "batch_sizes": _csv(args.batch_sizes, int, "--batch-sizes"),
                 "dtypes": _csv(args.dtypes, str, "--dtypes"), "steps": args.steps, "repeats": args.repeats,
                 "members": _csv(args.members, int, "--members"), "modes": _csv(args.modes, str, "--modes")}
    config = dataclasses.replace(base, **{k: v for k, v in overrides.items() if v is not None})
    if config.compare_batch not in config.batch_sizes:
        config = dataclasses.replace(config, compare_batch=config.batch_sizes[0])
    mesh = distributed.make_mesh(args.devices)
    bench.validate(config, 60000, int(mesh.devices.size))  # flag faults before anything is written
    environment.enable_compile_cache()
    dataset = read_commands.load_data(args, out)
    with rundir.writing_into(args.out or Path("runs") / f"bench-{artifacts.utc_stamp()}", "bench") as out_dir:
        document = bench.run(config, dataset.train.images_u8, dataset.train.labels, mesh, log=out.note)
        document = bench.write(document, out_dir)
    console.show_bench(out, document)
    out.show(f"bench.json and charts: {out_dir}")
    out.document(document)
    return EXIT_OK


COMMANDS = {"doctor": cmd_doctor, "data": cmd_data, "train": cmd_train, "eval": read_commands.cmd_eval,
            "bench": cmd_bench, "report": read_commands.cmd_report, "speedrun": cmd_speedrun,
            "predict": read_commands.cmd_predict, "export": read_commands.cmd_export}
NEEDS_SIGNALS = (cmd_train, cmd_speedrun)  # commands that defer signals to a chunk end

# What kind of failure each exception is, for `{"error": {"kind": ...}}`; checked in order.
ERROR_KINDS = (("ConfigError", "usage"), ("UsageError", "usage"), ("RunDirBusy", "busy"),
               ("ResumeError", "resume"), ("CheckpointError", "checkpoint"), ("DataError", "data"),
               ("Diverged", "diverged"), ("ArtifactError", "file"), ("ExportError", "export"),
               ("MissingExtra", "missing_extra"), ("Interrupted", "interrupted"),
               ("OSError", "io"))


def error_kind(err: BaseException) -> str:
    names = {cls.__name__ for cls in type(err).__mro__}
    return next((kind for name, kind in ERROR_KINDS if name in names), "runtime")


def exit_code(err: BaseException) -> int:
    """2 for usage and config faults, 128+N for signal N, 1 for everything else."""
    if isinstance(err, Interrupted):
        return 128 + err.signum
    return EXIT_USAGE if error_kind(err) == "usage" else EXIT_FAILURE


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand; returns the exit code."""
    stops = StopRequests().install()  # first of all: a Ctrl-C from here on ends cleanly
    try:
        from fashionjax import console

        argv = sys.argv[1:] if argv is None else argv
        console.reopen_closed_std_fds()
        out = console.Output(json_mode="--json" in argv, quiet="--quiet" in argv)
        stops.note = out.note
        return _run(argv, out, stops)
    except Exception as err:  # a signal before the output existed: nothing to say it with
        stop = interruption(err)
        if stop is None:
            raise
        return exit_code(stop)
    finally:
        rendezvous.leave()  # the other processes of a multi-process run: this one left by a Python path
        stops.restore()


def _run(argv: list[str], out, stops: StopRequests) -> int:
    debug = "--debug" in argv
    started = time.perf_counter()
    command = "fashionjax"
    try:
        args = build_parser(argv).parse_args(argv)
        if args.command is None:
            raise UsageError(f"no command given; choose one of {', '.join(COMMANDS)} (--help says what each does)",
                             command)
        command = f"fashionjax {args.command}"
        handler = COMMANDS[args.command]
        return _delivered(out, command, handler(args, out, stops) if handler in NEEDS_SIGNALS else handler(args, out))
    except SystemExit as done:  # --help and --version: argparse printed them
        return int(done.code or 0)
    except Exception as raised:
        err = interruption(raised) or raised
        if debug and not isinstance(err, Interrupted | UsageError):
            raise
        lines = str(err).strip().splitlines() or [type(err).__name__]
        more = " (--debug shows the rest)" if len(lines) > 1 else ""
        message = f"{err.command if isinstance(err, UsageError) else command}: {lines[0]}{more}"
        code = exit_code(err)
        if not isinstance(err, Interrupted):  # a failure, and a stop the others did not agree on, is news to them
            rendezvous.leave(failure=lines[0])
        elif not err.agreed:
            rendezvous.leave(stopped_by=signal.Signals(err.signum).name)
        out.fail(message, code, error_kind(err))
        return code
    finally:
        out.close()
        if debug:
            out.error(f"[{time.perf_counter() - started:.2f}s]")


def _delivered(out, command: str, code: int) -> int:
    """A --json success whose document could not be written (a full disk) fails: a script reading it would
    otherwise find nothing under exit 0. The work itself is done and kept."""
    if out.undelivered is None or code != EXIT_OK:
        return code
    out.error(f"{command}: the JSON document could not be written to stdout ({out.undelivered}); the work "
              "itself is done")
    return EXIT_FAILURE


def run() -> None:
    """The `fashionjax` program: main(), then exit with its code. After a signal it leaves without
    Python's finalization: a signal during start-up can stop an import (JAX's) halfway with native
    threads running, and finalizing around them can abort the process (seen once in 40 SIGTERMs:
    "PyThreadState_Get: ... the GIL is released", exit -6). By then every file is written and closed
    (checkpoints are synchronous), so only the output streams need flushing. A process that failed
    in a multi-process run leaves the same way: JAX's shutdown would wait for the processes it has
    just told to stop, and abort from C++ when they leave; process 0 of such a run first outlives the
    others (rendezvous.outlive_the_others)."""
    code = main()
    if code in {128 + signum for signum in STOP_SIGNALS} or rendezvous.failed_in_a_run:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):  # a closed or broken stream has nothing left to lose
                stream.flush()
        rendezvous.outlive_the_others()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    run()
