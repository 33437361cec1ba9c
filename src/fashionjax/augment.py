"""Training-time augmentation: flips (random or alternating) and small shifts, as pure functions
of the run's key streams and the step, so that a resumed run sees the very same batches.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from fashionjax.config import TrainConfig
from fashionjax.plan import Plan


def cutout(key, images, side: int):
    """Black out a side x side square centred at a random pixel of each image (cut off at the edges):
    (B, H, W) -> (B, H, W). The square's top-left is centre - side // 2."""
    batch, height, width = images.shape
    centres = jax.random.randint(key, (batch, 2), 0, jnp.array([height, width]))
    top_left = centres - side // 2
    rows = jnp.arange(height)[None, :] - top_left[:, :1]  # (B, H): row offset into the square
    cols = jnp.arange(width)[None, :] - top_left[:, 1:]
    inside = ((rows >= 0) & (rows < side))[:, :, None] & ((cols >= 0) & (cols < side))[:, None, :]
    return jnp.where(inside, jnp.zeros((), images.dtype), images)


def augment_batch(key, images_u8, max_shift: int = 1, flips=None, cutout_side: int = 0):
    """Horizontal flips, random shifts of up to max_shift pixels and cutout: (B, 784) uint8 -> (B, 784) uint8.

    flips: which images to mirror, (B,) bool; random when None. One pixel of shift, not two, for the
    cnn: with two it underfit in 15 epochs (92.48% against 93.11%).
    """
    batch = images_u8.shape[0]
    images = images_u8.reshape(batch, 28, 28)
    flip_key, shift_key = jax.random.split(key)
    if flips is None:
        flips = jax.random.bernoulli(flip_key, 0.5, (batch,))
    images = jnp.where(flips[:, None, None], images[:, :, ::-1], images)
    if max_shift:
        pad = ((0, 0), (max_shift, max_shift), (max_shift, max_shift))
        padded = jnp.pad(images, pad)  # (B, 28 + 2s, 28 + 2s)
        offsets = jax.random.randint(shift_key, (batch, 2), 0, 2 * max_shift + 1)
        crop = jax.vmap(lambda image, at: jax.lax.dynamic_slice(image, (at[0], at[1]), (28, 28)))
        images = crop(padded, offsets)
    if cutout_side:  # its own key, folded from the batch's, so the flips' and shifts' draws stay as they were
        images = cutout(jax.random.fold_in(key, 2), images, cutout_side)
    return images.reshape(batch, -1)


def alternating_flips(key, indices, epoch):
    """Each example's own coin, inverted in odd epochs: (B,) bool.

    Over any two consecutive epochs every image is seen once as it is and once mirrored (airbench's
    derandomized flips), where independent coins would show some images one way twice.
    """
    coins = jax.vmap(lambda index: jax.random.bernoulli(jax.random.fold_in(key, index)))(indices)
    return coins ^ (epoch % 2 == 1)


def make_augment(config: TrainConfig) -> Callable | None:
    """augment(step, images_u8, indices, keys) -> images_u8 for a run with --augment, else None.

    keys holds the raw key data of the run's "augment" and "flips" streams (augment_keys). Each
    batch's key is folded from the step into the augmentation stream (and alternating flips read
    the example indices and the epoch), so the augmentation is a pure function of the seed and the
    step: resume stays bit-identical.
    """
    if not config.augment:
        return None

    def augment(step, images_u8, indices, keys, steps_per_epoch):
        flips = None
        if config.alternate_flips:
            flips = alternating_flips(jax.random.wrap_key_data(keys["flips"]), indices, step // steps_per_epoch)
        return augment_batch(jax.random.fold_in(jax.random.wrap_key_data(keys["augment"]), step), images_u8,
                             config.max_shift, flips, config.cutout)

    return augment


def augment_keys(plan: Plan) -> dict[str, np.ndarray]:
    """The raw key data augmentation reads: {"augment", "flips"}, (2,) or (members, 2) each."""
    return {purpose: plan.key_data(purpose) for purpose in ("augment", "flips")}
