"""Data parallelism on CPU devices: a forced 4-device host, and two real processes on 127.0.0.1."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import small_speedrun_cli, wait_for

from fashionjax import artifacts, checkpoint, config, train

pytestmark = pytest.mark.multiprocess

# A constant schedule, so that the resume test can extend the run.
RUN = ["--steps", "20", "--batch-size", "512", "--log-every", "5", "--schedule", "constant", "--offline", "--json",
       "--quiet"]


def devices_env(count: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={count}"
    return env


def train_process(run_dir: Path, devices: int, *extra: str, command=(sys.executable, "-m", "fashionjax")
                  ) -> subprocess.Popen:
    return subprocess.Popen([*command, "train", *RUN, "--run-dir", str(run_dir), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=devices_env(devices))


def completed(process: subprocess.Popen, timeout: float = 300) -> dict:
    out, err = process.communicate(timeout=timeout)
    assert process.returncode == 0, err[-3000:]
    return json.loads(out)


def logged(run_dir: Path):
    """Whether the run has written its first log point."""
    return lambda: bool(artifacts.read_jsonl(run_dir / "metrics.jsonl"))


def losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in artifacts.read_jsonl(run_dir / "metrics.jsonl")]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


FASHIONJAX = (sys.executable, "-m", "fashionjax")


def two_processes(run_dir: Path, *extra: str, commands=(FASHIONJAX, FASHIONJAX)) -> list[subprocess.Popen]:
    coordinator = f"127.0.0.1:{free_port()}"
    return [train_process(run_dir, 2, *extra, "--coordinator", coordinator, "--num-processes", "2",
                          "--process-id", str(i), command=command) for i, command in enumerate(commands)]


def outcomes_of(processes: list[subprocess.Popen], timeout: float = 60) -> list[tuple[str, str]]:
    """Each process's (stdout, stderr) once it has exited; any still running after `timeout` is killed."""
    try:
        return [p.communicate(timeout=timeout) for p in processes]
    finally:
        for p in processes:
            if p.poll() is None:
                p.kill()


def assert_close(a: list[float], b: list[float], rel: float = 1e-5) -> None:
    assert len(a) == len(b) == 4
    for x, y in zip(a, b, strict=True):
        assert x == pytest.approx(y, rel=rel)


