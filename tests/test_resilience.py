"""Never lose a run: real processes, real signals, bounded in time."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import file_size_limited, wait_for

from fashionjax import artifacts, checkpoint, cli, data, rundir

pytestmark = pytest.mark.slow

# Batch 1024: an epoch is 58 steps, so the default checkpoints (once an epoch) land at the chunk
# ends 60 and 120, and at the end, 160.
RUN = ["--steps", "160", "--batch-size", "1024", "--log-every", "10", "--offline"]


def start(run_dir: Path, *extra: str, env=None, file_size_kb: int | None = None) -> subprocess.Popen:
    command = [sys.executable, "-m", "fashionjax", "train", *RUN, "--run-dir", str(run_dir), *extra]
    if file_size_kb is not None:
        command = file_size_limited(command, file_size_kb)
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})


def finish(process: subprocess.Popen, timeout: float = 240) -> tuple[int, str, str]:
    out, err = process.communicate(timeout=timeout)
    return process.returncode, out, err


def steps_of(run_dir: Path) -> list[int]:
    return [r["step"] for r in artifacts.read_jsonl(run_dir / "metrics.jsonl")]


@pytest.fixture(scope="module")
def reference(real_dataset, tmp_path_factory):
    """The uninterrupted run every interrupted one must match bit for bit."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    code, out, err = finish(start(run_dir, "--json"))
    assert code == 0, err
    summary = json.loads(out)
    return {"digest": summary["params_digest"], "steps": steps_of(run_dir), "summary": summary}


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
        assert checkpoint.latest_meta(run_dir / "checkpoints")["step"] in (60, 120)
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
    assert "fashionjax train --resume --run-dir" in err and "Traceback" not in err
    assert checkpoint.latest_meta(run_dir / "checkpoints")["step"] >= 20
    assert resume(run_dir)["params_digest"] == reference["digest"]


def test_resume_refusals(reference, tmp_path, real_dataset, capsys):
    run_dir = tmp_path / "run"
    code, _, err = finish(start(run_dir, "--resume"))
    assert code == 1 and "no finalized checkpoint" in err and not (run_dir / "summary.json").exists()
    process = start(run_dir)
    wait_for(finalized(run_dir, 60), process)
    process.kill()
    process.wait(timeout=30)

    def refused(*flags: str) -> str:  # the killed run's own checkpoint, read in this process: no import to wait for
        code = cli.main(["train", *RUN, "--run-dir", str(run_dir), "--resume", *flags])
        err = capsys.readouterr().err
        assert code == 1, err
        return err

    assert "cannot resume with a different config: lr 0.003 -> 0.01" in refused("--lr", "0.01")
    err = refused("--batch-size", "128", "--seed", "4")
    assert "batch_size 1024 -> 128" in err and "seed 0 -> 4" in err
    assert "laid out for 160 steps" in refused("--steps", "180")  # a cosine run is not re-stretched
    assert not (run_dir / "summary.json").exists()
    assert "below the checkpoint's step 60" in refused("--steps", "50")


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
    meta = checkpoint.latest_meta(run_dir / "checkpoints")
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
    assert checkpoint.latest_meta(run_dir / "checkpoints")["step"] == 10


def test_a_real_write_fault_in_a_checkpoint_is_one_line_naming_the_cause(tmp_path):
    """A file-size limit lets the small run files through and stops the checkpoint's data file, as a
    full disk would, without root."""
    code, out, err = finish(start(tmp_path / "run", "--json", file_size_kb=300))
    assert code == 1
    error = json.loads(out)["error"]
    assert error["kind"] == "checkpoint" and error["exit_code"] == 1
    assert error["message"].endswith("checkpoint at step 60 could not be written to "
                                     f"{tmp_path / 'run' / 'checkpoints'}: {os.strerror(27)}")
    assert "Traceback" not in err and "absl" not in err  # orbax's own logging stays quiet
    assert err.strip().splitlines()[-1] == error["message"]


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


# ---------------------------------------------------------------- users doing things at once


