"""Scale out on JAX's own engine: a device mesh, sharded batches, and several processes.

dense_armor adds no machinery of its own: a mesh is a `jax.sharding.Mesh` with one axis,
`"data"`; a batch is sharded over it with `NamedSharding(mesh, P("data"))`; parameters are
replicated (`P()`) or, with `shard_params=True`, split over the mesh along their first axis that it
divides (FSDP-style); XLA inserts the collectives. Several processes (hosts) join with
`initialize()`, which calls `jax.distributed.initialize`; each process then feeds its own part of
every global batch (`jax.make_array_from_process_local_data`). On CPU the collectives between
processes use gloo.
"""

import os
from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

__all__ = [
    "data_mesh",
    "gather_to_host",
    "global_batch",
    "global_replicated",
    "initialize",
    "place",
    "replicated",
]


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    timeout: int = 300,
    bind_address: str | None = None,
    local_device_ids: int | Sequence[int] | None = None,
) -> None:
    """Join a multi-process run: `jax.distributed.initialize` with the given arguments, or with
    `DENSE_ARMOR_COORDINATOR` (host:port), `DENSE_ARMOR_NUM_PROCESSES` and
    `DENSE_ARMOR_PROCESS_ID` from the environment; with neither, JAX detects the cluster itself
    (SLURM, Open MPI, Cloud TPU). Call it first, before any other JAX call. On CPU, collectives
    between processes use gloo.

    What a cluster may also need, passed to JAX as they are: `timeout` (seconds to wait for every
    process to join; JAX's `initialization_timeout`), `bind_address` (the `host:port` the
    coordinator listens on, when it differs from the address the others reach it at; JAX's
    `coordinator_bind_address`) and `local_device_ids` (the devices this process uses, when
    several processes share a host)."""
    if isinstance(timeout, bool) or not isinstance(timeout, int) or timeout < 1:
        raise ValueError(
            f"initialize: `timeout` must be a positive number of seconds; got {timeout!r}."
        )
    if bind_address is not None:
        _check_address(bind_address, "bind_address")
    if local_device_ids is not None:
        ids = [local_device_ids] if isinstance(local_device_ids, int) else list(local_device_ids)
        if not ids or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids):
            raise ValueError(
                "initialize: `local_device_ids` must be a device index or a non-empty list of "
                f"them; got {local_device_ids!r}."
            )
    env = os.environ
    source = "coordinator_address"
    if coordinator_address is None and "DENSE_ARMOR_COORDINATOR" in env:
        coordinator_address, source = env["DENSE_ARMOR_COORDINATOR"], "DENSE_ARMOR_COORDINATOR"
    if coordinator_address is not None:
        _check_address(coordinator_address, source)
    if num_processes is None and "DENSE_ARMOR_NUM_PROCESSES" in env:
        num_processes = _env_int("DENSE_ARMOR_NUM_PROCESSES", minimum=1)
    if process_id is None and "DENSE_ARMOR_PROCESS_ID" in env:
        process_id = _env_int("DENSE_ARMOR_PROCESS_ID", minimum=0)
    if num_processes is not None and process_id is not None and process_id >= num_processes:
        raise ValueError(
            f"initialize: process id {process_id} is outside [0, {num_processes}) "
            "(DENSE_ARMOR_PROCESS_ID must be below DENSE_ARMOR_NUM_PROCESSES)."
        )
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=coordinator_address,
        num_processes=num_processes,
        process_id=process_id,
        local_device_ids=local_device_ids,
        initialization_timeout=timeout,
        coordinator_bind_address=bind_address,
    )


def _check_address(address: str, source: str) -> None:
    """`host:port` with a port in [1, 65535], or a `ValueError` naming where it came from."""
    host, colon, port = str(address).rpartition(":")
    if not colon or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(
            f"initialize: {source} must be `host:port` with a port in [1, 65535], e.g. "
            f"`10.0.0.1:1234`; received {address!r}."
        )


def _env_int(name: str, minimum: int) -> int:
    value = os.environ[name]
    try:
        number = int(value)
    except ValueError:
        number = None
    if number is None or number < minimum:
        raise ValueError(f"initialize: {name} must be an integer >= {minimum}; received {value!r}.")
    return number


def data_mesh(devices: Any = None) -> Mesh:
    """A one-axis mesh, `"data"`, over `devices` (default: every device of every process)."""
    devices = jax.devices() if devices is None else devices
    return Mesh(np.asarray(devices), ("data",))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def _leaf_sharding(leaf: Any, mesh: Mesh, shard: bool) -> NamedSharding:
    if shard:
        size = mesh.shape["data"]
        for axis, length in enumerate(leaf.shape):
            if length % size == 0:
                return NamedSharding(mesh, P(*([None] * axis), "data"))
    return replicated(mesh)


def place(tree: Any, mesh: Mesh, shard_params: bool = False) -> Any:
    """Put every array of `tree` (a model, an optimizer state) on `mesh`: replicated, or split along
    its first axis that the mesh divides when `shard_params`. Works across processes: every process
    holds the same values, and each keeps the shards of its own devices."""

    def put(leaf: Any) -> Any:
        if not eqx.is_array(leaf):
            return leaf
        sharding = _leaf_sharding(leaf, mesh, shard_params)
        host = gather_to_host(leaf)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    return jax.tree_util.tree_map(put, tree)


def global_batch(mesh: Mesh, rows: np.ndarray) -> jax.Array:
    """A global batch sharded over the mesh's `"data"` axis, from the rows of this process.

    With several processes, process `i` passes its `1/n` of the global batch, in process order."""
    return jax.make_array_from_process_local_data(NamedSharding(mesh, P("data")), rows)


def global_replicated(mesh: Mesh, array: np.ndarray) -> jax.Array:
    """`array`, the same on every process, replicated on every device of the mesh."""
    return jax.make_array_from_process_local_data(replicated(mesh), array)


def gather_to_host(leaf: Any) -> np.ndarray:
    """The whole value of an array, as NumPy, on every process (a collective when it spans
    several processes)."""
    if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
        return np.asarray(multihost_utils.process_allgather(leaf, tiled=True))
    return np.asarray(leaf)
