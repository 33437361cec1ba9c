"""The speedrun model's techniques by hand, its determinism and resume, and the speedrun command.
Tests that only drive the network through the trainer train conftest's SMALL_SPEEDRUN in its place."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fashionjax import augment, blend, cli, config, evaluate, layers, models, speedrun, train
from fashionjax.report import render

TINY = config.TrainConfig(model="speedrun", steps=8, batch_size=64, log_every=4, warmup_steps=2,
                          augment=True, max_shift=0, label_smoothing=0.1)


def test_batch_norm_by_hand():
    x = jnp.array([1.0, 3.0, 5.0, 7.0]).reshape(4, 1)  # one channel: mean 4, variance 5
    running = {"mean": jnp.array([2.0]), "var": jnp.array([1.0])}
    y, updated = layers.batch_norm(x, jnp.array([0.5]), running, train=True, momentum=0.9, eps=0.0)
    np.testing.assert_allclose(np.asarray(y[:, 0]), (np.array([1, 3, 5, 7]) - 4) / math.sqrt(5) + 0.5, rtol=1e-6)
    np.testing.assert_allclose(float(updated["mean"][0]), 0.9 * 2 + 0.1 * 4, rtol=1e-6)
    np.testing.assert_allclose(float(updated["var"][0]), 0.9 * 1 + 0.1 * 5, rtol=1e-6)
    y_eval, same = layers.batch_norm(x, jnp.array([0.0]), running, train=False, momentum=0.9, eps=0.0)
    np.testing.assert_allclose(np.asarray(y_eval[:, 0]), [-1, 1, 3, 5])  # (x - 2) / 1: the running statistics
    assert same is running


def test_batch_norm_with_a_trained_scale_by_hand():
    x = jnp.array([1.0, 3.0, 5.0, 7.0]).reshape(4, 1)  # mean 4, variance 5, as above
    running = {"mean": jnp.array([2.0]), "var": jnp.array([1.0])}
    y, _ = layers.batch_norm(x, jnp.array([0.5]), running, train=True, momentum=0.9, eps=0.0, scale=jnp.array([3.0]))
    np.testing.assert_allclose(np.asarray(y[:, 0]), 3 * (np.array([1, 3, 5, 7]) - 4) / math.sqrt(5) + 0.5, rtol=1e-6)
    y_eval, _ = layers.batch_norm(x, jnp.array([0.0]), running, train=False, momentum=0.9, eps=0.0, scale=jnp.array([2.0]))
    np.testing.assert_allclose(np.asarray(y_eval[:, 0]), [-2, 2, 6, 10])  # 2 * (x - 2) / 1


def test_deep_trains_a_scale_in_each_batch_norm_and_speedrun_keeps_it_at_one():
    deep = models.get("deep").init(jax.random.key(0))
    convs = list(deep["stats"])
    assert all(np.array_equal(deep[name]["scale"], np.ones_like(deep[name]["bias"])) for name in convs)
    assert all(train.trained_mask(deep)[name]["scale"] for name in convs)  # the optimizer updates it
    assert not any("scale" in leaf for leaf in models.get("speedrun").init(jax.random.key(0)).values())
    # A scale multiplies each channel after normalization: doubling conv0's changes the logits
    images = jnp.asarray(np.random.default_rng(0).random((4, 784)), jnp.float32)
    doubled = {**deep, "conv0": {**deep["conv0"], "scale": 2 * deep["conv0"]["scale"]}}
    model = models.get("deep")
    assert not np.allclose(np.asarray(model.apply(deep, images)), np.asarray(model.apply(doubled, images)))


def test_odd_and_signed_pooling_by_hand():
    pooled = layers.max_pool2x2(jnp.arange(9.0).reshape(1, 3, 3, 1))
    np.testing.assert_array_equal(np.asarray(pooled[0, :, :, 0]), [[4, 5], [7, 8]])  # the odd edge is kept
    planes = jnp.array([[[[1.0, -2], [3, 0]]], [[[-5.0, 4], [2, 1]]]])  # (K=2, B=1, 2, 2)
    signed = layers.signed_max_pool2x2_planes(planes)
    assert signed.shape == (1, 1, 1, 4)  # channels last: each plane's max, then each negated plane's
    np.testing.assert_array_equal(np.asarray(signed).ravel(), [3, 4, 2, 5])


def test_pooling_gradient_goes_to_each_windows_first_maximum():
    x = jnp.array([[1.0, 7, 5, 5, 0],
                   [7, 2, 5, 5, 0],
                   [3, 0, 2, 2, 9],
                   [1, 4, 2, 2, 9]]).reshape(1, 4, 5, 1)
    upstream = jnp.array([[10.0, 20, 30], [40, 50, 60]]).reshape(1, 2, 3, 1)  # one number per window
    grad = jax.grad(lambda x: jnp.sum(layers.max_pool2x2(x) * upstream))(x)
    # A tie (7 and 7; four 5s; four 2s) sends the whole gradient to the first maximum in row order,
    # not a share to each; a padded odd edge (9 over 9) passes it to the first of its real pixels.
    np.testing.assert_array_equal(np.asarray(grad[0, :, :, 0]), [[0, 10, 20, 0, 30],
                                                                [0, 0, 0, 0, 0],
                                                                [0, 0, 50, 0, 60],
                                                                [0, 40, 0, 0, 0]])
    # Without ties it is the gradient of the maximum itself.
    untied = jax.random.normal(jax.random.key(0), (2, 6, 4, 3))
    np.testing.assert_array_equal(
        np.asarray(jax.grad(lambda x: jnp.sum(layers.max_pool2x2(x) * 1.5))(untied)),
        np.asarray(jax.grad(lambda x: jnp.sum(x.reshape(2, 3, 2, 2, 2, 3).max(axis=(2, 4)) * 1.5))(untied)))
    # The first layer's signed pooling routes each sign's gradient the same way: a uniform plane's
    # maximum and its negation's both sit first in the top-left corner.
    signed_grad = jax.grad(lambda p: jnp.sum(layers.signed_max_pool2x2_planes(p) * jnp.array([1.0, 10.0])))
    np.testing.assert_array_equal(np.asarray(signed_grad(jnp.full((1, 1, 2, 2), 2.0))[0, 0]), [[1 - 10, 0], [0, 0]])


def test_planar_convolution_matches_im2col():
    images = jax.random.normal(jax.random.key(0), (2, 6, 5))
    w = jax.random.normal(jax.random.key(1), (3, 3, 1, 4))
    planes = layers.conv3x3_same_planes(images, w)  # (4, 2, 6, 5)
    np.testing.assert_allclose(np.asarray(planes.transpose(1, 2, 3, 0)),
                               np.asarray(layers.conv3x3_same(images[..., None], w)), rtol=1e-5, atol=1e-6)
    # by hand: a lone unit pixel at (2, 2) answers with the filter mirrored around it
    impulse = jnp.zeros((1, 5, 5)).at[0, 2, 2].set(1.0)
    np.testing.assert_array_equal(np.asarray(layers.conv3x3_same_planes(impulse, w)[0, 0, 1:4, 1:4]),
                                  np.asarray(w[::-1, ::-1, 0, 0]))


def test_native_convolution_matches_im2col_and_its_gradients():
    # The GPU's path (XLA's convolution), forced on here: the same layout (HWIO), padding and gradients
    x = jax.random.normal(jax.random.key(2), (3, 5, 4, 6))
    w = jax.random.normal(jax.random.key(3), (3, 3, 6, 7))
    for native in (True, False):
        np.testing.assert_allclose(np.asarray(layers.conv3x3_same(x, w, native=native)),
                                   np.asarray(layers.conv3x3_same(x, w, native=not native)), rtol=1e-5, atol=1e-5)
    grads = [jax.grad(lambda x, w, n=native: jnp.sum(jnp.sin(layers.conv3x3_same(x, w, native=n))), argnums=(0, 1))(x, w)
             for native in (True, False)]
    for native_grad, im2col_grad in zip(*grads, strict=True):
        np.testing.assert_allclose(np.asarray(native_grad), np.asarray(im2col_grad), rtol=1e-4, atol=1e-4)
    big = jnp.zeros((layers.GPU_CONV_MIN_BATCH, 4, 4, 6))  # a CPU keeps im2col even at the GPU's batch sizes
    assert "conv_general_dilated" not in str(jax.make_jaxpr(layers.conv3x3_same)(big, w))
    assert "conv_general_dilated" in str(jax.make_jaxpr(functools.partial(layers.conv3x3_same, native=True))(x, w))


def test_patches_matmul_gradients_by_hand():
    # loss = sum((P @ W) * C): dL/dW = P^T C and dL/dP = C W^T, whatever form the backward pass takes
    patches = jnp.array([[1.0, 2, 0], [0, -1, 3]])
    weights = jnp.array([[1.0, 0], [2, 1], [-1, 4]])
    upstream = jnp.array([[1.0, -2], [3, 0.5]])
    grad_patches, grad_weights = jax.grad(lambda p, w: jnp.sum(layers.patches_matmul(p, w) * upstream),
                                          argnums=(0, 1))(patches, weights)
    np.testing.assert_array_equal(np.asarray(grad_weights), [[1, -2], [-1, -4.5], [9, 1.5]])
    np.testing.assert_array_equal(np.asarray(grad_patches), [[1, 0, -9], [3, 6.5, -1]])
    np.testing.assert_array_equal(np.asarray(layers.patches_matmul(patches, weights)), np.asarray(patches @ weights))
    x = jnp.zeros((2, 4, 4, 3))  # a CPU's im2col convolution takes this path
    assert "custom_vjp" in str(jax.make_jaxpr(layers.conv3x3_same)(x, jnp.zeros((3, 3, 3, 5))))


def test_label_smoothing_loss_by_hand():
    logits = jnp.array([[math.log(3.0), 0.0]])  # softmax: [3/4, 1/4]
    smoothed = float(train.cross_entropy(logits, jnp.array([0]), 0.2)[0])  # targets [0.9, 0.1]
    assert smoothed == pytest.approx(-(0.9 * math.log(0.75) + 0.1 * math.log(0.25)), rel=1e-6)
    assert float(train.cross_entropy(logits, jnp.array([0]))[0]) == pytest.approx(-math.log(0.75), rel=1e-6)


def test_nesterov_sgd_by_hand():
    # Constant gradient 1, lr 0.1, momentum 0.9: trace 1 then 1.9; Nesterov steps by
    # -lr * (g + momentum * trace): -0.19, then -0.271 (plain momentum: -0.1, then -0.19).
    sgd = dataclasses.replace(config.TrainConfig(), optimizer="sgd", lr=0.1, schedule="constant", weight_decay=0.0)
    for nesterov, expected in ((True, (-0.19, -0.271)), (False, (-0.1, -0.19))):
        optimizer = train.make_optimizer(dataclasses.replace(sgd, nesterov=nesterov), 10)
        params = {"w": jnp.zeros(())}
        state = optimizer.init(params)
        for want in expected:
            updates, state = optimizer.update({"w": jnp.ones(())}, state, params)
            assert float(updates["w"]) == pytest.approx(want, rel=1e-6)
    with pytest.raises(config.ConfigError, match="--nesterov applies to --optimizer sgd only"):
        config.validate(dataclasses.replace(config.TrainConfig(), nesterov=True))


def test_muon_orthogonalizes_filters_by_hand_and_leaves_the_rest_to_adamw():
    # A rank-one gradient u v^T of a (3, 3, 2, 2) filter, read as an (18, 2) matrix, with v = (1, -1)/sqrt(2):
    # AOL's rescaling then gives it singular value 1 (v's entries are equal in size), and each Newton-Schulz
    # iteration maps a singular value s to a s + b s^3 + c s^5. Momentum and the rescaling drop the
    # gradient's size, so the first update is -rate * 0.2 sqrt(18) * s3 * u v^T (consistent RMS: 0.2 times
    # the square root of the larger side), at muon_scale times --lr. The bias gets AdamW's first step, with
    # Nesterov momentum as optax's muon gives its other leaves.
    u = np.arange(1.0, 19.0) * np.array([1, -1] * 9)
    u /= np.linalg.norm(u)
    v = np.array([1.0, -1.0]) / math.sqrt(2)
    grads = {"conv": {"w": jnp.asarray(3.7 * np.outer(u, v).reshape(3, 3, 2, 2), jnp.float32),
                      "b": jnp.array([0.5, -2.0])}}
    params = jax.tree.map(jnp.zeros_like, grads)
    muon = dataclasses.replace(config.TrainConfig(), model="cnn", optimizer="muon", lr=0.01, muon_scale=3.0,
                               schedule="constant", weight_decay=0.0)
    optimizer = train.make_optimizer(muon, 10)
    updates, _ = optimizer.update(grads, optimizer.init(params), params)
    a, b, c = 3.4445, -4.775, 2.0315  # Muon's Newton-Schulz coefficients
    singular = 1.0
    for _ in range(train.MUON_NS_STEPS):
        singular = a * singular + b * singular ** 3 + c * singular ** 5
    assert singular == pytest.approx(0.7207, abs=1e-4)  # 1 -> 0.7010 -> 1.1136 -> 0.7207
    expected = -0.03 * 0.2 * math.sqrt(18) * singular * np.outer(u, v)
    np.testing.assert_allclose(np.asarray(updates["conv"]["w"]).reshape(18, 2), expected, rtol=2e-4, atol=1e-7)
    adamw = optax.adamw(0.01, weight_decay=0.0, nesterov=True)
    bias_update, _ = adamw.update(grads["conv"]["b"], adamw.init(params["conv"]["b"]), params["conv"]["b"])
    np.testing.assert_allclose(np.asarray(updates["conv"]["b"]), np.asarray(bias_update), rtol=1e-6)
    with pytest.raises(config.ConfigError, match="--optimizer muon orthogonalizes convolution filters; --model mlp"):
        config.validate(dataclasses.replace(muon, model="mlp"))
    with pytest.raises(config.ConfigError, match="--muon-scale must be a positive"):
        config.validate(dataclasses.replace(muon, muon_scale=0.0))
    with pytest.raises(config.ConfigError, match="--muon-scale applies to --optimizer muon only, not adamw"):
        config.validate(dataclasses.replace(muon, optimizer="adamw", muon_scale=2.0))


def test_the_optimizer_never_touches_running_statistics(small_dataset):
    model = models.get("speedrun")
    # A large rate and decay: an Adam step (~0.1) or decay (5%) on the statistics could not hide.
    optimizer = train.make_optimizer(dataclasses.replace(TINY, lr=0.1, weight_decay=0.5, schedule="constant"), 8)
    state = train.init_state(model, optimizer, seed=0)
    step = jax.jit(train.make_train_step(model, optimizer, jnp.float32, 0.1))
    images, labels = small_dataset.train.images_u8[:64].reshape(64, -1), small_dataset.train.labels[:64]
    after, _ = step(state, images, labels)
    _, expected = model.apply_train(state.params, train.scale_images(images), jnp.float32)
    for got, want in zip(jax.tree_util.tree_leaves(after.params["stats"]), jax.tree_util.tree_leaves(expected),
                         strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-7)  # the EMA only
    assert not np.array_equal(np.asarray(after.params["conv0"]["w"]), np.asarray(state.params["conv0"]["w"]))


def test_flip_tta_averages_the_image_and_its_mirror(small_dataset):
    model = models.get("speedrun")
    params = model.init(jax.random.key(0))
    images = small_dataset.test.images_u8[:50]
    scored = evaluate.run(params, "speedrun", images, small_dataset.test.labels[:50], batch_size=50, tta=True)
    scaled = jnp.asarray(images.reshape(-1, 28, 28), jnp.float32) / 255
    logits = (model.apply(params, scaled) + model.apply(params, scaled[:, :, ::-1])) / 2
    np.testing.assert_array_equal(scored["predictions"], np.asarray(jnp.argmax(logits, -1)))
    plain = np.asarray(jnp.argmax(model.apply(params, scaled), -1))
    assert scored["report"]["accuracy_no_tta"] == pytest.approx(np.mean(plain == small_dataset.test.labels[:50]))


def test_shifted_views_by_hand():
    image = jnp.arange(1.0, 10.0).reshape(1, 3, 3)  # 1 2 3 / 4 5 6 / 7 8 9
    views = np.asarray(evaluate.shifted_views(image, 1))[:, 0]
    assert views.shape == (8, 3, 3)  # every shift by up to a pixel each way but none
    np.testing.assert_array_equal(views[0], [[0, 0, 0], [0, 1, 2], [0, 4, 5]])  # moved down and right
    np.testing.assert_array_equal(views[3], [[0, 1, 2], [0, 4, 5], [0, 7, 8]])  # moved right
    np.testing.assert_array_equal(views[4], [[2, 3, 0], [5, 6, 0], [8, 9, 0]])  # moved left
    np.testing.assert_array_equal(views[7], [[5, 6, 0], [8, 9, 0], [0, 0, 0]])  # moved up and left
    assert len(evaluate.shifted_views(image, 2)) == 24


def test_shift_tta_weighs_the_shifted_views_as_much_as_the_pair():
    # A "model" whose logits are its pixels: one bright centre pixel, unmoved by the mirror, and each
    # of the 16 shifted views (8 of the image, 8 of its mirror) lights one of the 8 other pixels.
    pixels = type("Pixels", (), {"apply": staticmethod(lambda params, x, dtype: x.reshape(len(x), -1))})
    image = jnp.zeros((1, 3, 3)).at[0, 1, 1].set(1.0)
    pair, plain = evaluate.scored_logits(pixels, None, image, jnp.float32, tta=True)
    scored, _ = evaluate.scored_logits(pixels, None, image, jnp.float32, tta=True, tta_shift=1)
    np.testing.assert_array_equal(np.asarray(pair), np.asarray(plain))
    expected = np.full(9, (2 / 16) / 2)  # each other pixel: lit in 2 of 16 views, then half the weight
    expected[4] = 1 / 2  # the centre: the pair's 1, half the weight
    np.testing.assert_allclose(np.asarray(scored[0]), expected, rtol=1e-6)


def test_shift_tta_scores_a_real_model_from_its_eighteen_views(small_dataset):
    model = models.get("speedrun")
    params = model.init(jax.random.key(1))
    images, labels = small_dataset.test.images_u8[:40], small_dataset.test.labels[:40]
    scored = evaluate.run(params, "speedrun", images, labels, batch_size=40, tta=True, tta_shift=1)
    scaled = np.asarray(images, np.float32).reshape(-1, 28, 28) / 255
    padded = [np.pad(x, ((0, 0), (1, 1), (1, 1))) for x in (scaled, scaled[:, :, ::-1])]
    shifted = [model.apply(params, jnp.asarray(p[:, dy:dy + 28, dx:dx + 28])) for p in padded
               for dy in range(3) for dx in range(3) if (dy, dx) != (1, 1)]
    pair = (model.apply(params, jnp.asarray(scaled)) + model.apply(params, jnp.asarray(scaled[:, :, ::-1]))) / 2
    logits = (pair + sum(shifted) / 16) / 2
    np.testing.assert_array_equal(scored["predictions"], np.asarray(jnp.argmax(logits, -1)))
    assert scored["report"]["tta_shift"] == 1
    classify = evaluate.classifier("speedrun", params, tta=True, tta_shift=1)  # what predict and export use
    np.testing.assert_allclose(np.asarray(classify(jnp.asarray(scaled))), np.asarray(logits), rtol=1e-4, atol=1e-5)
    with pytest.raises(config.ConfigError, match="--tta-shift shifts the views of --tta: add --tta"):
        config.validate(dataclasses.replace(config.TrainConfig(), tta_shift=1))
    with pytest.raises(config.ConfigError, match="--tta-shift must be between 0 and 4 pixels, got 5"):
        config.validate(dataclasses.replace(config.TrainConfig(), tta=True, tta_shift=5))


def test_a_length_flag_replaces_the_recipes_length_either_way():
    from fashionjax.train_command import fresh_config

    assert config.default("speedrun").steps is not None and config.default("deep").epochs is not None
    by_epochs = config.validate(fresh_config({"model": "speedrun", "epochs": 2}))  # the short variant
    assert (by_epochs.epochs, by_epochs.steps, by_epochs.schedule) == (2, None, "linear")
    by_steps = config.validate(fresh_config({"model": "deep", "steps": 500}))
    assert (by_steps.epochs, by_steps.steps) == (None, 500)
    assert config.validate(fresh_config({"model": "deep"})).steps is None  # the recipe's own length


def test_no_tta_turns_off_the_recipes_shifted_views_too():
    from fashionjax.train_command import fresh_config

    assert config.default("speedrun").tta_shift == 1
    plain = config.validate(fresh_config({"model": "speedrun", "tta": False}))  # no error: the shifts go with TTA
    assert (plain.tta, plain.tta_shift) == (False, 0)
    assert fresh_config({"model": "deep", "tta": False}).tta_shift == 0
    with pytest.raises(config.ConfigError, match="add --tta"):  # both said at once: still a contradiction
        config.validate(fresh_config({"model": "speedrun", "tta": False, "tta_shift": 2}))


def test_speedrun_training_is_deterministic_and_learns(small_dataset):
    run = lambda cfg: train.fit(cfg, small_dataset.train.images_u8, small_dataset.train.labels)  # noqa: E731
    first, second = run(TINY), run(TINY)
    assert train.params_digest(first.state.params) == train.params_digest(second.state.params)
    assert train.params_digest(run(dataclasses.replace(TINY, seed=1)).state.params) != \
        train.params_digest(first.state.params)


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_speedrun_resume_is_bit_identical(tmp_path, synthetic_cli, capsys, small_speedrun, optimizer):
    # the recipe (which whitens) with a moving average of the weights: both live in the state resume restores,
    # as Muon's momentum does
    flags = ["--model", "speedrun", "--batch-size", "64", "--log-every", "4", "--schedule", "constant", "--quiet",
             "--json", "--ema", "0.9", "--optimizer", optimizer]
    assert cli.main(["train", *flags, "--steps", "12", "--run-dir", str(tmp_path / "straight")]) == 0
    straight = json.loads(capsys.readouterr().out)
    assert cli.main(["train", *flags, "--steps", "8", "--run-dir", str(tmp_path / "split")]) == 0
    capsys.readouterr()
    assert cli.main(["train", "--resume", "--steps", "12", "--quiet", "--json", "--run-dir", str(tmp_path / "split")]) == 0
    resumed = json.loads(capsys.readouterr().out)
    assert resumed["params_digest"] == straight["params_digest"]
    assert (resumed["test_accuracy"], resumed["test_accuracy_no_tta"]) == (straight["test_accuracy"],
                                                                          straight["test_accuracy_no_tta"])
    assert cli.main(["eval", str(tmp_path / "split"), "--json"]) == 0  # eval scores what the summary scored
    assert json.loads(capsys.readouterr().out)["params_digest"] == straight["params_digest"]


def test_aggregate_by_hand():
    rows = [{"seed": s, "test_accuracy": a, "test_accuracy_no_tta": a - 0.01, "train_seconds": t,
             "reached_target": a >= 0.94} for s, a, t in [(0, 0.94, 100.0), (1, 0.95, 120.0), (2, 0.93, 90.0)]]
    result = speedrun.aggregate(rows, 0.94)
    assert result["test_accuracy_mean"] == pytest.approx(0.94)
    assert result["test_accuracy_std"] == pytest.approx(0.01)  # sample standard deviation of .94, .95, .93
    assert result["reached_fraction"] == pytest.approx(2 / 3)
    assert result["median_seconds_to_target"] == 120.0  # times 100, 120 and never: the middle one is 120
    rows[0]["reached_target"] = False
    assert speedrun.aggregate(rows, 0.94)["median_seconds_to_target"] is None  # two of three never arrived


def test_speedrun_command_writes_the_record_and_keeps_finished_seeds(tmp_path, synthetic_cli, capsys, small_speedrun):
    out_dir = tmp_path / "record"
    args = ["speedrun", "--seeds", "2", "--seed", "3", "--steps", "4", "--batch-size", "64", "--target", "0.5",
            "--out", str(out_dir), "--json"]
    assert cli.main(args) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["seeds"] == [3, 4] and [row["seed"] for row in document["per_seed"]] == [3, 4]
    assert document["model"] == "speedrun" and document["tta"] is True
    model = models.get("speedrun")  # the recipe freezes the whitened first layer: its weight gradient is not counted
    assert document["train_flops_per_run"] == (model.train_flops_per_example - model.whitened_grad_flops) * 4 * 64
    saved = json.loads((out_dir / "speedrun.json").read_text())
    assert saved["per_seed"] == document["per_seed"]
    assert "seed" in (out_dir / "speedrun.html").read_text()
    digests = [row["params_digest"] for row in document["per_seed"]]
    assert cli.main(args) == 0  # again: both seeds are kept, nothing retrained
    captured = capsys.readouterr()
    assert captured.err.count("finished earlier") == 2
    assert [row["params_digest"] for row in json.loads(captured.out)["per_seed"]] == digests


def test_shift_tta_is_named_beside_every_figure_it_scored(tmp_path, synthetic_cli, capsys, small_speedrun):
    flags = ["--steps", "4", "--batch-size", "64", "--tta-shift", "1"]
    assert cli.main(["train", "--model", "speedrun", *flags, "--run-dir", str(tmp_path / "run")]) == 0
    assert "(flip and 1-pixel shift TTA;" in capsys.readouterr().out
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["tta"] is True and summary["tta_shift"] == 1
    assert cli.main(["eval", str(tmp_path / "run"), "--json"]) == 0  # re-scored the same way
    report = json.loads(capsys.readouterr().out)
    assert (report["tta_shift"], report["accuracy"]) == (1, summary["test_accuracy"])
    assert cli.main(["speedrun", "--seeds", "1", *flags, "--out", str(tmp_path / "record")]) == 0
    printed = capsys.readouterr().out
    assert "(flip and 1-pixel shift TTA;" in printed
    assert json.loads((tmp_path / "record" / "speedrun.json").read_text())["tta_shift"] == 1
    page = (tmp_path / "record" / "speedrun.html").read_text()
    assert "with flip and 1-pixel shift TTA;" in page
    assert "±" not in printed and "&plusmn;" not in page  # one seed: no spread to show, not a spread of 0.00


def test_speedrun_refuses_a_folder_finished_with_other_settings(tmp_path, synthetic_cli, capsys, small_speedrun):
    base = ["speedrun", "--seeds", "1", "--steps", "4", "--batch-size", "64", "--out", str(tmp_path), "--json"]
    assert cli.main(base) == 0
    capsys.readouterr()
    assert cli.main([*base, "--lr", "0.01"]) == 2
    assert "finished with other settings (lr 0.002 -> 0.01)" in json.loads(capsys.readouterr().out)["error"]["message"]


@pytest.mark.parametrize("left_off", ["--label-smoothing", "--tta-shift"])
def test_speedrun_refuses_a_seed_of_another_recipe_even_when_the_flag_is_left_off(tmp_path, synthetic_cli, capsys,
                                                                                    small_speedrun, left_off):
    """The recipe's default is what the command asks for: a seed trained or scored with a flag given is
    another recipe, not a seed to keep (nor, stopped, one to resume) when the flag is dropped."""
    base = ["speedrun", "--seeds", "1", "--steps", "4", "--batch-size", "64", "--out", str(tmp_path), "--json"]
    assert cli.main([*base, left_off, "0"]) == 0
    digest = json.loads(capsys.readouterr().out)["per_seed"][0]["params_digest"]
    assert cli.main(base) == 2
    message = json.loads(capsys.readouterr().out)["error"]["message"]
    assert f"seed-0: finished with other settings ({left_off[2:].replace('-', '_')} 0" in message
    (tmp_path / "seed-0" / "summary.json").unlink()  # as if stopped after its last checkpoint
    assert cli.main(base) == 2
    assert "seed-0: started with other settings" in json.loads(capsys.readouterr().out)["error"]["message"]
    assert cli.main([*base, left_off, "0"]) == 0  # its own recipe resumes it, to the same parameters
    captured = capsys.readouterr()
    assert "seed 0: resuming" in captured.err and json.loads(captured.out)["per_seed"][0]["params_digest"] == digest


def test_alternating_flips_mirror_each_image_in_every_other_epoch():
    key = jax.random.key(5)
    indices = jnp.arange(64)
    epochs = [np.asarray(augment.alternating_flips(key, indices, jnp.int32(e))) for e in range(4)]
    np.testing.assert_array_equal(epochs[0], ~epochs[1])  # each image once each way over two epochs
    np.testing.assert_array_equal(epochs[0], epochs[2])
    assert 0 < epochs[0].sum() < 64  # the coins differ between images
    shuffled = np.asarray(augment.alternating_flips(key, indices[::-1], jnp.int32(0)))
    np.testing.assert_array_equal(shuffled, epochs[0][::-1])  # an image's coin goes with the image, not its slot
    images = np.arange(2 * 784, dtype=np.uint8).reshape(2, 784) % 251
    mirrored = np.asarray(augment.augment_batch(key, images, 0, jnp.array([True, False])))
    np.testing.assert_array_equal(mirrored[0], images[0].reshape(28, 28)[:, ::-1].reshape(-1))
    np.testing.assert_array_equal(mirrored[1], images[1])


def test_tta_without_flipped_training_is_pointed_out(tmp_path, synthetic_cli, capsys, small_speedrun):
    assert cli.main(["train", "--model", "speedrun", "--no-augment", "--steps", "2", "--batch-size", "64",
                     "--run-dir", str(tmp_path / "run")]) == 0
    assert "--tta without --augment" in capsys.readouterr().err


def test_cutout_blacks_out_one_square_per_image_cut_at_the_edges():
    images = np.full((400, 28, 28), 7, np.uint8)
    erased = np.asarray(augment.cutout(jax.random.key(3), jnp.asarray(images), 8)) == 0
    centres = np.asarray(jax.random.randint(jax.random.key(3), (400, 2), 0, jnp.array([28, 28])))
    for image, (row, col) in zip(erased, centres, strict=True):
        expected = np.zeros((28, 28), bool)  # by hand: rows and columns centre-4 .. centre+3, clipped
        expected[max(row - 4, 0):row + 4, max(col - 4, 0):col + 4] = True
        np.testing.assert_array_equal(image, expected)
    counts = erased.sum(axis=(1, 2))
    assert counts.max() == 64 and counts.min() < 64  # whole squares inside, cut ones at the edges
    # Off by default, and the flips and shifts of a batch are the same with and without it
    key, batch = jax.random.key(4), np.arange(3 * 784, dtype=np.uint8).reshape(3, 784) % 200 + 1
    plain = np.asarray(augment.augment_batch(key, batch, 1))
    cut = np.asarray(augment.augment_batch(key, batch, 1, cutout_side=5))
    assert ((cut == plain) | (cut == 0)).all() and (cut == 0).sum() > (plain == 0).sum()
    with pytest.raises(config.ConfigError, match="--cutout is part of the training augmentation: add --augment"):
        config.validate(dataclasses.replace(config.TrainConfig(), cutout=8))


def test_whitening_filters_by_hand():
    # Second moment diag(2, 0.5): the leading direction is e1 (eigenvalue 2), then e2 (0.5).
    moments = np.diag([2.0, 0.5])
    one = models.whitening_filters(moments, 1, eps=0.0)
    np.testing.assert_allclose(np.abs(one), [[1 / math.sqrt(2)], [0]], atol=1e-12)
    both = models.whitening_filters(moments, 2, eps=0.0)
    np.testing.assert_allclose(np.abs(both), [[1 / math.sqrt(2), 0], [0, math.sqrt(2)]], atol=1e-12)
    # Correlated patches come out with unit, uncorrelated second moments along every kept direction
    mixed = np.random.default_rng(0).normal(size=(5000, 3)) @ np.array([[3.0, 1, 0], [0, 1, 0.5], [0, 0, 0.2]])
    projected = mixed @ models.whitening_filters(mixed.T @ mixed / len(mixed), 3, eps=0.0)
    np.testing.assert_allclose(projected.T @ projected / len(mixed), np.eye(3), atol=1e-9)


def test_patch_moments_by_hand():
    # One 3x4 image has two whole 3x3 windows: columns 0-2 and 1-3. Tap (i, j) reads row i, column j + k.
    image = np.arange(12.0).reshape(1, 3, 4)
    patches = np.array([image[0, :, k:k + 3].ravel() for k in range(2)])  # (2 windows, 9 taps)
    np.testing.assert_allclose(models.patch_moments(image), patches.T @ patches / 2, rtol=1e-15)
    assert models.patch_moments(image)[0, 8] == (0 * 10 + 1 * 11) / 2  # first tap x last tap, by hand
    # Many images: the same matrix as from the patch matrix itself
    images = np.random.default_rng(1).normal(size=(7, 6, 5))
    windows = np.stack(layers.taps3x3(images, 4, 3), axis=-1).reshape(-1, 9)
    np.testing.assert_allclose(models.patch_moments(images), windows.T @ windows / len(windows), rtol=1e-12)


def test_whitened_first_layer_whitens_its_patches_and_stays_frozen(small_dataset):
    model = models.get("speedrun")
    images = small_dataset.train.images_u8.reshape(len(small_dataset.train.labels), -1)  # fewer than WHITEN_IMAGES
    params = model.whitening(images)(model.init(jax.random.key(0)))
    scaled = (np.asarray(images, np.float32).reshape(-1, 28, 28) / 255 - models.PIXEL_MEAN) / models.PIXEL_STD
    response = np.asarray(layers.conv3x3_same_planes(jnp.asarray(scaled), params["conv0"]["w"]))  # (9, N, 28, 28)
    interior = response[:, :, 1:-1, 1:-1].reshape(len(response), -1).T  # whole windows: those fitted
    assert interior.shape[1] == 9  # every direction of a 3x3 patch (the model pools their negations too)
    np.testing.assert_allclose(interior.T @ interior / len(interior), np.eye(9), atol=0.05)  # eps bends the weakest a little
    # Training moves every weight but the whitening filters (and the running statistics' own rule)
    whitened = dataclasses.replace(TINY, whiten=True, lr=0.1, weight_decay=0.5, schedule="constant")
    optimizer = train.make_optimizer(whitened, 8)
    state = train.initial_state(whitened, 8, small_dataset.train.images_u8)
    np.testing.assert_array_equal(np.asarray(state.params["conv0"]["w"]), np.asarray(params["conv0"]["w"]))
    after, _ = jax.jit(train.make_train_step(model, optimizer, jnp.float32, 0.1))(
        state, small_dataset.train.images_u8[:64].reshape(64, -1), small_dataset.train.labels[:64])
    np.testing.assert_array_equal(np.asarray(after.params["conv0"]["w"]), np.asarray(params["conv0"]["w"]))
    for name in ("conv1", "dense", "head"):
        assert not np.array_equal(np.asarray(after.params[name]["w"]), np.asarray(state.params[name]["w"]))
    with pytest.raises(config.ConfigError, match="--whiten fits the first layer of the speedrun and deep models; it does not apply to --model mlp"):
        config.validate(dataclasses.replace(config.TrainConfig(), whiten=True))


def test_a_frozen_layer_costs_no_backward_work_and_changes_no_update(small_dataset):
    whitened = dataclasses.replace(TINY, whiten=True)
    model, frozen = models.get("speedrun"), train.frozen_paths(whitened)
    assert frozen == (("conv0", "w"),) and train.frozen_paths(TINY) == ()
    optimizer = train.make_optimizer(whitened, 8)
    state = train.initial_state(whitened, 8, small_dataset.train.images_u8)
    batch = small_dataset.train.images_u8[:64].reshape(64, -1), small_dataset.train.labels[:64]
    full, cut = (jax.jit(train.make_train_step(model, optimizer, jnp.float32, 0.1, paths)) for paths in ((), frozen))
    flops = [step.lower(state, *batch).compile().cost_analysis()["flops"] for step in (full, cut)]
    assert flops[1] < flops[0]  # the gradient of the frozen filters (and all the work behind it) is gone
    (after_full, metrics_full), (after_cut, metrics_cut) = full(state, *batch), cut(state, *batch)
    for got, want in zip(jax.tree_util.tree_leaves(after_cut.params), jax.tree_util.tree_leaves(after_full.params),
                         strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    assert float(metrics_cut["grad_norm"]) < float(metrics_full["grad_norm"])  # the frozen leaf adds nothing now


def test_weight_ema_by_hand():
    ema = train.params_ema(0.9)
    state = ema.init({"a": jnp.array(1.0)})
    updates, state = ema.update({"a": jnp.array(1.0)}, state, {"a": jnp.array(1.0)})
    assert float(updates["a"]) == 1.0  # the updates pass unchanged
    assert float(state.ema["a"]) == pytest.approx(0.9 * 1.0 + 0.1 * 2.0)  # of the params after the update
    _, state = ema.update({"a": jnp.array(0.5)}, state, {"a": jnp.array(2.0)})
    assert float(state.ema["a"]) == pytest.approx(0.9 * 1.1 + 0.1 * 2.5)
    with pytest.raises(config.ConfigError, match="--ema must be in"):
        config.validate(dataclasses.replace(config.TrainConfig(), ema=1.0))


def test_a_run_with_ema_is_scored_with_the_average_and_the_current_statistics(small_dataset, small_speedrun):
    averaged = dataclasses.replace(TINY, ema=0.5)
    result = train.fit(averaged, small_dataset.train.images_u8, small_dataset.train.labels)
    scored = train.evaluated_params(averaged, result.state)
    ema = result.state.opt_state[-1].ema
    np.testing.assert_array_equal(np.asarray(scored["head"]["w"]), np.asarray(ema["head"]["w"]))
    assert not np.array_equal(np.asarray(scored["head"]["w"]), np.asarray(result.state.params["head"]["w"]))
    assert scored["stats"] is result.state.params["stats"]
    # The average is an optimizer addition only: the weights are those of the run without it
    plain = train.fit(TINY, small_dataset.train.images_u8, small_dataset.train.labels)
    assert train.params_digest(plain.state.params) == train.params_digest(result.state.params)
    assert train.evaluated_params(TINY, plain.state) is plain.state.params


def test_blend_is_the_weighted_mean_of_the_probabilities_by_hand():
    first = np.array([[0.6, 0.4], [0.2, 0.8]])
    second = np.array([[0.0, 1.0], [0.5, 0.5]])
    np.testing.assert_allclose(blend.combine([first, second], [1.0, 0.5]), [[0.4, 0.6], [0.3, 0.7]])
    # image 0 (label 0) is right alone, wrong once the second run's certainty weighs in
    assert blend.accuracy(blend.combine([first, second], [1.0, 0.5]), np.array([0, 1])) == 0.5
    assert blend.accuracy(first, np.array([0, 1])) == 1.0


def test_a_runs_plain_logits_come_from_the_same_pass_as_its_scored_ones():
    model = models.get("mlp")
    stacked = jax.tree_util.tree_map(lambda *x: jnp.stack(x), model.init(jax.random.key(0)), model.init(jax.random.key(1)))
    images = jnp.asarray(np.random.default_rng(0).random((6, 28, 28), np.float32))
    for members, params in ((1, model.init(jax.random.key(2))), (2, stacked)):
        scored, plain = evaluate.classifier_and_plain("mlp", params, tta=True, members=members, tta_shift=1)(images)
        expected_scored = evaluate.classifier("mlp", params, tta=True, members=members, tta_shift=1)(images)
        np.testing.assert_allclose(scored, expected_scored, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(plain, evaluate.classifier("mlp", params, members=members)(images), rtol=1e-6, atol=1e-6)
        assert not np.allclose(scored, plain)  # the views change the logits, so the two are told apart


def test_speedrun_blend_scores_each_seed_with_the_same_seed_of_another_record(tmp_path, synthetic_cli, capsys,
                                                                              small_speedrun):
    seeds = ["--seeds", "2", "--seed", "3"]
    partner = ["speedrun", "--model", "mlp", "--steps", "6", "--batch-size", "64", *seeds, "--json",
               "--out", str(tmp_path / "mlp")]
    assert cli.main(partner) == 0
    mlp = json.loads(capsys.readouterr().out)
    own = ["speedrun", "--steps", "4", "--batch-size", "64", *seeds, "--target", "0.3", "--json"]
    assert cli.main([*own, "--out", str(tmp_path / "alone")]) == 0
    alone = json.loads(capsys.readouterr().out)

    def blended(*weight: str) -> dict:
        assert cli.main([*own, "--out", str(tmp_path / "alone"), "--blend", str(tmp_path / "mlp"), *weight]) == 0
        return json.loads(capsys.readouterr().out)

    programs = blend._both._cache_size()
    assert [part["weight"] for part in blended()["per_seed"][0]["blend"]] == [1.0, 1.0]  # the default: equal
    document = blended("--blend-weight", "0.5")
    assert blend._both._cache_size() == programs + 2  # one per recipe, whichever seed or weight
    assert document["blend"]["model"] == "mlp" and document["blend"]["weight"] == 0.5
    assert document["train_flops_per_run"] == alone["train_flops_per_run"] + mlp["train_flops_per_run"]
    for row, own_row, mlp_row in zip(document["per_seed"], alone["per_seed"], mlp["per_seed"], strict=True):
        parts = row["blend"]
        assert [part["model"] for part in parts] == ["speedrun", "mlp"] and [p["seed"] for p in parts] == [row["seed"]] * 2
        assert [part["weight"] for part in parts] == [1.0, 0.5]
        assert row["train_seconds"] == own_row["train_seconds"] + mlp_row["train_seconds"]  # kept, not retrained
        assert [part["test_accuracy"] for part in parts] == pytest.approx(
            [own_row["test_accuracy"], mlp_row["test_accuracy"]], abs=2 / 500)  # each scored as its run scores it
        assert row["reached_target"] == (row["test_accuracy"] >= 0.3)
    saved = json.loads((tmp_path / "alone" / "speedrun.json").read_text())
    assert saved["per_seed"] == document["per_seed"]
    assert "blended with <code>mlp</code>" in (tmp_path / "alone" / "speedrun.html").read_text()
    del saved["blend"]  # a record written before --blend still renders
    (tmp_path / "alone" / "speedrun.json").write_text(json.dumps(saved))
    assert "blended" not in render.render_speedrun(tmp_path / "alone").read_text()
    # a partner whose checkpoints are gone is refused before this speedrun trains anything
    shutil.copytree(tmp_path / "mlp", tmp_path / "broken")
    shutil.rmtree(tmp_path / "broken" / "seed-4" / "checkpoints")
    assert cli.main([*own, "--out", str(tmp_path / "new"), "--blend", str(tmp_path / "broken")]) == 1
    assert "seed-4/checkpoints" in json.loads(capsys.readouterr().out)["error"]["message"]
    assert not (tmp_path / "new").exists()
    # a weight that drowns one run out leaves the other's accuracy: the weight reaches the probabilities
    for weight, which in (("1e-9", 0), ("1e9", 1)):
        for row in blended("--blend-weight", weight)["per_seed"]:
            assert row["test_accuracy"] == row["blend"][which]["test_accuracy"]
            assert row["test_accuracy_no_tta"] == row["blend"][which]["test_accuracy_no_tta"]


@pytest.mark.parametrize("flags, message", [
    (["--blend-weight", "0.5"], "--blend-weight weighs the runs of --blend"),
    (["--blend", "{partner}", "--blend-weight", "0"], "--blend-weight must be a positive"),
    (["--blend", "{partner}", "--seeds", "2"], "no finished run of seed 1"),
    (["--blend", "{out}"], "that is this speedrun's own --out"),
    (["--blend", "{partner}"], "seed-0: not a run directory"),  # a summary.json alone is not a run to blend
])
def test_speedrun_blend_refuses_what_it_cannot_score_before_training(tmp_path, synthetic_cli, capsys, small_speedrun,
                                                                     flags, message):
    paths = {"partner": tmp_path / "partner", "out": tmp_path / "record"}
    (paths["partner"] / "seed-0").mkdir(parents=True)  # a record holding seed 0 alone
    (paths["partner"] / "seed-0" / "summary.json").write_text(json.dumps({"model": "mlp"}))
    flags = [flag.format(**paths) for flag in flags]
    base = ["speedrun", "--steps", "4", "--batch-size", "64", "--seeds", "1", "--json"]
    assert cli.main([*base, "--out", str(paths["out"]), *flags]) == 2
    assert message in json.loads(capsys.readouterr().out)["error"]["message"]
    assert not paths["out"].exists()  # refused before anything trained
