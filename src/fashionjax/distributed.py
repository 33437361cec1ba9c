"""The device mesh, shardings and multi-process start-up (jax.sharding, jax.distributed).

Data parallelism only: a 1-D mesh with a "data" axis; batches split along it; parameters and
optimizer state replicated. XLA inserts the gradient all-reduce; there are no hand-written
collectives.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from fashionjax import rendezvous
from fashionjax.config import ConfigError

DATA_AXIS = "data"


HEARTBEAT_SECONDS = 20  # a dead peer is noticed within this, instead of JAX's default 100 s


def parse_address(coordinator: str) -> tuple[str, int]:
    host, _, port = coordinator.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"--coordinator {coordinator!r}: expected HOST:PORT")
    return host.strip("[]"), int(port)


def initialize(coordinator: str | None, num_processes: int | None, process_id: int | None,
               on_lost: Callable[[int, str, str], None], auto: bool = False, timeout: float = 60.0) -> None:
    """Start jax.distributed when asked, or with auto=True from the cluster environment (SLURM, ...).

    With --coordinator, on_lost(process id, kind, detail) runs when another process fails, is stopped
    alone or dies (see rendezvous); rendezvous.leave() ends the watch.
    """
    import jax

    if coordinator is None and num_processes is None and process_id is None and not auto:
        return
    if not auto and (coordinator is None or num_processes is None or process_id is None):
        raise ConfigError("--coordinator, --num-processes and --process-id go together")
    if not auto and not 0 <= process_id < num_processes:
        raise ConfigError(f"--process-id {process_id} is outside 0..{num_processes - 1}")
    if not timeout > 0:
        raise ConfigError(f"--coordinator-timeout must be positive, got {timeout}")
    connections = {}
    if coordinator is not None:  # every process checks in first: a missing one is a one-line error everywhere
        address = parse_address(coordinator)
        connections = rendezvous.check_in(coordinator, address, process_id, num_processes, timeout) if process_id \
            else rendezvous.gather(coordinator, address[1], num_processes, timeout)
    try:
        # CPU processes need a collectives backend for cross-process all-reduce; GPUs use NCCL anyway.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            coordinator_address=coordinator, num_processes=num_processes, process_id=process_id,
            initialization_timeout=max(1, int(timeout)), heartbeat_timeout_seconds=HEARTBEAT_SECONDS,
        )
    except BaseException:
        for connection in connections.values():
            connection.close()
        raise
    if connections:
        rendezvous.watch(process_id, connections, on_lost)


def process_index() -> int:
    import jax

    return jax.process_index()


def make_mesh(devices: str | int = "all"):
    """A 1-D data mesh over all devices, or over the first N of them (single process only)."""
    import jax
    from jax.sharding import Mesh

    available = jax.devices()
    if devices == "all":
        chosen = available
    else:
        count = int(devices)  # the CLI has checked it is a positive integer
        if count < 1 or count > len(available):
            raise ConfigError(f"--devices {count}: this machine has {len(available)} device(s)")
        if count != len(available) and jax.process_count() > 1:
            raise ConfigError("--devices must be 'all' when running on several processes")
        chosen = available[:count]
    return Mesh(np.array(chosen), (DATA_AXIS,))


def replicated(mesh):
    from jax.sharding import NamedSharding, PartitionSpec

    return NamedSharding(mesh, PartitionSpec())


def batch_sharded(mesh):
    from jax.sharding import NamedSharding, PartitionSpec

    return NamedSharding(mesh, PartitionSpec(DATA_AXIS))


def put_replicated(host_array: np.ndarray, mesh):
    """Place a host array on every device of the mesh, in one or many processes (an explicit copy).

    With several processes every one of them must pass the same values.
    """
    import jax

    return jax.device_put(np.asarray(host_array), replicated(mesh))


def replicate_tree(tree, mesh):
    """Replicate a PyTree of (host, local or global) arrays over the mesh."""
    import jax

    return jax.tree_util.tree_map(lambda x: put_replicated(_fetch_one(x), mesh), tree)


def _fetch_one(x) -> np.ndarray:
    import jax
    from jax.experimental import multihost_utils

    if not isinstance(x, jax.Array):
        return np.asarray(x)
    if x.is_fully_addressable:
        return np.asarray(jax.device_get(x))
    if x.sharding.is_fully_replicated:  # every process holds it all: read the local copy
        return np.asarray(jax.device_get(x.addressable_data(0)))
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def agreed_stop(signum: int | None) -> int | None:
    """The stop every process acts on at the same chunk end: a signal pending in any of them.

    A signal often reaches one process only (a scheduler's SIGTERM, a Ctrl-C in one terminal): were
    it to save and leave alone, its checkpoint would wait for the others while they wait for its next
    step. A deliberate sync across processes, once a chunk; a single process asks nobody.
    """
    import jax

    if jax.process_count() == 1:
        return signum
    from jax.experimental import multihost_utils

    with jax.transfer_guard("allow"):  # a few bytes per process, on purpose
        pending = np.ravel(multihost_utils.process_allgather(np.int32(signum or 0)))
    return next((int(s) for s in pending if s), None)


def fetch(tree):
    """Bring a PyTree of replicated or sharded arrays to this host as NumPy (a deliberate sync)."""
    import jax

    return jax.tree_util.tree_map(_fetch_one, tree)
