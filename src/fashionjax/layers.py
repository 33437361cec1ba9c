"""Pure layer functions shared by the models: convolutions as matmuls, pooling, batch norm.

XLA's CPU convolutions (and their gradients) run far below its matmul speed at these small
shapes, so each convolution here is one matmul over shifted views (im2col); shifted slices cost
only data movement, and their gradients are pads and slices. On one-channel images, where that
matmul would be only 9 wide, it is nine multiply-adds over shifted planes instead. A GPU with large
batches is the exception: there cuDNN's convolutions win.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def taps3x3(x, height: int, width: int) -> list:
    """The nine views x[:, i:i + height, j:j + width] (i, j = 0..2, row by row) of an array of at least
    (height + 2, width + 2) on axes 1 and 2: what each tap of a 3x3 window reads. NumPy or JAX."""
    return [x[:, i:i + height, j:j + width] for i in range(3) for j in range(3)]


# From this batch size up, a GPU runs XLA's own convolution (cuDNN's) instead of im2col. Training
# the speedrun net on an H200 it was 9-38% faster at 512-1024 and 19-27% slower at 16; at 256 it
# was 4.1% faster in bfloat16 and 1.2% slower in float32, at 128 7.3% faster and 3.5% slower
# (docs/speedrun.md, "On a GPU"). CPUs always use im2col.
GPU_CONV_MIN_BATCH = 256


def conv3x3_same(x, w, native: bool | None = None):
    """A 3x3 'SAME' convolution: (B, H, W, C) x (3, 3, C, K) -> (B, H, W, K), one matmul (im2col), or
    XLA's convolution where `native` (by default: on a GPU, for batches of GPU_CONV_MIN_BATCH or more)."""
    batch, height, width, channels = x.shape
    backend = jax.default_backend()
    if native is None:
        native = backend == "gpu" and batch >= GPU_CONV_MIN_BATCH
    if native:
        return jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
    padded = jnp.pad(x, ((0, 0), (1, 1), (1, 1), (0, 0)))
    patches = jnp.concatenate(taps3x3(padded, height, width), axis=-1)  # (B, H, W, 9C)
    weights = w.reshape(9 * channels, -1)  # HWIO flattens in the same (i, j, c) order
    if backend == "cpu":
        return patches_matmul(patches.reshape(-1, 9 * channels), weights).reshape(batch, height, width, -1)
    return patches @ weights


@jax.custom_vjp
def patches_matmul(patches, weights):
    """patches @ weights, (N, F) x (F, K), whose weight gradient runs in XLA:CPU's fast matmul path.

    Left alone, XLA writes the weight gradient patches^T @ grad as one dot contracting the patches'
    first axis, a form its CPU backend hands to a generic kernel at about 60% of the speed of its
    (M, K) x (K, N) dots. Here it is (grad^T @ patches)^T, with barriers that keep XLA from folding
    the transposes back: 1.6x faster for the speedrun net's 3136x432 patches (docs/speedrun.md)."""
    return patches @ weights


def _patches_matmul_fwd(patches, weights):
    return patches @ weights, (patches, weights)


def _patches_matmul_bwd(saved, grad):
    patches, weights = saved
    barrier = jax.lax.optimization_barrier
    return grad @ weights.T, barrier(barrier(grad.T) @ patches).T


patches_matmul.defvjp(_patches_matmul_fwd, _patches_matmul_bwd)


