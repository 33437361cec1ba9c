"""Human output for the CLI: rich tables, the progress bar, and the one JSON document on stdout."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from fashionjax import artifacts, figures


def reopen_closed_std_fds() -> None:
    """Point a closed fd 0, 1 or 2 at /dev/null, so no file opened later can land on it (and
    receive output meant for a terminal)."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            os.open(os.devnull, os.O_RDWR)  # the lowest free fd: this one


def _write(stream, text: str) -> None:
    """Write and flush, surviving a closed or broken stream: output is never worth a run."""
    try:
        stream.write(text)
        stream.flush()
    except BrokenPipeError:
        _silence(stream)
    except (OSError, ValueError, AttributeError):  # closed, or None when the fd was closed at start
        pass


def _silence(stream) -> None:
    """After a broken pipe, send the stream to /dev/null so the interpreter's final flush is quiet."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, stream.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):
        pass


class _SafeStream:
    """A file-like view of sys.stdout/sys.stderr (looked up at each write) that never raises."""

    def __init__(self, name: str):
        self.name = name

    def write(self, text: str) -> int:
        _write(getattr(sys, self.name), text)
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        try:
            return getattr(sys, self.name).isatty()
        except (AttributeError, ValueError, OSError):
            return False

    def fileno(self) -> int:
        return getattr(sys, self.name).fileno()


class Output:
    """Human output to stdout (or stderr under --json); the JSON document alone on stdout.

    Every write survives a closed stream or a broken pipe: `fashionjax train | head` must not
    lose the run it is printing about.
    """

    def __init__(self, json_mode: bool = False, quiet: bool = False):
        from rich.console import Console

        self.json = json_mode
        self.quiet = quiet
        self.facts: dict = {}  # partial facts that a failure's JSON document carries
        stream = _SafeStream("stderr" if json_mode else "stdout")
        # Off a terminal rich assumes 80 columns; tables of figures need more than that.
        self.console = Console(file=stream, highlight=False, width=None if stream.isatty() else 160)
        self.errors = Console(file=_SafeStream("stderr"), highlight=False)
        self.json_fd = self._divert_stdout() if json_mode else None
        self._documented = False
        self.undelivered: str | None = None  # why the JSON document could not be written, if it could not

    @staticmethod
    def _divert_stdout() -> int | None:
        """Under --json, point fd 1 at stderr so native libraries (gloo, XLA) cannot print into the
        document; the document is written to a saved copy of the real stdout."""
        try:
            if sys.stdout.fileno() != 1:
                return None
        except (AttributeError, OSError, ValueError):
            return None  # not a real file (a test's capture): nothing native can reach it anyway
        _write(sys.stdout, "")
        saved = os.dup(1)
        os.dup2(2, 1)
        return saved

    def close(self) -> None:
        """Give fd 1 back to the real stdout (main() may be called again in the same process)."""
        if self.json_fd is not None:
            _write(sys.stdout, "")
            os.dup2(self.json_fd, 1)
            os.close(self.json_fd)
            self.json_fd = None

    def note(self, message: str) -> None:
        if not self.quiet:
            self.error(message)

    @staticmethod
    def error(message: str) -> None:
        """One plain line on stderr: never wrapped, never styled."""
        _write(sys.stderr, message + "\n")

    def show(self, renderable) -> None:
        if not self.quiet or not self.json:
            self.console.print(renderable)

    def fail(self, message: str, exit_code: int, kind: str) -> None:
        """A failure's answer: its one line on stderr and, under --json, its error document."""
        self.error(message)
        self.document({"error": {"message": message, "exit_code": exit_code, "kind": kind}, **self.facts})

    def document(self, document) -> None:
        """The one JSON document of the command (a second call is ignored: there is only one)."""
        if not self.json or self._documented:
            return
        self._documented = True
        text = artifacts.to_json(document)
        if self.json_fd is None:
            _write(sys.stdout, text)
            return
        try:
            data = text.encode()
            while data:
                data = data[os.write(self.json_fd, data):]
        except BrokenPipeError:
            pass  # the reader has gone: nobody is left to answer
        except OSError as err:  # a full disk: the caller turns a success into exit 1, naming this
            self.undelivered = err.strerror or str(err)


def table(title: str, headers, rows):
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for header in headers:
        table.add_column(str(header))
    for row in rows:
        table.add_row(*[str(cell) for cell in row])
    return table


def human_bytes(count) -> str:
    return "unknown" if count is None else f"{count / 2**30:.1f} GiB"