def test_parallel_trainings_get_their_own_directories(real_dataset, tmp_path):
    processes = [subprocess.Popen([sys.executable, "-m", "fashionjax", "train", "--steps", "20", "--batch-size",
                                   "1024", "--log-every", "10", "--offline", "--json", "--seed", str(seed)],
                                  cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for seed in range(3)]
    summaries = []
    for process in processes:
        code, out, err = finish(process)
        assert code == 0, err
        summaries.append(json.loads(out))
    run_dirs = {tmp_path / s["run_dir"] for s in summaries}
    assert len(run_dirs) == 3 and run_dirs == set((tmp_path / "runs").iterdir())
    for summary in summaries:
        saved = artifacts.read_json(tmp_path / summary["run_dir"] / "summary.json")
        assert saved["params_digest"] == summary["params_digest"] and saved["seed"] == summary["seed"]


def test_second_training_on_a_live_directory_is_refused_and_the_first_is_untouched(real_dataset, tmp_path):
    run_dir = tmp_path / "run"
    first = start(run_dir, "--steps", "100000", "--schedule", "constant")  # long enough to outlive the attempts
    wait_for(lambda: len(steps_of(run_dir)) >= 1, first)
    config_before = (run_dir / "config.json").read_bytes()
    for extra in ((), ("--overwrite",), ("--resume",)):
        code, out, err = finish(start(run_dir, "--json", *extra), timeout=120)
        assert code == 1, err
        assert json.loads(out)["error"]["message"].endswith(
            f"{run_dir}: in use by another training (pid {first.pid}); wait for it to finish or choose another --run-dir")
        assert first.poll() is None
    first.send_signal(signal.SIGTERM)
    code, _, err = finish(first)
    assert code == 143, err
    assert (run_dir / "config.json").read_bytes() == config_before
    steps = steps_of(run_dir)
    assert steps == list(range(10, 10 * len(steps) + 1, 10))  # every log point once, in order
    assert checkpoint.latest_meta(run_dir / "checkpoints")["step"] == steps[-1]


def test_eval_and_report_against_a_live_training_change_nothing(reference, tmp_path):
    run_dir = tmp_path / "run"
    training = start(run_dir, "--checkpoint-every", "10")  # a checkpoint every chunk: many writes to race
    wait_for(lambda: (run_dir / "config.json").is_file(), training)
    evals = []
    while training.poll() is None:
        result = subprocess.run([sys.executable, "-m", "fashionjax", "eval", str(run_dir), "--offline", "--json"],
                                capture_output=True, text=True, timeout=120)
        document = json.loads(result.stdout)
        assert result.returncode == 0 or "no finalized checkpoint" in document["error"]["message"], result.stdout
        evals.append(document.get("step") or document["error"]["message"])
        report = subprocess.run([sys.executable, "-m", "fashionjax", "report", str(run_dir), "--json"],
                                capture_output=True, text=True, timeout=120)
        if training.poll() is None and report.returncode == 1:
            assert "still training" in json.loads(report.stdout)["error"]["message"]
    code, _, err = finish(training)
    assert code == 0, err
    assert any(isinstance(e, int) for e in evals), evals  # at least one eval read a live checkpoint
    assert artifacts.read_json(run_dir / "summary.json")["params_digest"] == reference["digest"]
    assert steps_of(run_dir) == reference["steps"]
    # the live report is written elsewhere with --out, never into the run
    out = tmp_path / "elsewhere.html"
    assert subprocess.run([sys.executable, "-m", "fashionjax", "report", str(run_dir), "--out", str(out)],
                          capture_output=True, timeout=120).returncode == 0 and out.stat().st_size > 1000


def test_reading_a_training_before_its_first_checkpoint_names_the_training(real_dataset, tmp_path):
    run_dir = tmp_path / "run"
    training = start(run_dir, "--checkpoint-every", "150")  # the first checkpoint at step 150
    try:
        wait_for(lambda: (run_dir / "config.json").is_file(), training)
        training.send_signal(signal.SIGSTOP)  # held before its first checkpoint, as long as the test needs
        assert not rundir.has_checkpoint(run_dir)
        for command in (["eval", str(run_dir), "--offline"], ["predict", str(run_dir), str(run_dir / "config.json")]):
            result = subprocess.run([sys.executable, "-m", "fashionjax", *command, "--json"], capture_output=True,
                                    text=True, timeout=120)
            message = json.loads(result.stdout)["error"]["message"]
            assert result.returncode == 1 and result.stderr.count("\n") == 1
            assert message == (f"fashionjax {command[0]}: {run_dir / 'checkpoints'}: no finalized checkpoint yet: "
                               f"the training in this run "
                               f"(pid {training.pid}) has not written its first; try again after it does")
    finally:
        training.kill()
        training.wait(timeout=60)
    result = subprocess.run([sys.executable, "-m", "fashionjax", "eval", str(run_dir), "--offline", "--json"],
                            capture_output=True, text=True, timeout=120)  # nobody trains it now
    assert result.returncode == 1
    message = json.loads(result.stdout)["error"]["message"]
    assert message == f"fashionjax eval: {run_dir / 'checkpoints'}: no finalized checkpoint"


def test_a_step_removed_between_orbax_checks_is_read_again(tmp_path, monkeypatch):
    # orbax checks that a step's path exists and then that it is a directory: a step that the training
    # removes between the two raises NotADirectoryError ("Path is not a directory"), seen once in the
    # real-process test below. It means "removed", as FileNotFoundError does: the reader opens again.
    calls = {"open": 0, "read": 0}

    class Manager:
        def close(self):
            pass

    def opening(directory, keep=3, writer=True):
        calls["open"] += 1
        if calls["open"] == 1:
            raise NotADirectoryError(f"Path is not a directory: {directory / '90'}")
        return Manager()

    def read(manager):
        calls["read"] += 1
        if calls["read"] == 1:
            raise NotADirectoryError(f"Path is not a directory: {tmp_path / '100'}")
        return "the newer step"

    monkeypatch.setattr(checkpoint, "_manager", opening)
    assert checkpoint._read(tmp_path, read) == "the newer step" and calls == {"open": 3, "read": 2}

    def always_gone(manager):
        raise NotADirectoryError("Path is not a directory")

    with pytest.raises(NotADirectoryError):  # the checkpoints folder itself is gone: nothing to wait for
        checkpoint._read(tmp_path / "removed", always_gone)


def test_readers_of_a_training_that_keeps_one_checkpoint_read_the_newer_one(real_dataset, tmp_path, capsys):
    """--keep 1 and a checkpoint every chunk: the training removes each checkpoint as soon as the next
    is down, often while eval, predict or export is reading it. Each reads the newer one instead."""
    run_dir = tmp_path / "run"
    training = start(run_dir, "--steps", "100000", "--schedule", "constant", "--checkpoint-every", "10", "--keep", "1")
    wait_for(lambda: rundir.has_checkpoint(run_dir), training)
    from PIL import Image

    Image.fromarray(real_dataset.test.images_u8[0]).save(tmp_path / "picture.png")
    steps = []
    for _ in range(4):
        assert cli.main(["eval", str(run_dir), "--offline", "--json"]) == 0, capsys.readouterr().out
        steps.append(json.loads(capsys.readouterr().out)["step"])
        assert cli.main(["predict", str(run_dir), str(tmp_path / "picture.png"), "--json"]) == 0, \
            capsys.readouterr().out
        steps.append(json.loads(capsys.readouterr().out)["checkpoint_step"])
    assert cli.main(["export", str(run_dir), "--format", "safetensors", "--out", str(tmp_path / "x"), "--offline",
                     "--json"]) == 0, capsys.readouterr().out
    assert training.poll() is None
    training.send_signal(signal.SIGTERM)
    code, _, err = finish(training)
    assert code == 143, err
    assert steps == sorted(steps) and steps[0] < steps[-1]


def test_resume_with_no_flags_continues_the_run_as_started(reference, tmp_path):
    run_dir = tmp_path / "my runs" / "a b"  # the printed hint must survive spaces
    process = start(run_dir)
    wait_for(lambda: len(steps_of(run_dir)) >= 3, process)
    process.send_signal(signal.SIGTERM)
    code, _, err = finish(process)
    assert code == 143, err
    hint = err.split("resume with: ")[1].splitlines()[0]
    words = shlex.split(hint)
    assert words[:5] == ["fashionjax", "train", "--resume", "--run-dir", str(run_dir)]
    result = subprocess.run([sys.executable, "-m", "fashionjax", *words[1:], "--json"], capture_output=True,
                            text=True, timeout=240)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["params_digest"] == reference["digest"]
    assert steps_of(run_dir) == reference["steps"]


def test_a_run_killed_after_training_resumes_to_completion_with_its_own_figures(reference, tmp_path):
    run_dir = tmp_path / "run"
    process = start(run_dir)
    wait_for(finalized(run_dir, 160), process, poll=0.0005)  # the last checkpoint: training is over
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=30)
    summary = resume(run_dir)
    assert summary["params_digest"] == reference["digest"] and summary["steps"] == 160
    assert summary["final_train_loss"] == reference["summary"]["final_train_loss"]
    for figure in ("train_examples_per_sec", "compile_seconds", "train_seconds", "wall_seconds"):
        assert summary[figure] and summary[figure] > 0, figure
    assert summary["train_seconds"] < summary["wall_seconds"]
    assert (run_dir / "report.html").is_file() and steps_of(run_dir) == reference["steps"]


