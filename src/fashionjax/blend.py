"""Blends: finished runs scored together as one classifier, by the weighted mean of their probabilities.

Each run is scored as it scores itself (its model, dtype, TTA and members) on every test image once;
the blend predicts the class of highest weighted mean probability. Runs of different models blend
as readily as seeds of one: that is what `fashionjax speedrun --blend` adds to each seed.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from fashionjax import config as config_lib
from fashionjax import evaluate, models
from fashionjax.train import scale_images


def combine(probabilities: list[np.ndarray], weights: list[float]) -> np.ndarray:
    """The weighted mean of several (N, 10) probability arrays: (N, 10), rows summing to 1."""
    total = sum(weights)
    return sum(weight * probs for weight, probs in zip(weights, probabilities, strict=True)) / total


@functools.partial(jax.jit, static_argnums=0)
def _both(scoring: tuple, params, batch_u8):
    """(B, 784) uint8 -> (B, 2, 10): the softmax of a run's scored logits and of its plain ones.
    scoring is classifier_and_plain's other arguments, with the Model itself (whose functions key the
    compiled program) for its name. The parameters are an argument, as evaluation passes them, not
    constants: one compiled program serves every run of a recipe."""
    model, dtype, tta, members, tta_shift = scoring
    classify_and_plain = evaluate.classifier_and_plain(model.name, params, dtype, tta, members, tta_shift)
    images = scale_images(batch_u8).reshape(-1, models.IMAGE_SIDE, models.IMAGE_SIDE)
    return jnp.stack([jax.nn.softmax(logits) for logits in classify_and_plain(images)], axis=1)


def probabilities(config, params, images_u8: np.ndarray, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
    """The softmax of a run's logits, as its config scores them and without TTA, for images_u8 (N, 784):
    two (N, 10) float64 arrays, from one pass over the images."""
    scoring = (models.get(config.model), config.dtype, config.tta, config_lib.member_count(config), config.tta_shift)
    stacked = evaluate.in_fixed_batches(functools.partial(_both, scoring, params),
                                        images_u8.reshape(len(images_u8), -1), batch_size)
    return stacked[:, 0].astype(np.float64), stacked[:, 1].astype(np.float64)


def accuracy(probs: np.ndarray, labels: np.ndarray) -> float:
    return float(np.mean(probs.argmax(-1) == labels))


def score(runs: list, weights: list[float], images_u8: np.ndarray, labels: np.ndarray, batch_size: int = 1000) -> dict:
    """The blend of finished runs (run.Trained) at these weights on every image: its accuracy with each
    run's own test-time augmentation and without any, and each run's own figures."""
    scored, plain, parts = [], [], []
    for trained, weight in zip(runs, weights, strict=True):
        config = trained.config
        run_scored, run_plain = probabilities(config, trained.params, images_u8, batch_size)
        scored.append(run_scored)
        plain.append(run_plain)
        parts.append({"run_dir": str(trained.run_dir), "model": config.model, "seed": config.seed, "weight": weight,
                      "checkpoint_step": trained.step, "test_accuracy": accuracy(run_scored, labels),
                      "test_accuracy_no_tta": accuracy(run_plain, labels)})
    return {"test_accuracy": accuracy(combine(scored, weights), labels),
            "test_accuracy_no_tta": accuracy(combine(plain, weights), labels), "runs": parts}
