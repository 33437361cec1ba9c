"""Many models in one program: `train --seeds N`, each member the single run of its seed, the spread
and the ensemble."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import jax
import numpy as np
import pytest
from test_distributed import completed, train_process

from fashionjax import artifacts, cli, evaluate, train
from fashionjax import run as run_lib
from fashionjax.plan import Plan


def run_json(capsys, *argv) -> dict:
    code = cli.main(["train", *argv, "--json", "--quiet"])
    document = json.loads(capsys.readouterr().out)
    assert code == 0, document
    return document


# Other seeds than the defaults, flips from their own key streams, and a model with batch norm scored
# with TTA's shifted views (each member's own, inside the members' vmap).
RECIPES = {
    "mlp": ["--steps", "24", "--log-every", "8", "--batch-size", "64", "--augment", "--alternate-flips"],
    "speedrun": ["--model", "speedrun", "--steps", "6", "--log-every", "3", "--batch-size", "32", "--tta-shift", "1"],
}


@pytest.mark.parametrize("recipe", RECIPES)
def test_each_member_matches_the_single_run_of_its_seed(recipe, synthetic_cli, small_speedrun, tmp_path, capsys):
    flags = RECIPES[recipe]
    together = run_json(capsys, *flags, "--seed", "7", "--seeds", "3", "--run-dir", str(tmp_path / "together"))
    records = artifacts.read_jsonl(tmp_path / "together" / "metrics.jsonl")
    assert together["seeds"] == 3 and [row["seed"] for row in together["per_seed"]] == [7, 8, 9]
    for i, seed in enumerate((7, 8, 9)):
        alone = run_json(capsys, *flags, "--seed", str(seed), "--run-dir", str(tmp_path / f"alone{seed}"))
        alone_records = artifacts.read_jsonl(tmp_path / f"alone{seed}" / "metrics.jsonl")
        member = together["per_seed"][i]
        assert member["test_accuracy"] == alone["test_accuracy"]
        if jax.default_backend() == "cpu":  # members run one after another there: the very same computation
            assert member["params_digest"] == alone["params_digest"]
        assert member["test_loss"] == pytest.approx(alone["test_loss"], rel=1e-4)
        assert [r["member_loss"][i] for r in records] == pytest.approx([r["loss"] for r in alone_records], rel=1e-5)
    accuracies = [row["test_accuracy"] for row in together["per_seed"]]
    assert together["test_accuracy"] == pytest.approx(np.mean(accuracies), abs=1e-12)
    assert together["test_accuracy_std"] == pytest.approx(np.std(accuracies, ddof=1), abs=1e-12)
    assert 0 < together["ensemble_test_accuracy"] <= 1 and together["diverged_seeds"] == []
    evaluation = artifacts.read_json(tmp_path / "together" / "eval.json")
    assert evaluation["accuracy"] == together["ensemble_test_accuracy"] and len(evaluation["members"]) == 3
    assert (tmp_path / "together" / "members.png").is_file()
    page = (tmp_path / "together" / "report.html").read_text()
    assert "3 models trained together" in page and "Each member's test accuracy" in page


def test_predict_and_export_of_a_multi_model_run_use_the_ensemble(synthetic_cli, tmp_path, capsys):
    from PIL import Image

    from fashionjax import export
    from fashionjax import run as run_lib

    run_json(capsys, "--steps", "10", "--log-every", "5", "--batch-size", "64", "--seeds", "2",
             "--run-dir", str(tmp_path / "run"))
    images = synthetic_cli.test.images_u8[:5]
    for k, image in enumerate(images):
        Image.fromarray(image).save(tmp_path / f"{k}.png")
    code = cli.main(["predict", str(tmp_path / "run"), *[str(tmp_path / f"{k}.png") for k in range(5)],
                     "--top-k", "10", "--json"])
    rows = json.loads(capsys.readouterr().out)["predictions"]
    trained = run_lib.load_trained(tmp_path / "run")
    members = [evaluate.classifier("mlp", params) for params in train.unstack(trained.params, 2)]
    scaled = images.astype(np.float32) / 255
    expected = np.mean([np.exp(np.asarray(m(scaled)) - np.log(np.exp(np.asarray(m(scaled))).sum(-1, keepdims=True)))
                        for m in members], axis=0)  # the mean of the two members' softmax probabilities
    assert code == 0
    for row, probs in zip(rows, expected, strict=True):
        got = {t["label"]: t["probability"] for t in row["top_k"]}
        assert [got[k] for k in range(10)] == pytest.approx(probs, abs=1e-6)
    code = cli.main(["export", str(tmp_path / "run"), "--format", "stablehlo", "--out", str(tmp_path / "x"),
                     "--json", "--quiet"])
    assert code == 0 and json.loads(capsys.readouterr().out)["artifacts"]["stablehlo"]["differing_labels"] == 0
    logits = np.asarray(export.load(tmp_path / "x" / "model.stablehlo")(scaled))
    assert np.exp(logits) == pytest.approx(expected, abs=1e-6)


def test_one_model_of_a_sweep_is_evaluated_predicted_and_exported_as_its_own_run(synthetic_cli, tmp_path, capsys):
    from PIL import Image

    from fashionjax import export

    run_dir = str(tmp_path / "run")
    summary = run_json(capsys, "--steps", "10", "--log-every", "5", "--batch-size", "64", "--sweep", "lr=1e-3,1e-2",
                       "--seed", "4", "--seeds", "2", "--run-dir", run_dir)
    trained = train.unstack(run_lib.load_trained(run_dir).params, 4)
    images = synthetic_cli.test.images_u8[:6]
    for k, image in enumerate(images):
        Image.fromarray(image).save(tmp_path / f"{k}.png")
    pictures = [str(tmp_path / f"{k}.png") for k in range(6)]
    for member in (0, 2, 3):  # lr 1e-3 seed 4, lr 1e-2 seed 4, lr 1e-2 seed 5: summary.json's per_seed order
        row = summary["per_seed"][member]
        assert cli.main(["eval", run_dir, "--member", str(member), "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
        assert report["member"] == member and "members" not in report  # scored as a run of its own
        assert report["accuracy"] == row["test_accuracy"] and report["params_digest"] == row["params_digest"]
        assert train.params_digest(trained[member]) == row["params_digest"]
        expected = jax.nn.softmax(evaluate.classifier("mlp", trained[member])(images.astype(np.float32) / 255))
        assert cli.main(["predict", run_dir, *pictures, "--top-k", "10", "--member", str(member), "--json"]) == 0
        document = json.loads(capsys.readouterr().out)
        assert document["member"] == member
        for prediction, probs in zip(document["predictions"], np.asarray(expected), strict=True):
            got = {t["label"]: t["probability"] for t in prediction["top_k"]}
            assert [got[k] for k in range(10)] == pytest.approx(probs, abs=1e-6)
        out = tmp_path / f"x{member}"
        assert cli.main(["export", run_dir, "--format", "stablehlo", "--member", str(member), "--out", str(out),
                         "--json"]) == 0
        document = json.loads(capsys.readouterr().out)
        assert document["member"] == member and document["params_digest"] == row["params_digest"]
        saved = json.loads(artifacts.read_json(out / "export.json")["metadata"]["config"])
        assert (saved["seed"], saved["lr"], saved["seeds"], saved["sweep"]) == (4 + member % 2, [1e-3, 1e-2][member // 2], 1, [])
        logits = np.asarray(export.load(out / "model.stablehlo")(images.astype(np.float32) / 255))
        np.testing.assert_allclose(jax.nn.softmax(logits), expected, atol=1e-6)
    # without --member: the ensemble, as before
    assert cli.main(["eval", run_dir, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["member"] is None and report["accuracy"] == summary["ensemble_test_accuracy"]
    # a model the run does not hold: one line naming the flag and the run, exit 2, nothing written
    for command in (["eval", run_dir], ["predict", run_dir, pictures[0]], ["export", run_dir, "--out", str(tmp_path / "y")]):
        for member in ("4", "-1"):
            assert cli.main([*command, "--member", member, "--json"]) == 2
            message = json.loads(capsys.readouterr().out)["error"]["message"]
            assert message == f"fashionjax {command[0]}: --member {member}: {run_dir} holds 4 models, numbered 0-3"
    assert not (tmp_path / "y").exists()


def test_the_ensemble_averages_probabilities_not_accuracies_or_votes():
    labels = np.array([0, 1, 2])
    # Three members, three examples. Member accuracies 2/3, 2/3 and 1/3 (mean 5/9); majority vote
    # would get example 2 wrong; the mean probabilities get all three right.
    probs = np.array([
        [[0.6, 0.4, 0.0], [0.0, 0.9, 0.1], [0.0, 0.6, 0.4]],
        [[0.9, 0.1, 0.0], [0.0, 0.5, 0.5], [0.6, 0.0, 0.4]],  # example 1 a tie: argmax takes label 1
        [[0.4, 0.6, 0.0], [0.2, 0.3, 0.5], [0.0, 0.0, 1.0]],
    ])
    with np.errstate(divide="ignore"):
        scored = evaluate.ensemble(np.log(probs), probs.argmax(-1), labels, [5, 6, 7])
    members = scored["report"]["members"]
    assert [m["test_accuracy"] for m in members] == pytest.approx([2 / 3, 2 / 3, 1 / 3])
    assert scored["report"]["accuracy"] == 1.0  # mean probabilities: [.633 .333 0], [.067 .567 .367], [.2 .2 .6]
    assert list(scored["predictions"]) == [0, 1, 2]
    assert scored["report"]["loss"] == pytest.approx(-np.mean(np.log([1.9 / 3, 1.7 / 3, 1.8 / 3])))


def test_a_diverged_member_is_left_out_and_the_others_keep_their_figures():
    plan = Plan(batch_size=8, num_examples=64, device_count=1, steps_per_epoch=8, dropped_per_epoch=0,
                total_steps=16, schedule_steps=16, log_every=4, checkpoint_every=8, perms_per_chunk=2, seed=3,
                members=3)
    losses = np.array([[1.0, 0.8, 0.6, 0.4], [1.0, np.nan, np.nan, np.nan], [2.0, 1.8, 1.6, 1.4]])
    metrics = {"loss": losses, "accuracy": np.full((3, 4), 0.5), "grad_norm": np.ones((3, 4))}
    record, healthy = train.log_record(metrics, np.ones(3, bool), 4, 8, plan, 2.0, 5.0)
    assert list(healthy) == [True, False, True] and record["diverged_members"] == [1]
    assert record["loss"] == pytest.approx((0.7 + 1.7) / 2)  # the finite members' mean
    assert record["examples_per_sec"] == 4 * 8 * 3 / 2.0  # model-examples
    log_probs = np.log(np.full((3, 2, 10), 0.1))
    log_probs[1] = np.nan
    scored = evaluate.ensemble(log_probs, np.zeros((3, 2), int), np.array([0, 1]), [3, 4, 5])
    assert scored["report"]["ensemble_members"] == 2 and [m["finite"] for m in scored["report"]["members"]] == [
        True, False, True]


@pytest.mark.slow
def test_a_multi_model_run_killed_and_resumed_is_bit_identical(real_dataset, tmp_path):
    from conftest import wait_for
    from test_resilience import finalized

    flags = ["--seeds", "2", "--steps", "240", "--batch-size", "1024", "--log-every", "10", "--offline"]

    def train_json(*extra) -> dict:
        result = subprocess.run([sys.executable, "-m", "fashionjax", "train", *extra, "--json", "--quiet"],
                                capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)

    expected = train_json(*flags, "--run-dir", str(tmp_path / "reference"))
    run_dir = tmp_path / "run"
    process = subprocess.Popen([sys.executable, "-m", "fashionjax", "train", *flags, "--run-dir", str(run_dir)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    steps = lambda path: [r["step"] for r in artifacts.read_jsonl(path / "metrics.jsonl")]  # noqa: E731
    wait_for(lambda: finalized(run_dir, 60)() and max(steps(run_dir)) >= 70, process)  # mid-way, past a checkpoint
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=30)
    got = train_json("--resume", "--run-dir", str(run_dir), "--offline")
    assert got["params_digest"] == expected["params_digest"]
    assert [m["params_digest"] for m in got["per_seed"]] == [m["params_digest"] for m in expected["per_seed"]]
    assert steps(run_dir) == steps(tmp_path / "reference")


@pytest.mark.multiprocess
def test_members_on_four_devices_equal_one_device(real_dataset, tmp_path):
    one, four = (train_process(tmp_path / f"run{n}", n, "--seeds", "2", "--seed", "5") for n in (1, 4))
    one_summary, four_summary = completed(one), completed(four)
    assert four_summary["device_count"] == 4
    one_records, four_records = (artifacts.read_jsonl(tmp_path / f"run{n}" / "metrics.jsonl") for n in (1, 4))
    for a, b in zip(one_records, four_records, strict=True):
        assert b["member_loss"] == pytest.approx(a["member_loss"], rel=1e-5)
    for a, b in zip(one_summary["per_seed"], four_summary["per_seed"], strict=True):
        assert b["test_accuracy"] == pytest.approx(a["test_accuracy"], abs=3e-4)  # a flip or three at most


def test_a_sweep_puts_each_members_values_in_its_optimizer_state(synthetic_cli, tmp_path, capsys):
    from fashionjax import checkpoint, config

    run_dir = tmp_path / "sweep"
    summary = run_json(capsys, "--steps", "12", "--log-every", "4", "--batch-size", "64", "--sweep", "lr=1e-3,3e-3",
                       "--sweep", "weight-decay=0,1e-4", "--run-dir", str(run_dir))
    saved = config.TrainConfig(**artifacts.read_json(run_dir / "config.json")["config"])
    assert saved.sweep == (("lr", (1e-3, 3e-3)), ("weight_decay", (0.0, 1e-4)))
    _, state, _ = checkpoint.read_latest(run_dir / "checkpoints", train.initial_state(saved, 12))
    hyper = state.opt_state.hyperparams
    assert np.asarray(hyper["lr"]).tolist() == pytest.approx([1e-3, 1e-3, 3e-3, 3e-3])
    assert np.asarray(hyper["weight_decay"]).tolist() == pytest.approx([0, 1e-4, 0, 1e-4])
    assert [(row["lr"], row["weight_decay"]) for row in summary["sweep"]] == [(1e-3, 0), (1e-3, 1e-4), (3e-3, 0),
                                                                             (3e-3, 1e-4)]
    assert summary["best"] == max(summary["sweep"], key=lambda row: row["test_accuracy"])
    assert all(row["test_examples"] == 500 for row in summary["sweep"]) and (run_dir / "sweep.png").is_file()
    # the member with the recipe's own values trains as the single run does, to float tolerance
    alone = run_json(capsys, "--steps", "12", "--log-every", "4", "--batch-size", "64", "--run-dir",
                     str(tmp_path / "alone"))
    assert summary["sweep"][3]["test_accuracy"] == pytest.approx(alone["test_accuracy"], abs=2e-3)
    records = artifacts.read_jsonl(run_dir / "metrics.jsonl")
    alone_records = artifacts.read_jsonl(tmp_path / "alone" / "metrics.jsonl")
    assert [r["member_loss"][3] for r in records] == pytest.approx([r["loss"] for r in alone_records], rel=1e-4)
    assert [r["member_lr"][3] for r in records] == pytest.approx([r["lr"] for r in alone_records], rel=1e-6)


def test_a_diverging_member_is_reported_and_the_others_results_stand(synthetic_cli, tmp_path, capsys):
    summary = run_json(capsys, "--steps", "20", "--log-every", "5", "--batch-size", "64", "--optimizer", "sgd",
                       "--sweep", "lr=0.05,1e5", "--run-dir", str(tmp_path / "run"))
    assert [row["diverged"] for row in summary["sweep"]] == [False, True]
    assert summary["ensemble_members"] == 1 and summary["best"]["lr"] == 0.05
    assert summary["test_accuracy"] == summary["sweep"][0]["test_accuracy"] > 0.5
    # the diverged model alone is refused in one line; the other is scored as the run's ensemble of one
    assert cli.main(["eval", str(tmp_path / "run"), "--member", "1", "--json"]) == 2
    message = json.loads(capsys.readouterr().out)["error"]["message"]
    assert message == f"fashionjax eval: --member 1: model 1 of {tmp_path / 'run'} diverged (its parameters are not " \
                      "finite); choose another"
    assert cli.main(["eval", str(tmp_path / "run"), "--member", "0", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["accuracy"] == summary["sweep"][0]["test_accuracy"]


@pytest.mark.parametrize("sweep, fragment", [("clip=1,2", "only lr, weight-decay, momentum can be swept"),
                                            ("model=mlp,cnn", "--sweep model: only lr, weight-decay, momentum"),
                                            ("lr=", "expected NAME=V1,V2"), ("lr=1e-3,x", "comma-separated"),
                                            ("lr=1e-3,-1", "learning rate must be a positive"),
                                            ("lr=1e-3,1e-3", "give distinct values")])
def test_bad_sweeps_exit_2_before_anything_is_written(sweep, fragment, tmp_path, capsys):
    code = cli.main(["train", "--sweep", sweep, "--run-dir", str(tmp_path / "run"), "--json"])
    assert code == 2 and fragment in json.loads(capsys.readouterr().out)["error"]["message"]
    assert not (tmp_path / "run").exists()


def test_member_bytes_by_hand_for_the_mlp():
    from fashionjax import capacity, config

    params = 784 * 256 + 256 + 256 * 128 + 128 + 128 * 10 + 10  # 235,146 float32
    # adamw: parameters, mu and nu (3 copies), gradients and updates (2 more); three int32 counters:
    # the step, adam's count and the cosine schedule's count
    assert capacity.member_bytes(config.default("mlp"), 100) == 5 * 4 * params + 3 * 4


def test_too_many_members_are_refused_with_the_largest_count_that_fits(synthetic_cli, tmp_path, capsys, monkeypatch):
    from fashionjax import capacity, config

    per_member = capacity.member_bytes(config.default("mlp"), 100)
    data_bytes = synthetic_cli.train.images_u8.nbytes + synthetic_cli.train.labels.nbytes
    monkeypatch.setattr(capacity, "free_bytes", lambda device: data_bytes + 3 * per_member + 1)
    code = cli.main(["train", "--seeds", "4", "--steps", "5", "--run-dir", str(tmp_path / "run"), "--json"])
    message = json.loads(capsys.readouterr().out)["error"]["message"]
    assert code == 2 and "4 models need about" in message and "at most 3 fit" in message
    assert not (tmp_path / "run").exists()
    assert cli.main(["train", "--seeds", "3", "--steps", "5", "--batch-size", "64", "--run-dir",
                     str(tmp_path / "ok"), "--quiet"]) == 0
