"""The resolved plan of a run: the config, the dataset size and the device count, resolved once.

Everything downstream (fit, the compiled chunk, bench, the progress line, checkpoints) reads the
plan instead of deriving batch geometry or step counts again. Checkpoints store it; resume compares
the saved plan with the new one.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import numpy as np

from fashionjax import config as config_lib
from fashionjax import focus
from fashionjax.config import ConfigError, TrainConfig

# The purposes the root key is split into, in order: one split, independent streams. New purposes
# go last: with JAX's partitionable threefry the first keys of a split do not depend on its count.
KEY_PURPOSES = ("init", "data", "augment", "flips")


def root_keys(seed: int) -> dict[str, jax.Array]:
    """{purpose: key}: the root key from the seed, split once by purpose."""
    keys = jax.random.split(jax.random.key(seed), len(KEY_PURPOSES))
    return dict(zip(KEY_PURPOSES, keys, strict=True))


@dataclass(frozen=True)
class Plan:
    batch_size: int  # global
    num_examples: int  # training examples available
    device_count: int
    steps_per_epoch: int
    dropped_per_epoch: int  # the partial batch each epoch leaves out
    total_steps: int
    schedule_steps: int  # the length the learning-rate schedule is laid out over
    log_every: int  # steps per compiled chunk, capped at the run's length
    checkpoint_every: int
    perms_per_chunk: int  # epoch orders one chunk can touch
    seed: int
    members: int = 1  # models trained together (member_seeds), each with its own keys
    seeds: int = 1  # seeds per point of a sweep: member i has seed + i % seeds
    focus_steps: int = 0  # steps of each --focus pass after the first epoch (0: every epoch reads every image)

    def member_seeds(self) -> list[int]:
        return [self.seed + i % self.seeds for i in range(self.members)]

    def epochs(self, step: int) -> float:
        return step / self.steps_per_epoch

    def key_data(self, purpose: str) -> np.ndarray:
        """The raw data of one purpose's key, placeable like any other array: (2,), or (members, 2)
        with each member's key exactly the key of a single run with its seed."""
        if self.members == 1:
            return np.asarray(jax.random.key_data(root_keys(self.seed)[purpose]))
        return np.stack([np.asarray(jax.random.key_data(root_keys(seed)[purpose])) for seed in self.member_seeds()])

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def resolve(config: TrainConfig, num_examples: int, device_count: int = 1,
            schedule_steps: int | None = None) -> Plan:
    """Build and check the plan; raise ConfigError for a geometry that cannot run.

    Args:
      schedule_steps: keep a schedule laid out earlier (a resumed run); default the run's length.
    """
    if config.batch_size > num_examples:
        raise ConfigError(f"batch size {config.batch_size} is larger than the training set ({num_examples} examples)")
    if config.batch_size < 1:
        raise ConfigError(f"batch size must be at least 1, got {config.batch_size}")
    if config.batch_size % device_count:
        raise ConfigError(f"batch size {config.batch_size} does not divide evenly over {device_count} devices")
    steps_per_epoch = num_examples // config.batch_size
    total_steps = config.steps if config.steps is not None else config.epochs * steps_per_epoch
    log_every = min(config.log_every, total_steps)
    return Plan(
        batch_size=config.batch_size,
        num_examples=num_examples,
        device_count=device_count,
        steps_per_epoch=steps_per_epoch,
        dropped_per_epoch=num_examples % config.batch_size,
        total_steps=total_steps,
        schedule_steps=schedule_steps or total_steps,
        log_every=log_every,
        checkpoint_every=config.checkpoint_every or steps_per_epoch,
        perms_per_chunk=log_every // steps_per_epoch + 2,
        seed=config.seed,
        members=config_lib.member_count(config),
        seeds=config.seeds,
        focus_steps=focus.pass_steps(steps_per_epoch, config.focus) if config.focus < 1 else 0,
    )


# What must be equal for a resumed run to continue the same trajectory (the device count is not:
# the data order and the steps do not depend on it).
TRAJECTORY = ("batch_size", "num_examples", "steps_per_epoch", "schedule_steps", "seed", "members", "seeds")


def differences(saved: dict, plan: Plan) -> list[str]:
    """'name saved -> new' for every trajectory quantity that differs."""
    saved = {"members": 1, "seeds": 1, **saved}  # plans saved before multi-model runs existed
    return config_lib.differences(saved, plan.to_dict(), TRAJECTORY)