def show_summary(out: Output, summary: dict, run_dir: Path) -> None:
    rate = summary["train_examples_per_sec"]
    rows = [
        ("model", f"{summary['model']} ({summary['params']:,} params)"),
        ("steps / epochs", f"{summary['steps']} / {summary['epochs']}"),
        ("test accuracy", f"{figures.percent(summary['test_accuracy'])} of {summary['test_examples']:,}" + (
            f" ({figures.tta_name(summary)}; {figures.percent(summary['test_accuracy_no_tta'])} without)"
            if summary["tta"] else "")),
        ("test loss", f"{summary['test_loss']:.4f}"),
        ("final train loss", f"{summary['final_train_loss']:.4f}"),
        ("examples/sec (steady)", "n/a (one chunk)" if rate is None else figures.rate(rate)),
        ("compile seconds", figures.number(summary["compile_seconds"], 2)),
        ("train seconds", figures.number(summary["train_seconds"], 2)),
        ("wall seconds", figures.number(summary["wall_seconds"], 2)),
        ("devices", f"{summary['device_count']} x {summary['device_kind']} ({summary['backend']})"),
        ("params digest", summary["params_digest"][:16]),
        ("run directory", str(run_dir)),
    ]
    if summary.get("per_seed"):  # several models: each seed, the spread and the ensemble
        at = [name for name, _ in rows].index("test accuracy")
        rows[at:at + 1] = member_rows(summary)
        rows = [("model-examples/sec (steady)" if name.startswith("examples/sec") else name, value)
                for name, value in rows]
    out.show(table("training summary", ["", ""], rows))


def member_rows(summary: dict) -> list[tuple[str, str]]:
    """A multi-model run's accuracy rows: mean ± sample std over the named seeds, each seed, the ensemble."""
    std = summary["test_accuracy_std"]
    seeds = [row["seed"] for row in summary["per_seed"]]
    spread = f" ± {figures.points(std)}" if std is not None else ""
    over = f"over {len(seeds)} members" if summary.get("sweep") else f"seeds {seeds[0]}-{seeds[-1]}"
    rows = [("test accuracy", f"{figures.percent(summary['test_accuracy'])}{spread} (mean ± std, {over}"
                              + (f", {figures.tta_name(summary)})" if summary["tta"] else ")"))]
    if summary.get("sweep"):  # best first, each member named by its values
        names = [name for name in summary["sweep"][0] if name not in ("seed", "test_accuracy", "test_examples",
                                                                       "diverged")]
        ranked = sorted(summary["sweep"], key=lambda row: (row["diverged"], -row["test_accuracy"]))
        rows += [("  " + " ".join(f"{name}={row[name]:g}" for name in names) + f" seed {row['seed']}",
                  "diverged" if row["diverged"] else figures.percent(row["test_accuracy"])) for row in ranked]
    else:
        rows += [(f"  seed {row['seed']}", "diverged" if row["seed"] in summary["diverged_seeds"] else
                  figures.percent(row["test_accuracy"])) for row in summary["per_seed"]]
    rows.append((f"ensemble of {summary['ensemble_members']}", f"{figures.percent(summary['ensemble_test_accuracy'])} "
                                                                "(mean of the members' probabilities)"))
    return rows


class Progress:
    """Training progress on stderr: a live bar on a terminal, one plain line per log point elsewhere
    (CI logs, nohup files, notebooks); nothing under --quiet."""

    def __init__(self, out: Output, total_steps: int):
        self.out = out
        self.total = total_steps
        self.bar = None
        self.lines = not out.quiet and not out.errors.file.isatty()
        if not out.quiet and not self.lines:
            from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

            self.bar = Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                                TimeRemainingColumn(), console=out.errors)
            self.task = self.bar.add_task("training", total=self.total)

    def __enter__(self):
        if self.bar:
            self.bar.start()
        return self

    def update(self, record: dict) -> None:
        text = (f"epoch {record['epoch']:.2f} loss {record['loss']:.4f} accuracy {figures.percent(record['accuracy'], 1)} "
                f"{figures.rate(record['examples_per_sec'])} examples/sec")
        if self.bar:
            self.bar.update(self.task, completed=record["step"], description=text)
        elif self.lines:
            self.out.error(f"step {record['step']}/{self.total} {text} {figures.number(record['elapsed_s'], 1)}s")

    def close(self) -> None:
        if self.bar:
            self.bar.stop()
            self.bar = None

    def __exit__(self, *exc):
        self.close()
        return False


