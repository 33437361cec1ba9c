"""One contract over every registered model, and the FLOPs arithmetic by hand."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fashionjax import config, models, train


@pytest.mark.parametrize("name", sorted(models.REGISTRY))
def test_model_contract(name):
    model = models.get(name)
    params = model.init(jax.random.key(0))
    images = jax.random.uniform(jax.random.key(1), (4, 28, 28))
    apply = jax.jit(model.apply, static_argnums=2)
    for dtype in (jnp.float32, jnp.bfloat16):
        logits = apply(params, images, dtype)
        assert logits.shape == (4, 10) and logits.dtype == jnp.float32
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree_util.tree_leaves(params))

    images_u8 = (np.asarray(images) * 255).astype(np.uint8)
    labels = jnp.arange(4) % 10

    @jax.jit
    def loss(p):
        return train.loss_and_accuracy(p, images_u8, labels, model, jnp.float32)[0]

    value, grads = jax.value_and_grad(loss)(params)
    assert jax.tree_util.tree_structure(grads) == jax.tree_util.tree_structure(params)
    for g, p in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(params), strict=True):
        assert g.shape == p.shape
    assert np.isfinite(float(value))
    # The gradient is the loss's slope: a central difference along a random direction agrees.
    leaves, treedef = jax.tree_util.tree_flatten(params)
    keys = jax.random.split(jax.random.key(2), len(leaves))
    direction = [jax.random.normal(k, leaf.shape) for k, leaf in zip(keys, leaves, strict=True)]
    norm = sum(float(jnp.sum(d * d)) for d in direction) ** 0.5
    direction = treedef.unflatten([d / norm for d in direction])  # a unit step in parameter space
    eps = 1e-2
    shifted = lambda sign: jax.tree_util.tree_map(lambda p, d: p + sign * eps * d, params, direction)  # noqa: E731
    numeric = (float(loss(shifted(1))) - float(loss(shifted(-1)))) / (2 * eps)
    analytic = sum(float(jnp.vdot(g, d)) for g, d in
                   zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(direction), strict=True))
    assert numeric == pytest.approx(analytic, rel=0.05, abs=1e-3)
    assert model.train_flops_per_example > 0 and model.tokens_per_example == 49


def test_registry_matches_config_choices():
    assert tuple(models.REGISTRY) == config.MODELS
    assert tuple(name for name, model in models.REGISTRY.items() if model.whitening) == config.WHITENABLE
    has_filters = lambda model: any(leaf.ndim == 4 for leaf in jax.tree.leaves(model.init(jax.random.key(0))))  # noqa: E731
    assert tuple(name for name, model in models.REGISTRY.items() if has_filters(model)) == config.CONVOLUTIONAL


def test_mlp_is_the_codelab_model():
    params = models.mlp_init(jax.random.key(0))
    assert models.count_params(params) == 235_146
    assert {k: v.shape for k, v in params.items()} == {
        "w1": (784, 256), "b1": (256,), "w2": (256, 128), "b2": (128,), "w3": (128, 10), "b3": (10,)}
    assert all(float(jnp.abs(params[b]).max()) == 0.0 for b in ("b1", "b2", "b3"))
    # He-normal: the standard deviation of w1 is sqrt(2 / 784) ~ 0.0505.
    assert abs(float(params["w1"].std()) - (2 / 784) ** 0.5) < 0.002


def test_mlp_flops_by_hand():
    forward = 2 * (784 * 256 + 256 * 128 + 128 * 10)  # 469,504
    weight_grads = forward
    input_grads = 2 * (256 * 128 + 128 * 10)  # the first layer's input (the image) needs no gradient
    assert models.get("mlp").train_flops_per_example == forward + weight_grads + input_grads == 1_007_104


def test_cnn_flops_by_hand():
    macs = [28 * 28 * 9 * 1 * 32, 14 * 14 * 9 * 32 * 64, 7 * 7 * 64 * 256, 256 * 10]
    expected = 2 * sum(macs) * 2 + 2 * sum(macs[1:])
    assert models.get("cnn").train_flops_per_example == expected


def test_speedrun_flops_by_hand():
    # convolutions at 28x28 (1 -> 9 filters, pooled with their negations: 18 channels), 14x14
    # (18 -> 48, then 48 -> 48) and 7x7 (48 -> 128), then 4x4x128 = 2048 -> 128 -> 10
    macs = [28 * 28 * 9 * 1 * 9, 14 * 14 * 9 * 18 * 48, 14 * 14 * 9 * 48 * 48, 7 * 7 * 9 * 48 * 128,
            2048 * 128, 128 * 10]
    expected = 2 * sum(macs) * 2 + 2 * sum(macs[1:])
    model = models.get("speedrun")
    assert model.train_flops_per_example == expected == 51_621_696
    # Its whitened first layer, frozen, takes no weight gradient (and never an input gradient)
    assert model.run_flops_per_example(whiten=True) == expected - 2 * macs[0]
    assert model.run_flops_per_example(whiten=False) == expected


def test_deep_flops_by_hand():
    # the speedrun model's first layer, then three convolutions at 14x14 (18 -> 64, 64 -> 64,
    # 64 -> 64, pooled after the third) and one at 7x7 (64 -> 128), then 4x4x128 = 2048 -> 256 -> 10
    macs = [28 * 28 * 9 * 1 * 9, 14 * 14 * 9 * 18 * 64, 14 * 14 * 9 * 64 * 64, 14 * 14 * 9 * 64 * 64,
            7 * 7 * 9 * 64 * 128, 2048 * 256, 256 * 10]
    expected = 2 * sum(macs) * 2 + 2 * sum(macs[1:])
    model = models.get("deep")
    assert model.train_flops_per_example == expected == 123_988_032
    assert model.run_flops_per_example(whiten=True) == expected - 2 * macs[0]


def test_the_deep_recipe_is_the_speedrun_recipe_longer_shifted_and_cosine():
    deep, speedrun = config.default("deep"), config.default("speedrun")
    assert (deep.model, deep.epochs, deep.steps, deep.schedule) == ("deep", 12, None, "cosine")
    assert (deep.focus, deep.max_shift, deep.tta_shift) == (0.5, 1, 1)
    assert (speedrun.steps, speedrun.epochs, speedrun.schedule, speedrun.max_shift) == (20_000, None, "linear", 0)
    assert dataclasses.replace(deep, model="speedrun", epochs=None, steps=speedrun.steps, schedule="linear",
                               max_shift=0) == speedrun


@pytest.mark.parametrize("shape", [(3, 3, 1, 9), (3, 3, 16, 32), (1152, 64), (64, 10), (7,)])
def test_the_flat_draw_is_the_shaped_draw(shape):
    # the init draws flat (XLA:CPU compiles it faster) and reshapes: every model's initial parameters,
    # and so every published per-seed figure, rest on these being the same numbers bit for bit
    for seed in (0, 5):
        key = jax.random.fold_in(jax.random.key(seed), 11)
        flat = np.asarray(models._flat_normal(key, shape))
        shaped = np.asarray(jax.random.normal(key, shape, jnp.float32))
        assert flat.shape == (shaped.size,) and np.array_equal(flat.reshape(shape).view(np.uint32), shaped.view(np.uint32))
