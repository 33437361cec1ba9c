"""Typed, frozen configuration: dataclasses, their validation and presets.

Nothing here reads files or flags; the CLI builds these and the library consumes them.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

MODELS = ("mlp", "cnn")  # kept in step with models.REGISTRY by a test
OPTIMIZERS = ("adamw", "adam", "sgd")
SCHEDULES = ("constant", "cosine")
DTYPES = ("float32", "bfloat16")


class ConfigError(ValueError):
    """A configuration that cannot run; the message says which value and why."""


@dataclass(frozen=True)
class TrainConfig:
    model: str = "mlp"
    epochs: int | None = 10  # used when steps is None
    steps: int | None = None
    batch_size: int = 512
    optimizer: str = "adamw"
    lr: float = 3e-3
    schedule: str = "cosine"
    warmup_steps: int = 100  # cosine only
    weight_decay: float = 1e-4
    momentum: float = 0.9  # sgd only
    clip_norm: float | None = None
    dtype: str = "float32"
    augment: bool = False  # random flips and 2-pixel shifts of each training batch
    seed: int = 0
    log_every: int = 25
    checkpoint_every: int | None = None  # None: once an epoch
    keep: int = 3
    eval_batch_size: int = 1000

    def total_steps(self, num_train_examples: int) -> int:
        if self.steps is not None:
            return self.steps
        return self.epochs * (num_train_examples // self.batch_size)


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def validate(config: TrainConfig, num_train_examples: int | None = None) -> TrainConfig:
    """Return the config unchanged, or raise ConfigError naming the first bad value."""
    _require(config.model in MODELS, f"unknown model {config.model!r} (choose from {', '.join(MODELS)})")
    _require(config.optimizer in OPTIMIZERS,
             f"unknown optimizer {config.optimizer!r} (choose from {', '.join(OPTIMIZERS)})")
    _require(config.schedule in SCHEDULES,
             f"unknown schedule {config.schedule!r} (choose from {', '.join(SCHEDULES)})")
    _require(config.dtype in DTYPES, f"unknown dtype {config.dtype!r} (choose from {', '.join(DTYPES)})")
    _require(math.isfinite(config.lr) and config.lr > 0, f"learning rate must be a positive finite number, got {config.lr}")
    _require(math.isfinite(config.weight_decay) and config.weight_decay >= 0,
             f"weight decay must be >= 0, got {config.weight_decay}")
    _require(config.clip_norm is None or (math.isfinite(config.clip_norm) and config.clip_norm > 0),
             f"clip norm must be a positive number, got {config.clip_norm}")
    _require(config.batch_size >= 1, f"batch size must be at least 1, got {config.batch_size}")
    _require(config.eval_batch_size >= 1, f"eval batch size must be at least 1, got {config.eval_batch_size}")
    _require(config.log_every >= 1, f"--log-every must be at least 1, got {config.log_every}")
    _require(config.keep >= 1, f"--keep must be at least 1, got {config.keep}")
    _require(config.warmup_steps >= 0, f"warmup steps must be >= 0, got {config.warmup_steps}")
    _require(config.checkpoint_every is None or config.checkpoint_every >= 1,
             f"--checkpoint-every must be at least 1, got {config.checkpoint_every}")
    if config.steps is not None:
        _require(config.steps >= 1, f"--steps must be at least 1, got {config.steps}")
    else:
        _require(config.epochs is not None and config.epochs >= 1, f"--epochs must be at least 1, got {config.epochs}")
    if num_train_examples is not None:
        _require(config.batch_size <= num_train_examples,
                 f"batch size {config.batch_size} is larger than the training set ({num_train_examples} examples)")
    return config


def default(model: str = "mlp") -> TrainConfig:
    """The recommended recipe for each model."""
    if model == "cnn":
        return TrainConfig(model="cnn", epochs=15, batch_size=256, lr=2e-3, weight_decay=5e-4, augment=True)
    return TrainConfig(model=model)


def codelab() -> TrainConfig:
    """The codelab's run: 400 constant-rate AdamW steps at batch 512."""
    return dataclasses.replace(TrainConfig(), steps=400, epochs=None, schedule="constant")


# Fields that define a run's trajectory: resuming with any of them changed is refused.
TRAJECTORY_FIELDS = ("model", "batch_size", "optimizer", "lr", "schedule", "warmup_steps",
                     "weight_decay", "momentum", "clip_norm", "dtype", "augment", "seed")