def show_bench(out: Output, document: dict) -> None:
    cases = document["cases"]
    best = max(c["examples_per_sec"]["median"] for c in cases)
    rows = []
    for c in cases:
        rate = c["examples_per_sec"]
        bar = "█" * max(1, round(30 * rate["median"] / best))
        mfu = "n/a" if c["mfu"] is None else figures.percent(c["mfu"], 1)
        rows.append((c["mode"], c["dtype"], c["batch_size"], figures.rate(rate['median']),
                     f"{figures.rate(rate['min'])}-{figures.rate(rate['max'])}", figures.number(c["compile_seconds"], 2),
                     f"{c['final_loss']:.4f}", figures.percent(c["final_accuracy"], 1), mfu,
                     figures.rate(c['tokens_per_sec']), bar))
    out.show(table(f"{document['model']} training throughput (peak: {document['peak']['source']})",
                    ["mode", "dtype", "batch", "ex/s median", "min-max", "compile s", "loss", "batch acc",
                     "MFU", "tokens/s (proj.)", ""], rows))
    out.show(table("device placement", ["object", "devices"],
                    [(p["object"], ", ".join(p["devices"])) for p in document["placement"]]))
    if document["scaling"]:
        s = document["scaling"]
        out.show(f"scaling: {figures.rate(s['examples_per_sec_1'])} ex/s on 1 device, "
                 f"{figures.rate(s['examples_per_sec_n'])} on "
                 f"{s['devices']} ({figures.rate(s['per_device_n'])} per device, efficiency {figures.percent(s['efficiency'], 1)})")
    if document.get("models_at_once"):
        out.show(table("models at once (fused float32, one program; 'separate' = the 1-model rate, which N runs "
                       "one after another share; lanes: programs run at once, one per core on a CPU)",
                       ["models", "lanes", "model-ex/s median", "min-max", "vs separate", "MFU", "compile s", "loss"],
                       [(row["members"], row["lanes"], figures.rate(row['model_examples_per_sec']['median']),
                         f"{figures.rate(row['model_examples_per_sec']['min'])}-{figures.rate(row['model_examples_per_sec']['max'])}",
                         "n/a" if row["speedup_over_separate"] is None else f"{row['speedup_over_separate']:.2f}x",
                         "n/a" if row.get("mfu") is None else figures.percent(row["mfu"], 2),
                         figures.number(row["compile_seconds"], 2), f"{row['final_loss']:.4f}")
                        for row in document["models_at_once"]]))
    for note in document["notes"]:
        out.show(f"note: {note}")


def show_speedrun(out: Output, document: dict) -> None:
    tta = document["tta"]
    rows = [(row["seed"], figures.percent(row["test_accuracy"]),
             *([figures.percent(row["test_accuracy_no_tta"])] if tta else []),
             figures.number(row["train_seconds"], 1), figures.number(row["compile_seconds"], 1),
             "yes" if row["reached_target"] else "no")
            for row in document["per_seed"]]
    columns = ["seed", "test accuracy", *(["without TTA"] if tta else []), "train s", "compile s", "reached"]
    blend = document["blend"]
    out.show(table(f"speedrun: {document['model']}" + (f" + {blend['model']}" if blend else ""), columns, rows))
    if blend:
        out.show(f"each seed blended with its run in {blend['out']} at weight {blend['weight']:g} against 1:")
        for row in document["per_seed"]:
            out.show(f"seed {row['seed']}: " + "; ".join(
                f"{part['model']} alone {figures.percent(part['test_accuracy'])} in "
                f"{figures.number(part['train_seconds'], 1)} s" for part in row["blend"]))
    median = document["median_seconds_to_target"]
    target = figures.percent(document["target"])
    def spread(std: float) -> str:  # one seed has none to show
        return f" ± {figures.points(std)}" if len(document["seeds"]) > 1 else ""

    out.show(f"mean {figures.percent(document['test_accuracy_mean'])}{spread(document['test_accuracy_std'])} over "
             f"seeds {', '.join(map(str, document['seeds']))}" + (
                 f" ({figures.tta_name(document)}; {figures.percent(document['test_accuracy_no_tta_mean'])}"
                 f"{spread(document['test_accuracy_no_tta_std'])} without)" if tta else ""))
    out.show(f"{figures.percent(document['reached_fraction'], 0)} of seeds reached {target}; median training time "
             "to it: " + ("not reached by half the seeds" if median is None else f"{figures.number(median, 1)} s")
             + f"; {figures.number(document['train_flops_per_run'] / 1e12, 2)} TFLOP of training per run; "
             f"{document['cpu_model']}")
    out.show(f"speedrun.json and page: {document['page']}")
