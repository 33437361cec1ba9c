"""Several members at once on a CPU: one compiled program per core, each called from its own thread.

A training step on a CPU leaves a core idle for much of its time: between the matmuls, which use
every core, runs a chain of small fusions on one thread. XLA:CPU overlaps no independent work
within one program (two members' scans in one program ran one after the other), but two programs
called at once from two threads do overlap. On 2 cores of an Intel Xeon two speedrun members
trained 1.30-1.34 times as fast that way as one after the other (docs/speedrun.md, "Two members at
once: lanes"). So a run's members are split into contiguous groups, one lane per core; each lane trains
its group with the same chunk over fewer members, and their states and metrics are joined again at
the chunk's end. Each member computes what the one program would (bitwise for the mlp and speedrun
models, tested), except that a member alone in its lane runs without the members' loop, where XLA
may round the cnn's convolutions or Muon's orthogonalization differently (by about 1e-8).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp


def cores() -> int:
    """The cores this process may run on (its affinity, where the OS says)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def count(members: int, mesh) -> int:
    """How many lanes train `members` models: one per core, at most one per member, on a CPU with
    one device in one process. Elsewhere one program holds them all: an accelerator batches the
    members' steps into one (vmap), and a mesh of several devices shards each batch over them."""
    if members == 1 or jax.default_backend() != "cpu" or mesh.devices.size > 1 or jax.process_count() > 1:
        return 1
    return min(members, cores())


def groups(members: int, lanes: int) -> list[tuple[int, int]]:
    """(first member, size) of each lane: contiguous, their sizes differing by one at most."""
    sizes = [members // lanes + (lane < members % lanes) for lane in range(lanes)]
    starts = [sum(sizes[:lane]) for lane in range(lanes)]
    return list(zip(starts, sizes, strict=True))


def members_of(tree, start, size: int):
    """The `size` members of a stacked tree from `start` (traced) on; one member loses the member axis."""
    if size == 1:
        return jax.tree.map(lambda leaf: jax.lax.dynamic_index_in_dim(leaf, start, keepdims=False), tree)
    return jax.tree.map(lambda leaf: jax.lax.dynamic_slice_in_dim(leaf, start, size), tree)


@jax.jit
def join(outputs: list):
    """The lanes' (state, metrics), each with a member axis, concatenated along it in lane order."""
    return jax.tree.map(lambda *leaves: jnp.concatenate(leaves), *outputs)


class Lanes:
    """Called like the one compiled chunk: (state, perms, first_epoch, images_u8, labels, keys) ->
    (state, metrics), the members along the leading axis; `lanes` holds each lane's compiled program
    (start, *arguments) -> its members' (state, metrics), and its start as a placed int32."""

    def __init__(self, lanes: list[tuple[Callable, jax.Array]]):
        self.lanes = lanes
        # The calling thread trains the first lane, these threads the others. Kept for the object's
        # life: starting threads for every chunk cost about 2 ms a chunk (measured with 1-step chunks).
        self.pool = ThreadPoolExecutor(len(lanes) - 1, thread_name_prefix="fashionjax-lane")

    def __call__(self, *arguments):
        def train_lane(lane):
            program, start = lane
            with jax.transfer_guard("disallow"):  # the guard is per thread: the hot path's rule holds here too
                return jax.block_until_ready(program(start, *arguments))  # the thread holds its core until done

        others = [self.pool.submit(train_lane, lane) for lane in self.lanes[1:]]
        first = train_lane(self.lanes[0])
        return join([first, *(other.result() for other in others)])
