"""The CLI contract: exit codes, one-line errors, --json, and a smoke run with its artifacts."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import write_synthetic_files

from fashionjax import artifacts, cli


def fashionjax(*args: str, env: dict | None = None, timeout: int = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fashionjax", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def one_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    assert len(lines) == 1, text
    return lines[0]


@pytest.mark.parametrize("flags,message", [
    (["--lr", "0"], "learning rate must be a positive finite number"),
    (["--lr", "nan"], "learning rate"),
    (["--batch-size", "0"], "batch size must be at least 1"),
    (["--steps", "0"], "--steps must be at least 1"),
    (["--model", "resnet"], "unknown model 'resnet'"),
    (["--optimizer", "lion"], "unknown optimizer"),
    (["--dtype", "float16"], "unknown dtype"),
    (["--lr", "fast"], "invalid float value"),
    (["--epochs", "2", "--steps", "3"], "not allowed with argument"),
])
def test_bad_flags_exit_2_with_one_line_and_write_nothing(tmp_path, flags, message):
    run_dir = tmp_path / "run"
    result = fashionjax("train", "--run-dir", str(run_dir), *flags)
    assert result.returncode == 2
    assert message in one_line(result.stderr)
    assert "Traceback" not in result.stderr and not run_dir.exists()


def test_batch_larger_than_the_training_set_exits_2(tmp_path, real_dataset):
    run_dir = tmp_path / "run"
    result = fashionjax("train", "--batch-size", "60001", "--run-dir", str(run_dir), "--offline")
    assert result.returncode == 2 and "larger than the training set" in one_line(result.stderr)
    assert not run_dir.exists()


def test_bad_data_dir_exits_1_with_one_line_and_debug_shows_the_traceback(tmp_path):
    directory = tmp_path / "data"
    write_synthetic_files(directory)  # valid IDX files, but not Fashion-MNIST's checksums
    result = fashionjax("data", "--data-dir", str(directory), "--out", str(tmp_path / "out"))
    assert result.returncode == 1
    line = one_line(result.stderr)
    assert "train-images-idx3-ubyte.gz" in line and "checksum mismatch" in line
    debug = fashionjax("data", "--data-dir", str(directory), "--debug")
    assert debug.returncode == 1 and "Traceback" in debug.stderr


def test_doctor_json_and_require_gpu():
    result = fashionjax("doctor", "--json")
    assert result.returncode == 0
    info = json.loads(result.stdout)
    assert info["backend"] == "cpu" and info["jax_version"] and info["devices"][0]["platform"] == "cpu"
    strict = fashionjax("doctor", "--require-gpu", "--json")
    assert strict.returncode == 1 and "no GPU visible" in strict.stderr
    json.loads(strict.stdout)  # still exactly one document


@pytest.mark.slow
def test_data_json_on_the_real_data(tmp_path, real_dataset):
    result = fashionjax("data", "--json", "--offline", "--out", str(tmp_path / "out"))
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    assert document["verified"] is True
    assert document["splits"]["train"]["images"] == 60000 and document["splits"]["test"]["labels"] == 10000
    assert (tmp_path / "out" / "samples.png").stat().st_size > 10_000


def test_train_smoke_writes_every_artifact_and_eval_agrees(tmp_path, synthetic_cli, capsys):
    run_dir = tmp_path / "run"
    code = cli.main(["train", "--steps", "30", "--batch-size", "64", "--log-every", "10",
                     "--run-dir", str(run_dir), "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    summary = json.loads(captured.out)
    for name in ("config.json", "metrics.jsonl", "summary.json", "eval.json", "curve.png", "confusion.png",
                 "predictions.png", "mistakes.png", "samples.png", "checkpoints"):
        assert (run_dir / name).exists(), name
    expected_keys = {"model", "params", "steps", "epochs", "batch_size", "dtype", "optimizer", "lr", "seed",
                     "test_accuracy", "test_loss", "test_examples", "train_examples_per_sec", "compile_seconds",
                     "wall_seconds", "final_train_loss", "params_digest", "backend", "device_kind",
                     "device_count", "process_count", "jax_version", "fashionjax_version"}
    assert expected_keys <= set(artifacts.read_json(run_dir / "summary.json"))
    assert summary["test_examples"] == 500 and summary["steps"] == 30
    records = artifacts.read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == [10, 20, 30]
    assert set(records[0]) == {"step", "epoch", "loss", "accuracy", "grad_norm", "examples_per_sec", "elapsed_s", "lr"}

    code = cli.main(["eval", str(run_dir), "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0
    assert report["accuracy"] == summary["test_accuracy"] and report["examples"] == 500
    assert report["params_digest"] == summary["params_digest"]

    code = cli.main(["train", "--steps", "5", "--batch-size", "64", "--run-dir", str(run_dir)])
    assert code == 2 and "not empty" in capsys.readouterr().err


def test_default_run_dir_is_timestamped(tmp_path, synthetic_cli, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["train", "--steps", "4", "--batch-size", "64", "--log-every", "4", "--quiet"]) == 0
    (run_dir,) = list((tmp_path / "runs").iterdir())
    assert re.fullmatch(r"\d{8}T\d{6}\.\d{6}Z-mlp-[0-9a-f]{6}", run_dir.name), run_dir.name
    assert (run_dir / "summary.json").exists()


@pytest.mark.slow
def test_real_data_short_run_learns(tmp_path, real_dataset):
    run_dir = tmp_path / "real"
    result = fashionjax("train", "--steps", "100", "--schedule", "constant", "--run-dir", str(run_dir),
                        "--offline", "--json")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["test_examples"] == 10000
    assert summary["test_accuracy"] > 0.75  # chance is 0.10
    assert Path(summary["run_dir"]) == run_dir


def test_json_stdout_survives_native_prints_and_repeated_calls():
    code = ("import os\nfrom fashionjax import cli, console\n"
            "show = console.Output.show\n"
            "def noisy(self, renderable):\n"
            "    os.write(1, b'native-noise\\n')  # what gloo does: write straight to fd 1\n"
            "    show(self, renderable)\n"
            "console.Output.show = noisy\n"
            "cli.main(['doctor', '--json'])\ncli.main(['doctor', '--json'])\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "native-noise" in result.stderr and "native-noise" not in result.stdout
    decoder, text, documents = json.JSONDecoder(), result.stdout.strip(), []
    while text:
        document, end = decoder.raw_decode(text)
        documents.append(document)
        text = text[end:].strip()
    assert len(documents) == 2 and documents[0]["backend"] == "cpu"