@pytest.fixture(scope="module")
def one_device(real_dataset, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("one") / "run"
    summary = completed(train_process(run_dir, 1))
    return summary, losses(run_dir)


@pytest.fixture(scope="module")
def four_devices(real_dataset, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("four") / "run"
    summary = completed(train_process(run_dir, 4))
    return summary, losses(run_dir)


def test_four_devices_match_one_and_count_every_test_image(one_device, four_devices):
    (one, one_losses), (four, four_losses) = one_device, four_devices
    assert (one["device_count"], four["device_count"]) == (1, 4)
    assert_close(four_losses, one_losses)
    assert four["test_examples"] == 10000
    assert four["test_accuracy"] == pytest.approx(one["test_accuracy"], abs=2e-4)  # a flip or two at most


def test_batch_that_does_not_divide_over_devices_exits_2(tmp_path, real_dataset):
    process = train_process(tmp_path / "run", 4, "--batch-size", "510")
    _, err = process.communicate(timeout=120)
    assert process.returncode == 2 and "does not divide evenly over 4 devices" in err


def test_two_processes_match_one_process_with_four_devices(four_devices, tmp_path):
    run_dir = tmp_path / "run"
    summaries = [completed(p) for p in two_processes(run_dir)]
    assert [s["process_count"] for s in summaries] == [2, 2]
    assert [s["device_count"] for s in summaries] == [4, 4]
    assert summaries[0]["params_digest"] == summaries[1]["params_digest"]
    assert summaries[0]["test_examples"] == 10000
    assert_close(losses(run_dir), four_devices[1])
    assert (run_dir / "checkpoints" / "20").is_dir() and (run_dir / "summary.json").is_file()
    # Checkpoints work across processes: both restore step 20 and train on to 30.
    resumed = [completed(p) for p in two_processes(run_dir, "--resume", "--steps", "30")]
    assert [s["steps"] for s in resumed] == [30, 30]
    assert resumed[0]["params_digest"] == resumed[1]["params_digest"]
    assert [r["step"] for r in artifacts.read_jsonl(run_dir / "metrics.jsonl")] == [5, 10, 15, 20, 25, 30]


def test_killed_worker_makes_the_other_exit_nonzero_in_bounded_time(real_dataset, tmp_path):
    run_dir = tmp_path / "run"
    processes = two_processes(run_dir, "--steps", "100000", "--log-every", "5")
    leader, worker = processes
    try:
        wait_for(logged(run_dir), leader, timeout=180, poll=0.1)
        worker.send_signal(signal.SIGKILL)
        try:
            out, err = leader.communicate(timeout=60)  # JAX's heartbeat alone: an abort from C++ after 20 s
        except subprocess.TimeoutExpired:
            pytest.fail("the leader was still running 60 s after its peer died")
        message = ("fashionjax train: process 1 of this run ended without a word (killed or crashed); this one stops "
                   "too, its finalized checkpoints kept (start every process again with --resume)")
        assert leader.returncode == 1 and json.loads(out)["error"]["message"] == message
        assert [line for line in err.splitlines() if "fashionjax train:" in line] == [message]
    finally:
        for p in processes:
            if p.poll() is None:
                p.kill()
            p.communicate()


def test_a_process_that_fails_stops_the_others_at_once_with_its_reason(real_dataset, tmp_path):
    """Process 0 refuses a run directory another training holds; process 1 would otherwise wait in
    its first collective for JAX's timeout (30 s here) and end with Gloo's message."""
    run_dir = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-m", "fashionjax", "train", "--steps", "100000", "--run-dir",
                               str(run_dir), "--offline", "--quiet"], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        wait_for((run_dir / "config.json").is_file, holder, poll=0.1)
        started = time.monotonic()
        processes = two_processes(run_dir)
        outcomes = [p.communicate(timeout=120) for p in processes]
    finally:
        holder.kill()
        holder.wait()
    assert time.monotonic() - started < 25
    assert [p.returncode for p in processes] == [1, 1], [err[-2000:] for _, err in outcomes]
    refusal = json.loads(outcomes[0][0])["error"]["message"]
    assert refusal.startswith(f"fashionjax train: {run_dir}: in use by another training (pid {holder.pid})")
    assert json.loads(outcomes[1][0])["error"]["message"] == (
        f"fashionjax train: process 0 of this run failed ({refusal.removeprefix('fashionjax train: ')}); "
        "this one stops too")


# `fashionjax` whose process pauses 3 s before it leaves a multi-process run: a busy machine's slow
# follower. Process 0 hosts JAX's coordination service; had it gone first, JAX would abort this one.
SLOW_TO_LEAVE = (sys.executable, "-c", "import time; from fashionjax import cli, rendezvous; leave = rendezvous.leave; "
                 "rendezvous.leave = lambda *a, **k: (time.sleep(3), leave(*a, **k)); cli.run()")
# A Ctrl-C that reaches this process alone as its evaluation begins (in another terminal, on another host)
STOPPED_AT_EVALUATION = (sys.executable, "-c", "import os, signal; from fashionjax import cli, run; finish = run.finish; "
                         "run.finish = lambda *a: (os.kill(os.getpid(), signal.SIGINT), finish(*a)); cli.run()")


def test_a_signal_to_one_process_stops_all_at_one_checkpoint_that_resumes(real_dataset, tmp_path):
    """A scheduler's SIGTERM or a Ctrl-C in one terminal reaches one process: alone, it would wait in its
    checkpoint for the others while they wait for its next step, both for ever. In training the processes
    agree on the stop at a chunk end; after it (evaluation) the stopped one tells the others, which wait
    for it in a collective, and they stop with it."""
    run_dir = tmp_path / "run"
    processes = two_processes(run_dir, "--steps", "100000", "--log-every", "5", commands=(FASHIONJAX, SLOW_TO_LEAVE))
    try:
        wait_for(logged(run_dir), processes[0], timeout=180, poll=0.1)
        processes[1].send_signal(signal.SIGINT)
    finally:
        outcomes = outcomes_of(processes)
    assert [p.returncode for p in processes] == [130, 130], "\n".join(err[-2000:] for _, err in outcomes)  # a str: pytest cuts a long list
    step = json.loads(outcomes[0][0])["step"]
    assert json.loads(outcomes[1][0])["error"]["message"] == f"fashionjax train: interrupted by SIGINT at step {step}"
    assert max(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit()) == step
    processes = two_processes(run_dir, "--resume", "--steps", str(step + 10), commands=(STOPPED_AT_EVALUATION, FASHIONJAX))
    outcomes = outcomes_of(processes, timeout=300)
    assert [p.returncode for p in processes] == [130, 130], "\n".join(err[-2000:] for _, err in outcomes)
    assert json.loads(outcomes[0][0])["error"]["message"].startswith("fashionjax train: interrupted by SIGINT")
    follower = json.loads(outcomes[1][0])["error"]
    assert follower["kind"] == "interrupted" and follower["message"].startswith(
        "fashionjax train: process 0 of this run was stopped by SIGINT; this one stops too")
    assert not (run_dir / "summary.json").exists()
    assert max(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit()) == step + 10
    resumed = [completed(p, timeout=300) for p in two_processes(run_dir, "--resume")]
    assert [s["steps"] for s in resumed] == [step + 10] * 2
    assert resumed[0]["params_digest"] == resumed[1]["params_digest"]


def test_bench_reports_per_device_figures_and_scaling(real_dataset, tmp_path):
    result = subprocess.run([sys.executable, "-m", "fashionjax", "bench", "--batch-sizes", "512", "--dtypes", "float32",
                             "--steps", "5", "--repeats", "1", "--members", "1", "--out", str(tmp_path / "bench"), "--json", "--offline"],
                            capture_output=True, text=True, timeout=300, env=devices_env(4))
    assert result.returncode == 0, result.stderr[-3000:]
    document = json.loads(result.stdout)
    scaling = document["scaling"]
    assert scaling["devices"] == 4
    assert scaling["per_device_n"] == pytest.approx(scaling["examples_per_sec_n"] / 4)
    assert scaling["efficiency"] == pytest.approx(scaling["examples_per_sec_n"] / (4 * scaling["examples_per_sec_1"]))
    fused = next(c for c in document["cases"] if c["mode"] == "fused")
    assert fused["devices"] == 4
    assert fused["examples_per_sec_per_device"] == pytest.approx(fused["examples_per_sec"]["median"] / 4)


def test_unreachable_coordinator_is_one_line_naming_it_in_bounded_time(tmp_path):
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "fashionjax", "train", "--coordinator", f"127.0.0.1:{port}",
                             "--num-processes", "2", "--process-id", "1", "--coordinator-timeout", "2",
                             "--run-dir", str(tmp_path / "run"), "--json"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and time.monotonic() - started < 30
    line = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(line) == 1 and f"127.0.0.1:{port}" in line[0] and "within 2 s" in line[0]
    assert json.loads(result.stdout)["error"]["exit_code"] == 1
    assert not (tmp_path / "run").exists()


def test_a_process_that_never_arrives_is_one_line_in_process_0_in_bounded_time(tmp_path):
    """JAX's own start-up barrier would abort process 0 from C++ (exit 134, a stack trace, no JSON)."""
    coordinator = f"127.0.0.1:{free_port()}"
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "fashionjax", "train", "--coordinator", coordinator,
                             "--num-processes", "3", "--process-id", "0", "--coordinator-timeout", "3",
                             "--run-dir", str(tmp_path / "run"), "--json"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and time.monotonic() - started < 30
    line = [line for line in result.stderr.splitlines() if line.strip()]
    assert line == [f"fashionjax train: only 1 of 3 processes arrived within 3 s (missing --process-id 1, 2); "
                    f"start each with --coordinator {coordinator} --num-processes 3"]
    assert json.loads(result.stdout)["error"]["message"] == line[0]
    assert not (tmp_path / "run").exists()


def test_batch_norm_over_four_devices_matches_one(real_dataset, tmp_path):
    """The speedrun network's batch statistics are the global batch's, however the batch is split:
    the first four steps' losses agree to float tolerance (statistics of each 32-image shard would
    move them by far more; later steps drift apart as any high-rate run does)."""
    flags = ("--model", "speedrun", "--batch-size", "128", "--steps", "4", "--log-every", "1", "--no-tta")
    one, four = (train_process(tmp_path / f"run{n}", n, *flags, command=small_speedrun_cli()) for n in (1, 4))
    one_summary, four_summary = completed(one), completed(four)
    assert_close(losses(tmp_path / "run4"), losses(tmp_path / "run1"), rel=1e-5)
    assert four_summary["test_accuracy"] == pytest.approx(one_summary["test_accuracy"], abs=5e-4)


def focus_losses(run_dir: Path) -> np.ndarray:
    """The per-image training losses a --focus run's newest checkpoint holds."""
    document = artifacts.read_json(run_dir / "config.json")
    template = train.initial_state(config.TrainConfig(**document["config"]), 1,
                                   num_examples=document["plan"]["num_examples"])
    return np.asarray(checkpoint.read_latest(run_dir / "checkpoints", template)[1].focus["losses"])


def test_focus_records_each_images_loss_from_the_sharded_batch(real_dataset, tmp_path):
    """Each device's shard of the batch writes its images' losses into the replicated table: after the
    first epoch four devices hold the very images one device holds, with the same losses to float
    tolerance; the focused passes after it train on four devices too."""
    flags = ("--focus", "0.5", "--batch-size", "2048", "--log-every", "29", "--schedule", "cosine")  # after RUN's
    for process in [train_process(tmp_path / f"epoch{n}", n, *flags, "--steps", "29") for n in (1, 4)]:  # one epoch
        completed(process)
    one, four = focus_losses(tmp_path / "epoch1"), focus_losses(tmp_path / "epoch4")
    seen = np.isfinite(one)
    assert seen.sum() == 29 * 2048 and (np.isfinite(four) == seen).all()  # the epoch's 608 left-over images: unseen
    np.testing.assert_allclose(four[seen], one[seen], rtol=1e-3, atol=1e-5)
    longer = completed(train_process(tmp_path / "passes", 4, *flags, "--steps", "58"))
    assert longer["test_accuracy"] > 0.8
    assert np.isfinite(focus_losses(tmp_path / "passes")).all()  # the first pass took the unseen images first
