"""Will N models fit? The training state's size per member, and the device memory free for it.

Checked before anything compiles: a run of too many members is refused with the largest count
that fits, instead of failing deep inside XLA's allocator (or swapping a laptop to a halt).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import numpy as np

from fashionjax import config as config_lib
from fashionjax import train
from fashionjax.config import ConfigError, TrainConfig

# What a training step holds per member beyond its state: the gradients and the updates, each the
# size of the parameters. Activations are not counted (they depend on the batch and XLA's fusion).
TRANSIENT_PARAM_COPIES = 2


def member_bytes(config: TrainConfig, schedule_steps: int, num_examples: int | None = None) -> int:
    """Bytes one member needs: its parameters, its optimizer state (with --focus, its state for
    num_examples training images), its gradients and its updates."""
    single = dataclasses.replace(config, seeds=1, sweep=())
    state = jax.eval_shape(lambda: train.initial_state(single, schedule_steps, num_examples=num_examples))
    params = sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(state.params))
    whole = sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(state))
    return int(whole + TRANSIENT_PARAM_COPIES * params)


def free_bytes(device) -> int | None:
    """Memory free for this run on the device: an accelerator's own, a CPU's the host's available."""
    stats = device.memory_stats() if device.platform != "cpu" else None
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"] - stats.get("bytes_in_use", 0))
    meminfo = Path("/proc/meminfo")
    if meminfo.is_file():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return None


def check(config: TrainConfig, schedule_steps: int, data_bytes: int, device, num_examples: int | None = None) -> dict:
    """Refuse (ConfigError, naming the largest count that fits) a run whose members' state would not
    fit the device; returns the estimate otherwise."""
    members = config_lib.member_count(config)
    per_member = member_bytes(config, schedule_steps, num_examples)
    free = free_bytes(device)
    estimate = {"members": members, "bytes_per_member": per_member, "bytes": members * per_member + data_bytes,
                "free_bytes": free}
    if free is not None and estimate["bytes"] > free:
        fits = max(int(np.floor((free - data_bytes) / per_member)), 0)
        raise ConfigError(f"{members} models need about {_gib(estimate['bytes'])} for their training state "
                          f"({_gib(per_member)} each, beside {_gib(data_bytes)} of data) but {device.platform} "
                          f"device {device.id} has {_gib(free)} free: at most {fits} fit")
    return estimate


def _gib(count: float) -> str:
    return f"{count / 2**30:.2f} GiB"
