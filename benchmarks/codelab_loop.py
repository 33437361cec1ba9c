"""The codelab's own training loop, re-implemented faithfully for comparison.

Its choices, kept on purpose: float32 images pre-scaled on the host and batched once on the device,
a dict-of-arrays MLP, optax.adamw(3e-3, weight_decay=1e-4), one jitted step per Python iteration
(no buffer donation), the batch picked by eager indexing, and a host read every 25 steps.
"""

from __future__ import annotations

import math
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

BATCH_SIZE = 512
LOG_EVERY = 25
LEARNING_RATE = 3e-3


def init_params(key):
    k1, k2, k3 = jax.random.split(key, 3)
    return {
        "w1": jax.random.normal(k1, (784, 256), jnp.float32) * math.sqrt(2.0 / 784),
        "b1": jnp.zeros((256,), jnp.float32),
        "w2": jax.random.normal(k2, (256, 128), jnp.float32) * math.sqrt(2.0 / 256),
        "b2": jnp.zeros((128,), jnp.float32),
        "w3": jax.random.normal(k3, (128, 10), jnp.float32) * math.sqrt(2.0 / 128),
        "b3": jnp.zeros((10,), jnp.float32),
    }


def forward(params, x):
    x = jax.nn.gelu(x @ params["w1"] + params["b1"])
    x = jax.nn.gelu(x @ params["w2"] + params["b2"])
    return x @ params["w3"] + params["b3"]


def loss_with_metrics(params, batch):
    x, y = batch
    logits = forward(params, x)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    return loss, {"accuracy": jnp.mean(jnp.argmax(logits, axis=-1) == y)}


optimizer = optax.adamw(learning_rate=LEARNING_RATE, weight_decay=1e-4)


@jax.jit
def train_step(params, opt_state, batch):
    (loss, metrics), grads = jax.value_and_grad(loss_with_metrics, has_aux=True)(params, batch)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    return params, opt_state, {"loss": loss, "accuracy": metrics["accuracy"], "grad_norm": optax.tree.norm(grads)}


def make_batches(images_u8: np.ndarray, labels: np.ndarray, batch_size: int = BATCH_SIZE):
    """The codelab's prepare_images + make_fixed_batches: float32 on the device, trailing rows dropped."""
    order = np.random.default_rng(0).permutation(len(images_u8))
    x = images_u8[order].astype(np.float32).reshape(len(order), -1) / 255.0
    y = labels[order].astype(np.int32)
    usable = (len(x) // batch_size) * batch_size
    x = jax.device_put(x[:usable].reshape(-1, batch_size, 784))
    y = jax.device_put(y[:usable].reshape(-1, batch_size))
    return x, y


class CodelabLoop:
    """State of one codelab-style run; `run(steps)` times its loop and returns examples/sec."""

    def __init__(self, images_u8, labels):
        self.x_batches, self.y_batches = make_batches(images_u8, labels)
        self.params = init_params(jax.random.key(3))
        self.opt_state = optimizer.init(self.params)
        self.step = 0
        self.history = []
        first = (self.x_batches[0], self.y_batches[0])
        jax.block_until_ready(train_step(self.params, self.opt_state, first))  # the codelab's warm-up call

    def run(self, steps: int) -> float:
        start = time.perf_counter()
        metrics = None
        for _ in range(steps):
            i = self.step % self.x_batches.shape[0]
            self.params, self.opt_state, metrics = train_step(
                self.params, self.opt_state, (self.x_batches[i], self.y_batches[i]))
            if self.step % LOG_EVERY == 0:
                metrics = jax.block_until_ready(metrics)
                self.history.append({"step": self.step, "loss": float(metrics["loss"])})
            self.step += 1
        jax.block_until_ready((self.params, self.opt_state, metrics))
        self.last_loss = float(metrics["loss"])
        return steps * BATCH_SIZE / (time.perf_counter() - start)