def max_pool2x2(x):
    """2x2 max pooling, stride 2: (B, H, W, C) -> (B, ceil(H/2), ceil(W/2), C); odd sides keep their edge."""
    batch, height, width, channels = x.shape
    if height % 2 or width % 2:
        x = jnp.pad(x, ((0, 0), (0, height % 2), (0, width % 2), (0, 0)), constant_values=-jnp.inf)
        height, width = height + height % 2, width + width % 2
    return window_max(x.reshape(batch, height // 2, 2, width // 2, 2, channels))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def window_max(blocks, row_axis: int = 2):
    """The maximum of each 2x2 window of blocks laid out (..., H, 2, W, 2, ...), with the window's
    rows on `row_axis` and its columns two axes later; its gradient goes to the window's first
    maximum in row order (as PyTorch's max pooling routes it).

    JAX's own rule splits the gradient among tied maxima, and ties are common here (a uniform
    background gives equal responses): it counts them per window, a reduction and a pass of its own.
    Routing to the first maximum trained the speedrun net 3.6-6.8% faster (docs/speedrun.md, "A
    narrower hidden layer, and max pooling's gradient to the first maximum"). Both are valid
    subgradients; they differ only at ties."""
    return blocks.max(axis=(row_axis, row_axis + 2))


def _window_max_fwd(blocks, row_axis):
    maxima = blocks.max(axis=(row_axis, row_axis + 2))
    return maxima, (blocks, maxima)


def _window_max_bwd(row_axis, saved, grad):
    blocks, maxima = saved
    unclaimed, rows = grad, []
    for i in (0, 1):
        row = []
        for j in (0, 1):
            hit = _corner(blocks, row_axis, i, j) == maxima
            row.append(jnp.where(hit, unclaimed, 0))
            unclaimed = jnp.where(hit, 0, unclaimed)
        rows.append(jnp.stack(row, axis=row_axis + 1))
    return (jnp.stack(rows, axis=row_axis),)


def _corner(blocks, row_axis: int, i: int, j: int):
    """The (i, j) corner of every 2x2 window: blocks without the two window axes."""
    index = [slice(None)] * blocks.ndim
    index[row_axis], index[row_axis + 2] = i, j
    return blocks[tuple(index)]


window_max.defvjp(_window_max_fwd, _window_max_bwd)


def conv3x3_same_planes(images, w):
    """A 3x3 'SAME' convolution of one-channel images, channels first: (B, H, W) x (3, 3, 1, K) -> (K, B, H, W).

    With one input channel im2col's patches and its matmul are 9 wide, which vectorizes poorly; nine
    shifted multiply-adds over whole image planes ran 3.5x faster here (AMD EPYC, batch 128, K=9).
    """
    height, width = images.shape[1:]
    padded = jnp.pad(images, ((0, 0), (1, 1), (1, 1)))
    return sum(tap[:, None, None, None] * view[None]
               for tap, view in zip(w.reshape(9, -1), taps3x3(padded, height, width), strict=True))


def signed_max_pool2x2_planes(planes):
    """(K, B, H, W), even sides -> (B, H/2, W/2, 2K): the 2x2 max pooling of each plane, then of its
    negation, channels last (K filters and their negated twins, for the price of K)."""
    count, batch, height, width = planes.shape
    blocks = planes.reshape(count, batch, height // 2, 2, width // 2, 2)
    return jnp.concatenate([window_max(blocks, 3), window_max(-blocks, 3)]).transpose(1, 2, 3, 0)


def batch_norm(x, bias, running: dict, train: bool, momentum: float, eps: float = 1e-5, scale=None):
    """Batch norm with a trainable bias and a fixed unit scale (as airbench does), or a trainable
    per-channel scale where one is given; returns (y, running').

    In training the batch's own statistics normalize and are folded into the running averages
    (running' = momentum * running + (1 - momentum) * batch); in evaluation the running averages
    normalize and are returned unchanged. Statistics are float32 whatever the compute dtype.
    """
    x32 = x.astype(jnp.float32)
    if train:
        axes = tuple(range(x.ndim - 1))
        mean, var = x32.mean(axes), x32.var(axes)
        running = {"mean": momentum * running["mean"] + (1 - momentum) * jax.lax.stop_gradient(mean),
                   "var": momentum * running["var"] + (1 - momentum) * jax.lax.stop_gradient(var)}
    else:
        mean, var = running["mean"], running["var"]
    normalized = (x32 - mean) * jax.lax.rsqrt(var + eps)
    y = normalized + bias if scale is None else normalized * scale + bias
    return y.astype(x.dtype), running