def test_interrupt_during_evaluation_leaves_a_run_that_resume_completes(reference, tmp_path):
    run_dir = tmp_path / "run"
    process = start(run_dir)
    wait_for(finalized(run_dir, 160), process, poll=0.0005)
    process.send_signal(signal.SIGINT)
    code, _, err = finish(process)
    assert code in (130, 0), err  # 0 only when the whole evaluation beat the signal
    assert "Traceback" not in err
    if code == 130:
        assert not (run_dir / "summary.json").exists() and "resume with:" in err
    assert resume(run_dir)["params_digest"] == reference["digest"]


def test_sigint_twice_never_tears_the_checkpoint(reference, tmp_path):
    run_dir = tmp_path / "run"
    process = start(run_dir)
    wait_for(lambda: len(steps_of(run_dir)) >= 2, process)
    process.send_signal(signal.SIGINT)
    time.sleep(0.01)
    process.send_signal(signal.SIGINT)
    code, _, err = finish(process)
    assert code == 130, err
    assert "Traceback" not in err and "checkpoint saved" in err
    assert resume(run_dir)["params_digest"] == reference["digest"]


@pytest.mark.parametrize("delay", [0.5, 1.0, 1.5])
@pytest.mark.parametrize("signum,exit_code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_during_start_up_exits_cleanly_leaving_nothing(signum, exit_code, delay, real_dataset, tmp_path):
    run_dir = tmp_path / "run"
    process = start(run_dir)
    time.sleep(delay)  # importing JAX and matplotlib, loading data: before the first chunk
    process.send_signal(signum)
    code, _, err = finish(process)
    assert "Traceback" not in err
    if code == exit_code and not (run_dir / "checkpoints").is_dir():
        assert not run_dir.exists()  # nothing half-written
    else:  # the signal came after training began: then it must have checkpointed
        assert code == exit_code and "resume with:" in err


def test_a_signal_inside_a_class_being_created_still_exits_as_a_signal(tmp_path, synthetic_cli, capsys, monkeypatch):
    """A signal landing while an import creates a class (matplotlib's, at start-up) reaches the
    command wrapped: Python 3.11 reraises an exception from __set_name__ as a RuntimeError."""
    class SignalledOnNaming:
        def __set_name__(self, owner, name):
            os.kill(os.getpid(), signal.SIGTERM)  # the handler runs here, inside class creation

    loaded = data.load

    def load_while_importing(*args, **kwargs):
        type("Imported", (), {"attribute": SignalledOnNaming()})
        return loaded(*args, **kwargs)

    monkeypatch.setattr(data, "load", load_while_importing)
    run_dir = tmp_path / "run"
    code = cli.main(["train", "--steps", "5", "--batch-size", "64", "--run-dir", str(run_dir)])
    err = capsys.readouterr().err
    assert code == 143 and "interrupted by SIGTERM" in err and "nothing was kept" in err
    assert not run_dir.exists()


def test_an_unreadable_newest_checkpoint_falls_back_to_the_one_before(reference, tmp_path):
    run_dir = tmp_path / "run"
    process = start(run_dir)
    wait_for(lambda: finalized(run_dir, 120)() and max(steps_of(run_dir)) >= 130, process)
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=30)
    newest = run_dir / "checkpoints" / "120"
    for path in newest.rglob("*"):
        if path.is_file():
            path.write_bytes(b"\0garbage\0")
    summary = resume(run_dir)
    assert summary["params_digest"] == reference["digest"]
    assert steps_of(run_dir) == reference["steps"]


