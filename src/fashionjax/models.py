"""Models as PyTrees of arrays with pure init/apply functions, and their registry.

Parameters are float32; `apply` casts weights and activations to the compute dtype and returns
float32 logits (the codelab's mixed-precision scheme). Images arrive as float32 in [0, 1].
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from fashionjax import layers

IMAGE_SIDE = 28
INPUT_DIM = IMAGE_SIDE * IMAGE_SIDE
NUM_CLASSES = 10
# tokens/sec is a projection: we count an image as the 49 non-overlapping 4x4 patches a
# vision transformer would read. No model here consumes tokens; the figure relates
# examples/sec to the unit sequence-model people quote, nothing more.
TOKENS_PER_EXAMPLE = (IMAGE_SIDE // 4) ** 2
TOKENS_ASSUMPTION = "one image = 49 tokens (non-overlapping 4x4 patches, as a ViT would read it)"


@dataclass(frozen=True)
class Model:
    name: str
    init: Callable  # (key) -> params
    apply: Callable  # (params, images (batch, 28, 28) float32, compute_dtype) -> (batch, 10) float32
    train_flops_per_example: int  # forward + backward matmul/conv FLOPs
    tokens_per_example: int = TOKENS_PER_EXAMPLE
    description: str = ""
    # For models with running statistics (batch norm), kept under params["stats"] and never touched
    # by the optimizer: (params, images, compute_dtype) -> (logits, the updated params["stats"]).
    apply_train: Callable | None = None
    # For models whose first layer can be fitted to the data (--whiten): (training images (N, 784)
    # uint8) -> (params -> params with that layer set); `whitened` names its leaf, which training freezes.
    whitening: Callable | None = None
    whitened: tuple[str, ...] = ()
    whitened_grad_flops: int = 0  # per example: the whitened layer's weight gradient, never taken while frozen

    def run_flops_per_example(self, whiten: bool) -> int:
        """Training FLOPs per example of a run: with --whiten its frozen layer's weight gradient is not computed."""
        return self.train_flops_per_example - (self.whitened_grad_flops if whiten else 0)


def _flat_normal(key, shape) -> jax.Array:
    """jax.random.normal(key, shape) in float32, before its reshape: the same numbers (the draw is
    elementwise over one flat stream), but XLA:CPU compiles a flat draw 2-4 times as fast as a 4-D
    one (0.3 s against 0.7-1.4 s a shape on a Zen 3 EPYC), and shapes of one size share it."""
    return jax.random.normal(key, (math.prod(shape),), jnp.float32)


def _he_normal(key, shape, fan_in):
    return (_flat_normal(key, shape) * math.sqrt(2.0 / fan_in)).reshape(shape)


def _train_flops(layer_macs: list[int]) -> int:
    """Training FLOPs from each layer's multiply-accumulates per example, first layer first.

    Forward is 2*MACs per layer; backward needs 2*MACs for the weight gradient of every layer and
    2*MACs for the input gradient of every layer but the first (the images need no gradient).
    """
    forward = sum(2 * m for m in layer_macs)
    weight_grads = forward
    input_grads = sum(2 * m for m in layer_macs[1:])
    return forward + weight_grads + input_grads


# ---------------------------------------------------------------- mlp: the codelab's model

MLP_WIDTHS = (INPUT_DIM, 256, 128, NUM_CLASSES)


def mlp_init(key) -> dict:
    keys = jax.random.split(key, len(MLP_WIDTHS) - 1)
    params = {}
    for i, (k, fan_in, fan_out) in enumerate(zip(keys, MLP_WIDTHS[:-1], MLP_WIDTHS[1:], strict=True), 1):
        params[f"w{i}"] = _he_normal(k, (fan_in, fan_out), fan_in)
        params[f"b{i}"] = jnp.zeros((fan_out,), jnp.float32)
    return params


def mlp_apply(params: dict, images, compute_dtype=jnp.float32):
    x = images.reshape(images.shape[0], -1).astype(compute_dtype)  # (batch, 784)
    num_layers = len(MLP_WIDTHS) - 1
    for i in range(1, num_layers + 1):
        x = x @ params[f"w{i}"].astype(compute_dtype) + params[f"b{i}"].astype(compute_dtype)
        if i < num_layers:
            x = jax.nn.gelu(x)
    return x.astype(jnp.float32)


# ---------------------------------------------------------------- cnn

