"""Nothing a user does by accident loses or corrupts a run: ownership, overwrite, errors that answer.

Fast tests: the library in-process on synthetic data, and the real CLI in subprocesses for flag
faults (those stop before any data is loaded).
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import file_size_limited, synthetic_run, write_synthetic_files
from PIL import Image

from fashionjax import artifacts, cli, config, data, models, plan, rundir
from fashionjax.report import render


def fashionjax(*args: str, cwd=None, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fashionjax", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd)


def lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


def tiny_run(run_dir: Path, *extra: str) -> int:
    return cli.main(["train", "--steps", "6", "--batch-size", "64", "--log-every", "3", "--quiet",
                     "--run-dir", str(run_dir), *extra])


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """One finished tiny run that read-only tests share; copy it before changing it."""
    return synthetic_run(tmp_path_factory, "finished", "--steps", "6", "--log-every", "3")


# ---------------------------------------------------------------- ownership


def test_default_run_dirs_are_unique_when_many_start_at_once(tmp_path):
    made: list[Path] = []
    barrier = threading.Barrier(16)

    def start():
        barrier.wait()
        owned = rundir.RunDir.new_default("mlp", tmp_path / "runs")
        made.append(owned.path)
        owned.release()

    threads = [threading.Thread(target=start) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(made)) == 16 and len(list((tmp_path / "runs").iterdir())) == 16


def test_a_locked_run_dir_is_refused_with_the_holders_pid(tmp_path, synthetic_cli, capsys):
    owner = rundir.RunDir.claim(tmp_path / "run")
    try:
        assert rundir.is_live(tmp_path / "run") == (str(os.getpid()), "training")
        code = tiny_run(tmp_path / "run", "--json")
        captured = capsys.readouterr()
        assert code == 1
        error = json.loads(captured.out)["error"]
        assert error["kind"] == "busy" and f"pid {os.getpid()}" in error["message"]
        assert str(tmp_path / "run") in error["message"]
        assert [p.name for p in (tmp_path / "run").iterdir()] == [rundir.LOCK]
    finally:
        owner.release()
    assert rundir.is_live(tmp_path / "run") is None
    assert not (tmp_path / "run" / rundir.LOCK).exists()  # a lock file it added to an empty directory goes


def test_an_out_folder_is_held_while_a_command_writes_into_it(real_dataset, tmp_path, capsys):
    with rundir.writing_into(tmp_path / "out", "export") as out_dir:
        assert rundir.is_live(out_dir) == (str(os.getpid()), "export")
        code = cli.main(["bench", "--quick", "--out", str(out_dir), "--json"])  # refused before it measures
        error = json.loads(capsys.readouterr().out)["error"]
        assert code == 1 and error["kind"] == "busy"
        assert error["message"] == (f"fashionjax bench: {out_dir}: in use by an export (pid {os.getpid()}); "
                                    "wait for it to finish or choose another --out")
    assert list((tmp_path / "out").iterdir()) == []  # the lock goes with the command that added it


def test_a_run_dir_held_by_a_report_is_named_as_such(tmp_path, synthetic_cli, capsys):
    run_dir = tmp_path / "run"
    assert tiny_run(run_dir) == 0
    capsys.readouterr()
    owner = rundir.RunDir.claim(run_dir, "--out", "report")  # a report being written into it
    try:
        for argv, flag in ((["train", "--resume", "--run-dir", str(run_dir)], "--run-dir"),
                           (["report", str(run_dir)], "--out")):
            assert cli.main([*argv, "--json"]) == 1
            error = json.loads(capsys.readouterr().out)["error"]
            assert error["kind"] == "busy" and error["message"] == (
                f"fashionjax {argv[0]}: {run_dir}: in use by a report being written (pid {os.getpid()}); "
                f"wait for it to finish or choose another {flag}")
    finally:
        owner.release()
    assert cli.main(["report", str(run_dir), "--json"]) == 0  # free again


@pytest.mark.slow
def test_overwrite_replaces_a_run_and_never_a_users_file(tmp_path, synthetic_cli, capsys):
    run_dir = tmp_path / "run"
    assert tiny_run(run_dir) == 0
    first = artifacts.read_json(run_dir / "summary.json")["params_digest"]
    written = set(rundir.read_manifest(run_dir))
    assert {"config.json", "summary.json", "checkpoints", "metrics.jsonl", "report.html"} <= written

    (run_dir / "notes.txt").write_text("mine")
    assert tiny_run(run_dir, "--overwrite", "--seed", "1") == 2
    assert "notes.txt" in capsys.readouterr().err
    assert (run_dir / "notes.txt").read_text() == "mine"
    assert artifacts.read_json(run_dir / "summary.json")["params_digest"] == first  # untouched

    (run_dir / "notes.txt").unlink()
    assert tiny_run(run_dir, "--overwrite", "--seed", "1") == 0
    assert artifacts.read_json(run_dir / "summary.json")["params_digest"] != first


def test_overwrite_refuses_a_directory_that_is_not_a_run(tmp_path, synthetic_cli, capsys):
    folder = tmp_path / "photos"
    folder.mkdir()
    (folder / "holiday.jpg").write_bytes(b"\xff\xd8")
    assert tiny_run(folder, "--overwrite") == 2
    err = capsys.readouterr().err
    assert "not a fashionjax run directory" in err and "holiday.jpg" in err
    assert sorted(p.name for p in folder.iterdir()) == ["holiday.jpg"]


@pytest.mark.slow
def test_overwrite_with_a_bad_flag_or_missing_data_touches_nothing(tmp_path, synthetic_cli, monkeypatch, capsys):
    run_dir = tmp_path / "run"
    assert tiny_run(run_dir) == 0
    before = {p.name: p.stat().st_mtime_ns for p in run_dir.iterdir() if p.name != rundir.LOCK}
    assert tiny_run(run_dir, "--overwrite", "--lr", "-1") == 2
    assert tiny_run(run_dir, "--overwrite", "--batch-size", "100000") == 2  # known only once data is loaded

    def no_data(*args, **kwargs):
        raise data.DataError("Fashion-MNIST not found offline")

    monkeypatch.setattr(data, "load", no_data)
    assert tiny_run(run_dir, "--overwrite") == 1
    after = {p.name: p.stat().st_mtime_ns for p in run_dir.iterdir() if p.name != rundir.LOCK}
    assert after == before


def test_a_failed_start_leaves_no_directory_behind(tmp_path, monkeypatch, capsys):
    def no_data(*args, **kwargs):
        raise data.DataError("Fashion-MNIST not found offline")

    monkeypatch.setattr(data, "load", no_data)
    assert tiny_run(tmp_path / "new") == 1
    assert not (tmp_path / "new").exists()


# ---------------------------------------------------------------- keys and plan


@pytest.mark.parametrize("seed", [0, 1, 12345, config.MAX_SEED])
def test_init_data_and_augmentation_streams_differ(seed):
    keys = {purpose: tuple(np.asarray(jax.random.key_data(k)).tolist()) for purpose, k in plan.root_keys(seed).items()}
    assert set(keys) == {"init", "data", "augment", "flips"} and len(set(keys.values())) == 4
    # The old derivation's collision: the augmentation key was fold_in(root, 1) == split(root)[1].
    folded = tuple(np.asarray(jax.random.key_data(jax.random.fold_in(jax.random.key(seed), 1))).tolist())
    assert keys["augment"] != keys["data"] and folded not in (keys["augment"],)


def test_plan_resolves_geometry_once():
    resolved = plan.resolve(config.TrainConfig(epochs=3, batch_size=512, log_every=25), num_examples=60000,
                            device_count=4)
    assert (resolved.steps_per_epoch, resolved.dropped_per_epoch, resolved.total_steps) == (117, 96, 351)
    assert resolved.checkpoint_every == 117 and resolved.schedule_steps == 351
    assert resolved.perms_per_chunk == 2  # a 25-step chunk touches at most two epochs' orders
    capped = plan.resolve(config.TrainConfig(steps=7, epochs=None, batch_size=100, log_every=10**9), num_examples=1000)
    assert capped.log_every == 7 and capped.perms_per_chunk == 2


@pytest.mark.slow
def test_absurd_log_every_is_capped_to_the_run(tmp_path, synthetic_cli):
    assert cli.main(["train", "--steps", "7", "--batch-size", "64", "--log-every", str(10**12), "--quiet",
                     "--run-dir", str(tmp_path / "run")]) == 0
    assert [r["step"] for r in artifacts.read_jsonl(tmp_path / "run" / "metrics.jsonl")] == [7]


# ---------------------------------------------------------------- errors that answer


@pytest.mark.parametrize("args,needle", [
    (["train", "--devices", "abc"], "--devices"),
    (["train", "--seed", str(2**32)], "--seed must be between 0 and 4294967295"),
    (["train", "--seed", "-1"], "--seed must be between"),
    (["train", "--lr", "fast"], "--lr"),
    (["train", "--momentum", "1"], "--momentum must be in [0, 1), got 1.0"),
    (["train", "--resume", "--overwrite"], "contradict each other"),
    (["bench", "--batch-sizes", ""], "--batch-sizes"),
    (["bench", "--batch-sizes", "64,,128"], "--batch-sizes"),
    (["bench", "--batch-sizes", "a,b"], "--batch-sizes"),
    (["bench", "--dtypes", ""], "--dtypes"),
    (["bench", "--dtypes", "float32,int4"], "unknown dtype 'int4'"),
    (["bench", "--devices", "99"], "--devices 99"),
    (["bench", "--devices", "0"], "--devices"),
    (["frobnicate"], "invalid choice"),
    (["train", "--bogus"], "fashionjax train: unrecognized arguments: --bogus"),  # named by its subcommand
    (["speedrun", "--epoch", "3"], "fashionjax speedrun: unrecognized arguments: --epoch 3"),
])
def test_bad_flags_exit_2_with_one_json_document_and_no_files(tmp_path, args, needle):
    result = fashionjax(*args, "--json", "--out" if args[0] == "bench" else "--run-dir", str(tmp_path / "out"),
                        cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    (line,) = lines(result.stderr)
    assert needle in line and "Traceback" not in result.stderr
    assert line.startswith("fashionjax") and "fashionjax: fashionjax" not in line  # named once
    document = json.loads(result.stdout)
    assert document["error"]["exit_code"] == 2 and document["error"]["kind"] == "usage"
    assert needle in document["error"]["message"]
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no run dir, no runs/


def test_a_folder_that_is_not_a_run_is_refused_before_jax_loads(tmp_path):
    """eval, predict and export of a folder that is not a run refuse it without importing JAX, orbax or
    matplotlib: the line comes in a fraction of a second, not after seconds of imports."""
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "notes.txt").write_text("mine")
    cases = [(["eval", str(tmp_path / "used")], 2, "not a run directory"),
             (["predict", str(tmp_path / "used"), "x.png"], 2, "not a run directory"),
             (["export", str(tmp_path / "used"), "--out", str(tmp_path / "x")], 2, "not a run directory")]
    probe = ("import json, sys; from fashionjax import cli; code = cli.main(sys.argv[1:]); "
             "print(json.dumps([code, sorted({'jax', 'orbax', 'matplotlib'} & set(sys.modules))]))")
    for argv, code, needle in cases:
        result = subprocess.run([sys.executable, "-c", probe, *argv], capture_output=True, text=True, timeout=60)
        assert json.loads(result.stdout.splitlines()[-1]) == [code, []], result.stderr
        assert needle in result.stderr


def test_no_command_names_the_commands(capsys):
    assert cli.main([]) == 2
    (line,) = lines(capsys.readouterr().err)
    assert line.startswith("fashionjax: no command given; choose one of doctor, data, train,")
    assert cli.main(["--json"]) == 2  # a --json with no command is still answered in JSON
    assert json.loads(capsys.readouterr().out)["error"]["kind"] == "usage"


@pytest.mark.parametrize("command", [["data"], ["bench"], ["speedrun"], ["export", "{run}"]])
def test_an_out_that_is_a_file_is_named_and_kept(finished_run, tmp_path, synthetic_cli, capsys, command):
    blocker = tmp_path / "results"
    blocker.write_text("the user's notes")
    argv = [arg.replace("{run}", str(finished_run)) for arg in command]
    assert cli.main([*argv, "--out", str(blocker), "--json"]) == 1
    error = json.loads(capsys.readouterr().out)["error"]
    assert error["message"] == f"fashionjax {command[0]}: {blocker}: exists and is not a directory"
    assert blocker.read_text() == "the user's notes"


@pytest.mark.parametrize("command", [["data"], ["bench"], ["speedrun"], ["export", "{run}"]])
def test_an_out_that_is_a_run_directory_is_refused_untouched(finished_run, synthetic_cli, capsys, command):
    before = sorted(p.name for p in finished_run.iterdir())
    argv = [arg.replace("{run}", str(finished_run)) for arg in command]
    assert cli.main([*argv, "--out", str(finished_run), "--json"]) == 1
    error = json.loads(capsys.readouterr().out)["error"]
    assert error["message"] == f"fashionjax {command[0]}: {finished_run}: is a training's run directory; choose another --out"
    assert sorted(p.name for p in finished_run.iterdir()) == before


@pytest.mark.parametrize("command", [["eval", "{folder}"], ["report", "{folder}"], ["predict", "{folder}", "x.png"],
                                     ["export", "{folder}", "--out", "{tmp}/x"], ["train", "--resume", "--run-dir", "{folder}"]])
def test_a_folder_of_runs_given_as_a_run_names_the_runs_inside(finished_run, tmp_path, synthetic_cli, capsys, command):
    folder = tmp_path / "record"
    for seed in (0, 1):
        shutil.copytree(finished_run, folder / f"seed-{seed}")
    (folder / "speedrun.json").write_text("{}")
    argv = [arg.replace("{folder}", str(folder)).replace("{tmp}", str(tmp_path)) for arg in command]
    assert cli.main([*argv, "--json"]) == 2
    assert json.loads(capsys.readouterr().out)["error"]["message"] == (
        f"fashionjax {command[0]}: {folder}: not a run directory (no config.json); it holds the runs seed-0, seed-1: "
        "name one of them")


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs Linux's /dev/full")
def test_a_json_document_that_cannot_be_written_is_a_failure_said_on_stderr(finished_run, tmp_path):
    """Under exit 0 a script would read nothing; a closed reader (a broken pipe) stays a success."""
    page = tmp_path / "report.html"
    with open("/dev/full", "w") as full:  # every write fails with ENOSPC, as on a full disk
        done = subprocess.run([sys.executable, "-m", "fashionjax", "report", str(finished_run), "--out", str(page),
                               "--json"], stdout=full, stderr=subprocess.PIPE, text=True, timeout=120)
    assert done.returncode == 1
    assert lines(done.stderr)[-1] == (f"fashionjax report: the JSON document could not be written to stdout "
                                      f"({os.strerror(28)}); the work itself is done")
    assert page.is_file()


def test_a_write_that_fails_part_way_names_the_file_and_leaves_no_temp(finished_run, tmp_path):
    """A real short write (a file-size limit, as on a full disk): the message names the file asked for,
    not a temp name or none, and nothing half-written stays."""
    target = tmp_path / "out" / "report.html"
    command = [sys.executable, "-m", "fashionjax", "report", str(finished_run), "--out", str(target), "--json"]
    done = subprocess.run(file_size_limited(command, 20),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    error = json.loads(done.stdout)["error"]
    assert error["kind"] == "io"
    assert error["message"] == f"fashionjax report: [Errno 27] {os.strerror(27)}: '{target}'"
    assert list(target.parent.iterdir()) == []


def test_run_file_writes_name_their_file_whatever_step_fails(tmp_path, monkeypatch):
    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    target = tmp_path / "summary.json"
    for step in ("mkstemp", "fsync", "replace"):
        with monkeypatch.context() as patch:
            patch.setattr(artifacts.tempfile if step == "mkstemp" else artifacts.os, step, full_disk)
            with pytest.raises(OSError) as raised:
                artifacts.atomic_write_json(target, {"a": 1})
        assert (raised.value.errno, raised.value.filename) == (28, str(target)), step
        assert list(tmp_path.iterdir()) == [], step
    monkeypatch.setattr(artifacts.os, "fsync", full_disk)
    with pytest.raises(OSError) as raised:
        artifacts.append_jsonl(tmp_path / "metrics.jsonl", [{"step": 1}])
    assert raised.value.filename == str(tmp_path / "metrics.jsonl")


def test_commands_sharing_an_out_both_find_it_writable(tmp_path):
    # each probe is its own file: one command's cleanup never removes another's probe mid-check
    failures: list[str] = []
    barrier = threading.Barrier(8)

    def probe():
        barrier.wait()
        for _ in range(200):
            try:
                artifacts.ensure_dir(tmp_path / "shared")
            except artifacts.OutputDirError as err:
                failures.append(str(err))

    threads = [threading.Thread(target=probe) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []
    assert list((tmp_path / "shared").iterdir()) == []


def test_json_errors_name_the_broken_file(finished_run, tmp_path, synthetic_cli, capsys):
    run_dir = tmp_path / "run"
    shutil.copytree(finished_run, run_dir)
    (run_dir / "metrics.jsonl").write_text('{"step": 3}\n{"step": 6, "lo\n{"step": 9}\n')
    capsys.readouterr()
    assert cli.main(["report", str(run_dir), "--json"]) == 1
    assert "metrics.jsonl: line 2 is not valid JSON" in json.loads(capsys.readouterr().out)["error"]["message"]

    bench_json = tmp_path / "bench" / "bench.json"
    bench_json.parent.mkdir()
    bench_json.write_text("{not json")
    assert cli.main(["report", str(run_dir), "--bench", str(bench_json)]) == 1
    assert f"{bench_json}: not valid JSON" in capsys.readouterr().err

    (run_dir / "config.json").write_text('{"config": ')
    assert cli.main(["eval", str(run_dir)]) == 1
    assert "config.json: not valid JSON" in capsys.readouterr().err


@pytest.mark.parametrize("document, fragment", [
    ([1, 2], 'not a config.json that fashionjax wrote (no "config" object'),
    ({"config": "mlp"}, 'not a config.json that fashionjax wrote (no "config" object'),
    (None, "its config does not fit this version of fashionjax (TrainConfig.__init__() got an unexpected "
           "keyword argument 'warp_drive')")])
def test_a_config_json_of_another_shape_is_named_by_every_reader(finished_run, tmp_path, synthetic_cli, capsys,
                                                                  document, fragment):
    run_dir = tmp_path / "run"
    shutil.copytree(finished_run, run_dir)
    if document is None:  # a run of a later version, whose config has a field this one lacks
        document = json.loads((run_dir / "config.json").read_text())
        document["config"]["warp_drive"] = 1
    (run_dir / "config.json").write_text(json.dumps(document))
    picture = tmp_path / "picture.png"
    Image.fromarray(np.full((28, 28), 200, np.uint8)).save(picture)
    capsys.readouterr()
    for command in (["eval", str(run_dir)], ["report", str(run_dir)], ["predict", str(run_dir), str(picture)],
                    ["export", str(run_dir), "--format", "safetensors", "--out", str(tmp_path / "x")]):
        assert cli.main([*command, "--json"]) == 1, command
        error = json.loads(capsys.readouterr().out)["error"]
        assert error["kind"] == "file" and f"{run_dir / 'config.json'}: {fragment}" in error["message"], error


def test_a_run_of_another_model_version_is_named_as_such(finished_run, tmp_path, synthetic_cli, monkeypatch, capsys):
    # A run trained before its model changed shape (as the speedrun model did): its checkpoints are
    # whole, of another network; one line says so instead of calling every checkpoint damaged
    run_dir = tmp_path / "run"
    shutil.copytree(finished_run, run_dir)
    before = {path: path.read_bytes() for path in run_dir.rglob("*") if path.is_file()}
    monkeypatch.setattr(models, "MLP_WIDTHS", (784, 128, 128, 10))
    capsys.readouterr()
    for command in (["eval", str(run_dir), "--json"], ["train", "--resume", "--run-dir", str(run_dir), "--json"]):
        assert cli.main(command) == 1
        error = json.loads(capsys.readouterr().out)["error"]
        assert error["kind"] == "checkpoint", error
        assert "trained by another version of the model (parameter [" in error["message"]
        assert "\n" not in error["message"]
    assert {path: path.read_bytes() for path in run_dir.rglob("*") if path.is_file()} == before


@pytest.mark.parametrize("chart", ["../secret.png", "/etc/passwd", "sub/../../x.png", "notes.txt"])
def test_report_includes_only_charts_beside_bench_json(finished_run, tmp_path, chart, capsys):
    run_dir = finished_run
    (tmp_path / "secret.png").write_bytes(b"\x89PNG secret")
    bench_json = tmp_path / "bench" / "bench.json"
    bench_json.parent.mkdir()
    bench_json.write_text(json.dumps({"charts": [chart], "cases": []}))
    assert cli.main(["report", str(run_dir), "--bench", str(bench_json)]) == 1
    assert str(bench_json) in capsys.readouterr().err
    with pytest.raises(render.ReportError):
        render.load_bench(run_dir, bench_json)


@pytest.mark.parametrize("manifest", ["[]", '{"fingerprint": 3}', '{"digests": []}', "not json", '"text"'])
def test_a_malformed_decoded_cache_is_rebuilt_with_a_note(synthetic_files, manifest):
    directory, spec = synthetic_files
    notes: list[str] = []
    first = data.load(directory, spec=spec)
    data.load(spec=dataclasses.replace(spec, system_dir=directory))  # fills the decoded cache
    decoded = data.cache_root() / "decoded" / f"{spec.cache_name}-{data._fingerprint(spec)}"
    assert (decoded / "manifest.json").is_file()
    (decoded / "manifest.json").write_text(manifest)
    again = data.load(spec=dataclasses.replace(spec, system_dir=directory), log=notes.append)
    np.testing.assert_array_equal(again.train.images_u8, first.train.images_u8)
    assert len(notes) == 1 and "rebuilding it from the verified source" in notes[0]
    assert data._load_decoded(decoded, spec)[0] is not None  # and the rebuilt cache is good again


def test_a_cached_array_of_the_wrong_shape_is_rebuilt(synthetic_files):
    directory, spec = synthetic_files
    spec = dataclasses.replace(spec, system_dir=directory)
    data.load(spec=spec)
    decoded = data.cache_root() / "decoded" / f"{spec.cache_name}-{data._fingerprint(spec)}"
    manifest = json.loads((decoded / "manifest.json").read_text())
    images = np.zeros((64, 14, 56), np.uint8)  # the right bytes count, the wrong shape, a matching digest
    buffer = io.BytesIO()
    np.save(buffer, images)
    (decoded / "train-images.npy").write_bytes(buffer.getvalue())
    manifest["digests"]["train-images"] = hashlib.sha256(buffer.getvalue()).hexdigest()
    (decoded / "manifest.json").write_text(json.dumps(manifest))
    notes: list[str] = []
    assert data.load(spec=spec, log=notes.append).train.images_u8.shape == (64, 28, 28)
    assert "wrong shape" in notes[0]


# ---------------------------------------------------------------- help and progress


@pytest.mark.parametrize("command", sorted(cli.COMMANDS))
def test_help_has_a_line_per_flag(command):
    parser = cli.build_parser()
    sub = parser._subparsers._group_actions[0].choices[command]
    for action in sub._actions:
        assert action.help, f"{command} {action.option_strings} has no help"


@pytest.mark.parametrize("model,lr", [("mlp", "0.003"), ("cnn", "0.002")])
def test_train_help_shows_the_chosen_models_recipe(model, lr, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "300")
    assert cli.main(["train", "--model", model, "--help"]) == 0
    text = capsys.readouterr().out
    assert f"peak learning rate (default: {lr})" in text
    assert f"Defaults shown are the {model} recipe's" in " ".join(text.split())


@pytest.mark.slow
def test_progress_is_one_plain_line_per_log_point_off_a_terminal(tmp_path, synthetic_cli, capsys):
    assert cli.main(["train", "--steps", "9", "--batch-size", "64", "--log-every", "3",
                     "--run-dir", str(tmp_path / "a")]) == 0
    err = capsys.readouterr().err
    progress = [line for line in err.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in progress] == ["3/9", "6/9", "9/9"]
    assert all("loss" in line and "examples/sec" in line and "epoch" in line for line in progress)
    assert "\x1b" not in err
    assert cli.main(["train", "--steps", "9", "--batch-size", "64", "--log-every", "3", "--quiet",
                     "--run-dir", str(tmp_path / "b")]) == 0
    assert "step " not in capsys.readouterr().err


def test_summary_reports_train_seconds_apart_from_compile(finished_run):
    summary = artifacts.read_json(finished_run / "summary.json")
    assert 0 < summary["train_seconds"] <= summary["wall_seconds"]
    assert summary["compile_seconds"] > 0 and summary["train_examples_per_sec"] > 0


def test_report_shows_what_unset_settings_mean(finished_run):
    html = (finished_run / "report.html").read_text()
    assert "(default)" not in html and ">None<" not in html
    assert "(set by steps)" in html and ">off<" in html  # epochs of a --steps run; clip norm unset


def test_write_synthetic_files_still_cover_the_cli(tmp_path):
    write_synthetic_files(tmp_path / "fashion")  # valid IDX, foreign checksums: a clean exit 1
    result = fashionjax("data", "--data-dir", str(tmp_path / "fashion"), "--json", "--out", str(tmp_path / "o"))
    assert result.returncode == 1 and json.loads(result.stdout)["error"]["kind"] == "data"


def tree_snapshot(root: Path) -> dict:
    return {str(p.relative_to(root)): (p.stat().st_mtime_ns, p.stat().st_size) for p in root.rglob("*")}


def test_eval_writes_nothing_into_the_run(finished_run, tmp_path, synthetic_cli, capsys):
    run_dir = tmp_path / "run"
    shutil.copytree(finished_run, run_dir)
    before = tree_snapshot(run_dir)
    assert cli.main(["eval", str(run_dir), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["step"] == 6
    assert tree_snapshot(run_dir) == before
    assert cli.main(["report", str(run_dir), "--out", str(tmp_path / "elsewhere.html")]) == 0
    assert tree_snapshot(run_dir) == before and (tmp_path / "elsewhere.html").is_file()


def test_overwrite_takes_a_run_killed_before_config_json(tmp_path):
    owned = rundir.RunDir.claim(tmp_path / "run")
    owned.file("samples.png").write_bytes(b"png")
    (owned.file("checkpoints") / "tmp-step").mkdir(parents=True)
    owned.release()  # as if killed: no config.json, no checkpoint
    again = rundir.RunDir.claim(tmp_path / "run")
    with pytest.raises(config.ConfigError, match="not empty"):
        again.check_new_run(overwrite=False)
    again.check_new_run(overwrite=True)
    again.clear()
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [rundir.LOCK]
    (tmp_path / "run" / "mine.txt").write_text("x")
    with pytest.raises(config.ConfigError, match="mine.txt"):
        again.check_new_run(overwrite=True)
    again.release()


def test_main_runs_from_a_worker_thread(capsys):
    """Only the main thread may set signal handlers: main() elsewhere still answers."""
    codes = []
    worker = threading.Thread(target=lambda: codes.append(cli.main(["train", "--lr", "0", "--json"])))
    worker.start()
    worker.join()
    assert codes == [2] and json.loads(capsys.readouterr().out)["error"]["kind"] == "usage"
