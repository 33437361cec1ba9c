"""Blends: finished runs scored together as one classifier, by the weighted mean of their probabilities.

Each run is scored as it scores itself (its model, dtype, TTA and members) on every test image once;
the blend predicts the class of highest weighted mean probability. Runs of different models blend
as readily as seeds of one: that is what `fashionjax speedrun --blend` adds to each seed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from fashionjax import evaluate, models
from fashionjax.train import scale_images


def combine(probabilities: list[np.ndarray], weights: list[float]) -> np.ndarray:
    """The weighted mean of several (N, 10) probability arrays: (N, 10), rows summing to 1."""
    total = sum(weights)
    return sum(weight * probs for weight, probs in zip(weights, probabilities, strict=True)) / total


def probabilities(classify_and_plain, images_u8: np.ndarray, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
    """The softmax of both of classify_and_plain's logits (scored, plain) for images_u8 (N, 784):
    two (N, 10) float64 arrays, from one pass over the images."""
    def both(batch_u8):  # (B, 784) uint8 -> (B, 2, 10)
        images = scale_images(batch_u8).reshape(-1, models.IMAGE_SIDE, models.IMAGE_SIDE)
        return jnp.stack([jax.nn.softmax(logits) for logits in classify_and_plain(images)], axis=1)

    stacked = evaluate.in_fixed_batches(jax.jit(both), images_u8.reshape(len(images_u8), -1), batch_size)
    return stacked[:, 0].astype(np.float64), stacked[:, 1].astype(np.float64)


def accuracy(probs: np.ndarray, labels: np.ndarray) -> float:
    return float(np.mean(probs.argmax(-1) == labels))


def score(runs: list, weights: list[float], images_u8: np.ndarray, labels: np.ndarray, batch_size: int = 1000) -> dict:
    """The blend of finished runs (run.Trained) at these weights on every image: its accuracy with each
    run's own test-time augmentation and without any, and each run's own figures."""
    scored, plain, parts = [], [], []
    for trained, weight in zip(runs, weights, strict=True):
        config = trained.config
        run_scored, run_plain = probabilities(evaluate.run_classifier(config, trained.params, with_plain=True),
                                              images_u8, batch_size)
        scored.append(run_scored)
        plain.append(run_plain)
        parts.append({"run_dir": str(trained.run_dir), "model": config.model, "seed": config.seed, "weight": weight,
                      "checkpoint_step": trained.step, "test_accuracy": accuracy(run_scored, labels),
                      "test_accuracy_no_tta": accuracy(run_plain, labels)})
    return {"test_accuracy": accuracy(combine(scored, weights), labels),
            "test_accuracy_no_tta": accuracy(combine(plain, weights), labels), "runs": parts}
