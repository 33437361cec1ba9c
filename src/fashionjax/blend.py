"""Blends: finished runs scored together as one classifier, by the weighted mean of their probabilities.

Each run is scored as it scores itself (its model, dtype, TTA and members) on every test image once;
the blend predicts the class of highest weighted mean probability. Runs of different models blend
as readily as seeds of one: that is what `fashionjax speedrun --blend` adds to each seed.
"""

from __future__ import annotations

import jax
import numpy as np

from fashionjax import config as config_lib
from fashionjax import evaluate, models


def combine(probabilities: list[np.ndarray], weights: list[float]) -> np.ndarray:
    """The weighted mean of several (N, 10) probability arrays: (N, 10), rows summing to 1."""
    total = sum(weights)
    return sum(weight * probs for weight, probs in zip(weights, probabilities, strict=True)) / total


def probabilities(classify, images: np.ndarray, batch_size: int) -> np.ndarray:
    """(N, 10) float64 softmax of classify's logits for images (N, 28, 28) in [0, 1]."""
    compiled = jax.jit(lambda batch: jax.nn.softmax(classify(batch)))
    return evaluate.in_fixed_batches(compiled, images, batch_size).astype(np.float64)


def accuracy(probs: np.ndarray, labels: np.ndarray) -> float:
    return float(np.mean(probs.argmax(-1) == labels))


def score(runs: list, weights: list[float], images_u8: np.ndarray, labels: np.ndarray, batch_size: int = 1000) -> dict:
    """The blend of finished runs (run.Trained) at these weights on every image: its accuracy with each
    run's own test-time augmentation and without any, and each run's own figures."""
    images = images_u8.reshape(-1, models.IMAGE_SIDE, models.IMAGE_SIDE).astype(np.float32) / 255.0
    scored, plain, parts = [], [], []
    for trained, weight in zip(runs, weights, strict=True):
        config = trained.config
        scored.append(probabilities(evaluate.run_classifier(config, trained.params), images, batch_size))
        plain.append(probabilities(evaluate.classifier(config.model, trained.params, config.dtype, tta=False,
                                                       members=config_lib.member_count(config)), images, batch_size)
                     if config.tta else scored[-1])
        parts.append({"run_dir": str(trained.run_dir), "model": config.model, "seed": config.seed, "weight": weight,
                      "checkpoint_step": trained.step, "test_accuracy": accuracy(scored[-1], labels),
                      "test_accuracy_no_tta": accuracy(plain[-1], labels)})
    return {"test_accuracy": accuracy(combine(scored, weights), labels),
            "test_accuracy_no_tta": accuracy(combine(plain, weights), labels), "runs": parts}