CNN_CHANNELS = (1, 32, 64)
CNN_HIDDEN = 256


def cnn_init(key) -> dict:
    k1, k2, k3, k4 = jax.random.split(key, 4)
    c0, c1, c2 = CNN_CHANNELS
    flat = (IMAGE_SIDE // 4) ** 2 * c2
    return {
        "conv1": {"w": _he_normal(k1, (3, 3, c0, c1), 9 * c0), "b": jnp.zeros((c1,), jnp.float32)},
        "conv2": {"w": _he_normal(k2, (3, 3, c1, c2), 9 * c1), "b": jnp.zeros((c2,), jnp.float32)},
        "dense1": {"w": _he_normal(k3, (flat, CNN_HIDDEN), flat), "b": jnp.zeros((CNN_HIDDEN,), jnp.float32)},
        "dense2": {"w": _he_normal(k4, (CNN_HIDDEN, NUM_CLASSES), CNN_HIDDEN),
                   "b": jnp.zeros((NUM_CLASSES,), jnp.float32)},
    }


def _dense(x, layer, compute_dtype):
    return x @ layer["w"].astype(compute_dtype) + layer["b"].astype(compute_dtype)


def _conv_pool(x, layer, compute_dtype):
    y = layers.conv3x3_same(x, layer["w"].astype(compute_dtype))
    return layers.max_pool2x2(jax.nn.gelu(y + layer["b"].astype(compute_dtype)))


def cnn_apply(params: dict, images, compute_dtype=jnp.float32):
    x = images.reshape(images.shape[0], IMAGE_SIDE, IMAGE_SIDE, 1).astype(compute_dtype)
    x = _conv_pool(x, params["conv1"], compute_dtype)  # (batch, 14, 14, 32)
    x = _conv_pool(x, params["conv2"], compute_dtype)  # (batch, 7, 7, 64)
    x = x.reshape(x.shape[0], -1)
    x = jax.nn.gelu(_dense(x, params["dense1"], compute_dtype))
    return _dense(x, params["dense2"], compute_dtype).astype(jnp.float32)


def _cnn_macs() -> list[int]:
    c0, c1, c2 = CNN_CHANNELS
    side1, side2 = IMAGE_SIDE, IMAGE_SIDE // 2
    flat = (IMAGE_SIDE // 4) ** 2 * c2
    return [side1 * side1 * 9 * c0 * c1, side2 * side2 * 9 * c1 * c2, flat * CNN_HIDDEN, CNN_HIDDEN * NUM_CLASSES]


# ---------------------------------------------------------------- speedrun: built for time-to-accuracy

BN_MOMENTUM = 0.9
PIXEL_MEAN, PIXEL_STD = 0.286, 0.353  # Fashion-MNIST's training-set pixel statistics
WHITEN_IMAGES = 5000  # the first training images' patches are plenty for a 9x9 second-moment matrix


def patch_moments(images) -> np.ndarray:
    """(N, H, W) images -> the (9, 9) second-moment matrix of their whole 3x3 patches, in float64.

    Each entry sums the products of two of the nine shifted views, so the (N * (H-2) * (W-2), 9)
    patch matrix is never built: 10x faster than building it (0.08 against 0.4-1.1 s for 5,000
    images on two cores), with the same float32 filters bit for bit on the training images.
    """
    taps = layers.taps3x3(np.asarray(images, np.float64), images.shape[1] - 2, images.shape[2] - 2)
    moments = np.empty((9, 9))
    for a in range(9):
        for b in range(a, 9):
            moments[a, b] = moments[b, a] = np.einsum("nij,nij->", taps[a], taps[b])
    return moments / taps[0].size


def whitening_filters(moments: np.ndarray, count: int, eps: float = 5e-4) -> np.ndarray:
    """(D, D) second-moment matrix of patches -> (D, count) filters that whiten the patches along
    their `count` leading directions.

    Each filter is an eigenvector of the matrix divided by the square root of its eigenvalue (plus
    eps), so the projections have unit second moment (the model pools their negations too, as
    airbench's negated filters do). Computed in float64 on the host.
    """
    eigenvalues, eigenvectors = np.linalg.eigh(np.asarray(moments, np.float64))  # ascending
    return eigenvectors[:, ::-1][:, :count] / np.sqrt(eigenvalues[::-1][:count] + eps)


@dataclass(frozen=True)
class ConvNet:
    """A speedrun-family network: 3x3 convolutions, each (2x2 max) pooled where said, batch-normed and
    ReLU'd (pooling before the norm makes its elementwise work a quarter), the last map flattened into
    a hidden layer and a linear head. The first convolution reads the 28x28 pixels themselves with a
    few filters (with --whiten: directions of a 3x3 patch) and always pools; the negations of its
    responses are pooled too, so ReLU keeps both signs, for the cost of the filters alone. Why each
    part is there: docs/speedrun.md."""

    filters: tuple[int, ...]  # filters each convolution computes
    pools: tuple[bool, ...]  # whether each convolution after the first is pooled
    hidden: int = 256
    scaled_norm: bool = False  # each batch norm also trains a per-channel scale (from 1)

    @property
    def widths(self) -> tuple[int, ...]:
        """Channels each convolution hands on (the first's filters and their negations)."""
        return (2 * self.filters[0], *self.filters[1:])

    @functools.cached_property  # a frozen dataclass still takes it: the cache bypasses __setattr__
    def sides(self) -> tuple[int, ...]:
        """The side each convolution reads, then the side of the flattened map (odd sides keep their edge)."""
        sides = [IMAGE_SIDE]
        for pool in (True, *self.pools):
            sides.append((sides[-1] + 1) // 2 if pool else sides[-1])
        return tuple(sides)

    @property
    def fan_ins(self) -> tuple[int, ...]:  # 3x3 patches of the pixels, then of each width
        return tuple(9 * c for c in (1, *self.widths[:-1]))

    @property
    def flat(self) -> int:
        return self.sides[-1] ** 2 * self.widths[-1]

    def macs(self) -> list[int]:
        convs = [side * side * fan_in * filters  # the first layer's negations cost no MACs
                 for side, fan_in, filters in zip(self.sides[:-1], self.fan_ins, self.filters, strict=True)]
        return [*convs, self.flat * self.hidden, self.hidden * NUM_CLASSES]

    def init(self, key) -> dict:
        keys = jax.random.split(key, len(self.filters) + 2)
        params = {"stats": {}}
        for i, (k, fan_in, filters, width) in enumerate(zip(keys, self.fan_ins, self.filters, self.widths, strict=False)):
            params[f"conv{i}"] = {"w": _he_normal(k, (3, 3, fan_in // 9, filters), fan_in),
                                  "bias": jnp.zeros((width,), jnp.float32)}
            if self.scaled_norm:
                params[f"conv{i}"]["scale"] = jnp.ones((width,), jnp.float32)
            params["stats"][f"conv{i}"] = {"mean": jnp.zeros((width,), jnp.float32),
                                           "var": jnp.ones((width,), jnp.float32)}
        params["dense"] = {"w": _he_normal(keys[-2], (self.flat, self.hidden), self.flat),
                           "b": jnp.zeros((self.hidden,), jnp.float32)}
        head = (self.hidden, NUM_CLASSES)
        params["head"] = {"w": (_flat_normal(keys[-1], head) / math.sqrt(self.hidden)).reshape(head),
                          "b": jnp.zeros((NUM_CLASSES,), jnp.float32)}
        return params

    def forward(self, params: dict, images, compute_dtype=jnp.float32, train: bool = False):
        """(logits, running statistics): in training batch statistics normalize and update them."""
        stats = {}

        def normed(x, name):
            x, stats[name] = layers.batch_norm(x, params[name]["bias"], params["stats"][name], train, BN_MOMENTUM,
                                               scale=params[name].get("scale"))  # present where init gave one
            return jax.nn.relu(x)

        def weights(name):
            return params[name]["w"].astype(compute_dtype)

        x = ((images.reshape(images.shape[0], IMAGE_SIDE, IMAGE_SIDE) - PIXEL_MEAN) / PIXEL_STD).astype(compute_dtype)
        x = normed(layers.signed_max_pool2x2_planes(layers.conv3x3_same_planes(x, weights("conv0"))), "conv0")
        for i, pool in enumerate(self.pools, start=1):
            x = self.block(x, weights(f"conv{i}"), pool, functools.partial(normed, name=f"conv{i}"))
        x = jax.nn.relu(_dense(x.reshape(x.shape[0], -1), params["dense"], compute_dtype))
        return _dense(x, params["head"], compute_dtype).astype(jnp.float32), stats

    def block(self, x, w, pool: bool, normed: Callable):
        """One convolution after the first: (B, H, W, C) -> its output, pooled where said, then normed."""
        y = layers.conv3x3_same(x, w)
        return normed(layers.max_pool2x2(y) if pool else y)

    def apply(self, params: dict, images, compute_dtype=jnp.float32):
        return self.forward(params, images, compute_dtype, train=False)[0]

    def apply_train(self, params: dict, images, compute_dtype=jnp.float32):
        return self.forward(params, images, compute_dtype, train=True)

    def whitening(self, images_u8) -> Callable[[dict], dict]:
        """Set the first convolution to whiten the 3x3 pixel patches it reads, as fitted once to the
        first WHITEN_IMAGES training images: its filters are their leading directions."""
        images = np.asarray(images_u8[:WHITEN_IMAGES], np.float32).reshape(-1, IMAGE_SIDE, IMAGE_SIDE) / 255.0
        filters = whitening_filters(patch_moments((images - PIXEL_MEAN) / PIXEL_STD), self.filters[0])  # (9, filters)
        weights = jnp.asarray(filters.reshape(3, 3, 1, -1), jnp.float32)  # HWIO, as the convolutions read it
        return lambda params: {**params, "conv0": {**params["conv0"], "w": weights}}

    def model(self, name: str) -> Model:
        return Model(name, self.init, self.apply, _train_flops(self.macs()),
                     description=f"3x3 convs ({'-'.join(map(str, self.widths))}) at sides "
                                 f"{'-'.join(map(str, self.sides[:-1]))}, each batch-normed"
                                 f"{' (trained scale)' if self.scaled_norm else ''}, "
                                 f"dense({self.hidden})-10, ReLU",
                     apply_train=self.apply_train, whitening=self.whitening, whitened=("conv0", "w"),
                     whitened_grad_flops=2 * self.macs()[0])


# The speedrun network (the 94% recipe's and the record attempt's): 9 filters at 28x28 (a 3x3 patch has 9 directions), two of 48 at 14x14 (a
# second one lifted seeds 0-4 from 93.73% to 94.22%; 48 wide instead of 64 trains 1.4x faster per
# example, and the recipe's extra epochs buy the accuracy back: docs/speedrun.md, "48 wide"), 128 at 7x7,
# and a 128-unit hidden layer: at batch 16 a step reads, updates and moves every dense weight, so
# halving them made a step 7% faster for the same accuracy ("A narrower hidden layer, and max
# pooling's gradient to the first maximum"); 51.6 MFLOP of training per example.
SPEEDRUN = ConvNet(filters=(9, 48, 48, 128), pools=(False, True, True), hidden=128)

# The best-accuracy recipe's network: the same first layer, three 64-wide convolutions at 14x14 and
# 128 at 7x7; 123.99 MFLOP of training per example. A third 14x14 convolution lifted seed 0 more
# than twice the width did at about three quarters of its FLOPs (docs/speedrun.md, "Toward 95%").
# Its batch norms train a scale too: that lifted each of seeds 0-2 (by 0.03-0.15) for no measurable
# time, where in the record it did not help (docs/speedrun.md, "A trainable scale in deep").
DEEP = ConvNet(filters=(9, 64, 64, 64, 128), pools=(False, False, True, True), scaled_norm=True)


REGISTRY: dict[str, Model] = {
    "mlp": Model(
        "mlp", mlp_init, mlp_apply,
        _train_flops([a * b for a, b in zip(MLP_WIDTHS[:-1], MLP_WIDTHS[1:], strict=True)]),
        description="784-256-128-10 GELU MLP (the codelab's)",
    ),
    "cnn": Model(
        "cnn", cnn_init, cnn_apply, _train_flops(_cnn_macs()),
        description="conv3x3(32)-pool-conv3x3(64)-pool-dense(256)-10, GELU",
    ),
    "speedrun": SPEEDRUN.model("speedrun"),
    "deep": DEEP.model("deep"),
}


def get(name: str) -> Model:
    try:
        return REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown model {name!r} (choose from {', '.join(REGISTRY)})") from None


def count_params(params) -> int:
    return sum(int(x.size) for x in jax.tree_util.tree_leaves(params))


def param_table(params) -> list[dict]:
    """One row per leaf: its path, shape and dtype."""
    rows = []
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        rows.append({"leaf": jax.tree_util.keystr(path), "shape": list(leaf.shape),
                     "dtype": str(leaf.dtype), "size": int(leaf.size)})
    return rows