def test_closed_and_broken_output_streams_lose_nothing(reference, tmp_path):
    closed = tmp_path / "closed"
    command = " ".join(shlex.quote(w) for w in [sys.executable, "-m", "fashionjax", "train", *RUN, "--run-dir",
                                                 str(closed)])
    result = subprocess.run(["bash", "-c", f"{command} >&- 2>&-"], capture_output=True, text=True, timeout=240)
    assert result.returncode == 0
    assert artifacts.read_json(closed / "summary.json")["params_digest"] == reference["digest"]

    piped = tmp_path / "piped"
    command = command.replace(shlex.quote(str(closed)), shlex.quote(str(piped)))
    result = subprocess.run(["bash", "-c", f"{command} 2>&1 | head -c 20; echo; echo status=${{PIPESTATUS[0]}}"],
                            capture_output=True, text=True, timeout=240)
    assert result.stdout.strip().endswith("status=0") and "Traceback" not in result.stdout
    assert artifacts.read_json(piped / "summary.json")["params_digest"] == reference["digest"]


def test_an_interrupted_speedrun_goes_on_when_run_again(reference, tmp_path):
    """SIGINT in the first seed: 130 and a checkpoint; the same command again keeps going, and that
    seed ends bit-identical to the uninterrupted run."""
    command = [sys.executable, "-m", "fashionjax", "speedrun", "--model", "mlp", *RUN, "--seeds", "2",
               "--target", "0.5", "--out", str(tmp_path / "record"), "--json"]
    first = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(finalized(tmp_path / "record" / "seed-0", 60), first)
    first.send_signal(signal.SIGINT)
    code, out, err = finish(first)
    assert code == 130, err
    assert "run the same speedrun command again" in json.loads(out)["error"]["message"]
    code, out, err = finish(subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    assert code == 0, err
    assert "seed 0: resuming" in err
    document = json.loads(out)
    assert [row["seed"] for row in document["per_seed"]] == [0, 1]
    assert document["per_seed"][0]["params_digest"] == reference["digest"]


def test_tensorboard_events_equal_metrics_after_a_kill_and_resume(reference, tmp_path):
    from test_use import assert_events_mirror_the_run

    run_dir = tmp_path / "run"
    process = start(run_dir, "--tensorboard")
    wait_for(lambda: finalized(run_dir, 60)() and max(steps_of(run_dir)) >= 80, process)
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=30)
    assert resume(run_dir)["params_digest"] == reference["digest"]  # the events change nothing else
    assert_events_mirror_the_run(run_dir)  # the log points past step 60 were dropped and written once again


