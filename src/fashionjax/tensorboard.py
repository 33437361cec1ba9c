"""TensorBoard event files that mirror metrics.jsonl (tensorboardX, the optional `tb` extra).

`train --tensorboard` writes RUN_DIR/tensorboard/: one scalar per metrics.jsonl field per log point
(under train/), the test metrics and the hyperparameters at the end. A resumed run drops the event
files it wrote and writes them again from metrics.jsonl (itself cut back to the checkpoint), so the
events never hold a log point twice and always equal metrics.jsonl.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from fashionjax import environment

DIRECTORY = "tensorboard"
SCALARS = ("loss", "accuracy", "grad_norm", "lr", "examples_per_sec")  # per log point, as train/<name>
FINAL = {"test/accuracy": "test_accuracy", "test/accuracy_no_tta": "test_accuracy_no_tta", "test/loss": "test_loss",
         "run/train_seconds": "train_seconds", "run/train_examples_per_sec": "train_examples_per_sec"}  # tag: summary key
EVENT_PREFIX = "events.out.tfevents."


def require() -> None:
    environment.require_extra("tb", ("tensorboardX",), "--tensorboard")


class Events:
    """The event writer of one run directory (process 0 only)."""

    def __init__(self, folder: Path, part: str):
        """`part` names the file: tensorboardX names it by the second it opened (and the host), so the
        training's writer and the final one, opened within a second of each other on a short run,
        would write one file and the second would truncate the first."""
        from tensorboardX import SummaryWriter

        folder.mkdir(parents=True, exist_ok=True)
        self.writer = SummaryWriter(str(folder), flush_secs=10, filename_suffix=f".{part}")

    @classmethod
    def restart(cls, folder: Path, records: list[dict]) -> Events:
        """A writer for a training that starts or resumes: the events so far are exactly `records`."""
        for old in folder.glob(EVENT_PREFIX + "*"):  # ours: written again below from metrics.jsonl
            old.unlink()
        events = cls(folder, "train")
        for record in records:
            events.log(record)
        return events

    def log(self, record: dict) -> None:
        for name in SCALARS:
            if record.get(name) is not None:
                self.writer.add_scalar(f"train/{name}", record[name], record["step"])
        self.writer.flush()  # a log point is seconds apart: let TensorBoard show it now

    def finish(self, config, summary: dict) -> None:
        """The test metrics (at the last step) and the run's hyperparameters."""
        from tensorboardX.summary import hparams

        metrics = {tag: summary[key] for tag, key in FINAL.items() if summary.get(key) is not None}
        for tag, value in metrics.items():
            self.writer.add_scalar(tag, value, summary["steps"])
        hyper = {name: value for name, value in dataclasses.asdict(config).items()
                 if isinstance(value, int | float | str | bool)}
        for event in hparams(hyper, metrics):
            self.writer.file_writer.add_summary(event)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
