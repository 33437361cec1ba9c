"""Never lose a run: real processes, real signals, bounded in time."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fashionjax import artifacts, checkpoint, cli

pytestmark = pytest.mark.slow

# Batch 1024: an epoch is 58 steps, so the default checkpoints (once an epoch) land at the chunk
# ends 60 and 120, and at the end, 160.
RUN = ["--steps", "160", "--batch-size", "1024", "--log-every", "10", "--offline"]


def start(run_dir: Path, *extra: str, env=None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "fashionjax", "train", *RUN, "--run-dir", str(run_dir), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})


def finish(process: subprocess.Popen, timeout: float = 240) -> tuple[int, str, str]:
    out, err = process.communicate(timeout=timeout)
    return process.returncode, out, err


def wait_for(predicate, process: subprocess.Popen, timeout: float = 120, poll: float = 0.002) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if process.poll() is not None:
            raise AssertionError(f"process ended first: {process.communicate()[1][-2000:]}")
        if time.monotonic() > deadline:
            process.kill()
            raise AssertionError("timed out waiting")
        time.sleep(poll)


def steps_of(run_dir: Path) -> list[int]:
    return [r["step"] for r in artifacts.read_jsonl(run_dir / "metrics.jsonl")]


@pytest.fixture(scope="module")
def reference(real_dataset, tmp_path_factory):
    """The uninterrupted run every interrupted one must match bit for bit."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    code, out, err = finish(start(run_dir, "--json"))
    assert code == 0, err
    return {"digest": json.loads(out)["params_digest"], "steps": steps_of(run_dir)}


def resume(run_dir: Path) -> dict:
    code, out, err = finish(start(run_dir, "--resume", "--json"))
    assert code == 0, err
    return json.loads(out)


def finalized(run_dir: Path, step: int):
    return lambda: (run_dir / "checkpoints" / str(step)).is_dir()


def writing(run_dir: Path):
    def check():
        directory = run_dir / "checkpoints"
        return directory.is_dir() and any("tmp" in p.name for p in directory.iterdir())
    return check


@pytest.mark.parametrize("kill_point", ["mid-training", "mid-checkpoint-write", "epoch-boundary"])
def test_sigkill_then_resume_is_bit_identical(kill_point, reference, tmp_path):
    run_dir = tmp_path / "run"
    process = start(run_dir)
    if kill_point == "mid-training":
        wait_for(lambda: finalized(run_dir, 60)() and max(steps_of(run_dir)) >= 80, process)
    elif kill_point == "mid-checkpoint-write":  # the write of step 120, after 60 is safely down
        wait_for(finalized(run_dir, 60), process)
        wait_for(writing(run_dir), process, poll=0.0005)
    else:
        wait_for(finalized(run_dir, 60), process, poll=0.0005)
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=30)
    if kill_point == "mid-checkpoint-write":
        # The half-written one never counts (120 only if its rename won the race with the kill).
        assert checkpoint.read_meta(run_dir / "checkpoints")["step"] in (60, 120)
    summary = resume(run_dir)
    assert summary["params_digest"] == reference["digest"]
    assert steps_of(run_dir) == reference["steps"]  # no duplicated or missing log points