def test_a_speedrun_seed_killed_before_its_first_checkpoint_starts_again(reference, tmp_path):
    """A second speedrun on the same folder is refused while the first trains (naming --out); after
    kill -9 before any checkpoint, the command run again trains that seed afresh, bit-identical to the
    uninterrupted run, instead of asking for --overwrite, which speedrun does not have."""
    out_dir = tmp_path / "record"
    command = [sys.executable, "-m", "fashionjax", "speedrun", "--model", "mlp", *RUN, "--seeds", "1",
               "--target", "0.5", "--out", str(out_dir), "--json"]
    long = [*command, "--steps", "100000", "--schedule", "constant", "--checkpoint-every", "100000"]
    first = subprocess.Popen(long, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(lambda: (out_dir / "seed-0" / "metrics.jsonl").is_file() and steps_of(out_dir / "seed-0"), first)
    code, out, err = finish(subprocess.Popen(long, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    assert code == 1, err
    assert json.loads(out)["error"]["message"].endswith(
        f"{out_dir / 'seed-0'}: in use by another training (pid {first.pid}); wait for it to finish or choose "
        "another --out")
    assert first.poll() is None
    first.kill()
    first.communicate()
    assert not rundir.has_checkpoint(out_dir / "seed-0")
    code, out, err = finish(subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    assert code == 0, err
    assert "seed 0: training" in err
    assert json.loads(out)["per_seed"][0]["params_digest"] == reference["digest"]