@pytest.mark.parametrize("signum,exit_code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_saves_exits_and_resumes(signum, exit_code, reference, tmp_path):
    run_dir = tmp_path / "run"
    process = start(run_dir)
    wait_for(lambda: len(steps_of(run_dir)) >= 2, process)
    process.send_signal(signum)
    code, _, err = finish(process)
    assert code == exit_code, err
    assert "fashionjax train --resume --run-dir" in err
    assert checkpoint.read_meta(run_dir / "checkpoints")["step"] >= 20
    assert resume(run_dir)["params_digest"] == reference["digest"]


def test_resume_refusals(reference, tmp_path, real_dataset):
    run_dir = tmp_path / "run"
    code, _, err = finish(start(run_dir, "--resume"))
    assert code == 1 and "no finalized checkpoint" in err and not (run_dir / "summary.json").exists()
    process = start(run_dir)
    wait_for(finalized(run_dir, 60), process)
    process.kill()
    process.wait(timeout=30)
    code, _, err = finish(start(run_dir, "--resume", "--lr", "0.01"))
    assert code == 1 and "cannot resume with a different config: lr 0.003 -> 0.01" in err
    code, _, err = finish(start(run_dir, "--resume", "--batch-size", "128", "--seed", "4"))
    assert code == 1 and "batch_size 1024 -> 128" in err and "seed 0 -> 4" in err
    code, out, err = finish(start(run_dir, "--resume", "--steps", "180", "--json"))  # extending is allowed
    assert code == 0, err
    assert json.loads(out)["steps"] == 180 and steps_of(run_dir)[-1] == 180


def test_torn_metrics_line_is_skipped(tmp_path):
    path = tmp_path / "metrics.jsonl"
    artifacts.append_jsonl(path, [{"step": 10}, {"step": 20}])
    with open(path, "a") as f:
        f.write('{"step": 30, "lo')
    assert [r["step"] for r in artifacts.read_jsonl(path)] == [10, 20]
    artifacts.truncate_jsonl(path, lambda r: r["step"] <= 20)
    artifacts.append_jsonl(path, [{"step": 30}])
    assert [r["step"] for r in artifacts.read_jsonl(path)] == [10, 20, 30]


def test_divergence_stops_with_exit_1_and_keeps_the_last_good_checkpoint(tmp_path, synthetic_cli, capsys):
    run_dir = tmp_path / "run"
    code = cli.main(["train", "--steps", "40", "--batch-size", "64", "--optimizer", "sgd", "--lr", "1e4",
                     "--log-every", "2", "--checkpoint-every", "2", "--run-dir", str(run_dir)])
    err = capsys.readouterr().err
    assert code == 1 and "diverged at step" in err
    diverged_at = int(err.split("diverged at step ")[1].split(":")[0])
    meta = checkpoint.read_meta(run_dir / "checkpoints")
    assert meta is not None and meta["step"] < diverged_at
    assert steps_of(run_dir)[-1] >= diverged_at and not (run_dir / "summary.json").exists()


def test_failed_checkpoint_write_is_an_error_and_keeps_the_previous(tmp_path, synthetic_cli, capsys, monkeypatch):
    run_dir = tmp_path / "run"
    real_save = checkpoint.ocp.CheckpointManager.save

    def save(self, step, *args, **kwargs):
        if step >= 20:
            raise OSError(28, "No space left on device")
        return real_save(self, step, *args, **kwargs)

    monkeypatch.setattr(checkpoint.ocp.CheckpointManager, "save", save)
    code = cli.main(["train", "--steps", "40", "--batch-size", "64", "--log-every", "10",
                     "--checkpoint-every", "10", "--run-dir", str(run_dir)])
    err = capsys.readouterr().err
    assert code == 1
    assert "checkpoint at step 20 could not be written" in err and "No space left on device" in err
    assert checkpoint.read_meta(run_dir / "checkpoints")["step"] == 10


def test_unwritable_run_dir_fails_before_training(tmp_path, synthetic_cli, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    code = cli.main(["train", "--steps", "5", "--batch-size", "64", "--run-dir", str(blocker / "run")])
    err = capsys.readouterr().err
    assert code == 1 and "not writable" in err and len(err.strip().splitlines()) == 1


def test_atomic_write_leaves_old_file_when_interrupted(tmp_path, monkeypatch):
    path = tmp_path / "summary.json"
    artifacts.atomic_write_json(path, {"old": True})

    def boom(*args):
        raise OSError("disk went away")

    monkeypatch.setattr(artifacts.os, "replace", boom)
    with pytest.raises(OSError):
        artifacts.atomic_write_json(path, {"new": True})
    assert artifacts.read_json(path) == {"old": True}
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]  # no temp file left behind


def test_overwrite_removes_only_what_a_run_wrote(tmp_path):
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints" / "10").mkdir(parents=True)
    (run_dir / "summary.json").write_text("{}")
    (run_dir / "notes.txt").write_text("mine")
    with pytest.raises(artifacts.ConfigError, match="not empty"):
        artifacts.prepare_run_dir(run_dir)
    artifacts.prepare_run_dir(run_dir, overwrite=True)
    assert [p.name for p in run_dir.iterdir()] == ["notes.txt"]
