"""Scale out on JAX's own engine: a device mesh, sharded batches, and several processes.

dense_armor adds no machinery of its own: a mesh is a `jax.sharding.Mesh` with the axes `"data"`
and, optionally, `"model"` (`data_mesh()`, `device_mesh(model=2)`); a batch is sharded over
`"data"` with `NamedSharding(mesh, P("data"))`; every array of a model gets a `PartitionSpec`
(`partition_specs`) and XLA inserts the collectives.

- `"model"` (tensor parallelism, Megatron-style): each attention layer's heads are split over the
  axis (W_Q, W_K, W_V and their biases by output columns, a group of whole heads per device;
  W_O by rows), and each feed-forward's hidden units likewise (the first matrix by columns, the
  second by rows). A layer says which of its arrays split, and along which axis, in its
  `tensor_parallel` class attribute; every other array is replicated over `"model"`.
- `shard_params=True` (FSDP-style) also splits every array over `"data"`, along its first axis
  that the axis divides and `"model"` does not use (a vector that `"model"` splits is split over
  both); the arrays that have none are reported
  (a `ShardingWarning` naming them), not replicated in silence.

Optimizer states are placed like the parameters they belong to (`place_optimizer_state`, through
`optax.tree_map_params`). Several processes (hosts) join with `initialize()`, which calls
`jax.distributed.initialize`; each process then feeds its own part of every global batch
(`jax.make_array_from_process_local_data`). On CPU the collectives between processes use gloo.
"""

import os
import warnings
from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax
import numpy as np
import optax
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from .nn.core import is_integer, require_int
from .nn.sharding import (
    AXES,
    ShardingWarning,
    is_slot,
    partition_specs,
    shardings,
)

__all__ = [
    "ShardingWarning",
    "data_mesh",
    "device_mesh",
    "gather_to_host",
    "global_batch",
    "global_replicated",
    "initialize",
    "partition_specs",
    "place",
    "optimizer_shardings",
    "place_optimizer_state",
    "replicated",
    "shardings",
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
    if not is_integer(timeout) or timeout < 1:
        raise ValueError(
            f"initialize: `timeout` must be a positive number of seconds; got {timeout!r}."
        )
    timeout = int(timeout)
    if bind_address is not None:
        _check_address(bind_address, "bind_address")
    if local_device_ids is not None:
        many = isinstance(local_device_ids, Sequence) and not isinstance(local_device_ids, str)
        ids: list[Any] = list(local_device_ids) if many else [local_device_ids]  # type: ignore[arg-type]
        if not ids or any(not is_integer(i) or i < 0 for i in ids):
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
    return Mesh(np.asarray(_devices("data_mesh", devices)), ("data",))


def _devices(caller: str, devices: Any) -> list[Any]:
    """`devices` as a list (default: every device of every process), refused when empty."""
    devices = list(jax.devices() if devices is None else devices)
    if not devices:
        raise ValueError(
            f"{caller}: `devices` is empty; give at least one device (default: jax.devices())."
        )
    return devices


def device_mesh(model: int = 1, devices: Any = None) -> Mesh:
    """A two-axis mesh, `("data", "model")`, over `devices` (default: every device of every
    process): `model` devices split each model's heads and hidden units, and the rest of the
    factor, `len(devices) // model`, splits the batch. `device_mesh(model=2)` on 4 devices is
    2 x 2. The devices are taken in order, so each process's devices are whole rows of `"data"`
    when `model` divides the devices of a process."""
    devices = _devices("device_mesh", devices)
    require_int(1, caller="device_mesh", model=model)
    model = int(model)
    if len(devices) % model:
        raise ValueError(
            f"device_mesh: `model={model}` must divide the {len(devices)} devices; "
            f"divisors: {[d for d in range(1, len(devices) + 1) if len(devices) % d == 0]}."
        )
    return Mesh(np.asarray(devices).reshape(len(devices) // model, model), AXES)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def optimizer_shardings(
    state: Any, optimizer: optax.GradientTransformation, param_shardings: Any, mesh: Mesh
) -> Any:
    """The sharding of every array of an optimizer state (or of its `jax.eval_shape`): that of
    its parameter for an array that mirrors one (Adam's moments; `param_shardings` is the
    parameters' tree of shardings), replicated for the rest (step counts)."""
    whole = replicated(mesh)
    try:
        return optax.tree_map_params(
            optimizer,
            lambda leaf, sharding: sharding if is_slot(leaf) else None,
            state,
            param_shardings,
            transform_non_params=lambda leaf: whole if is_slot(leaf) else None,
            is_leaf=lambda x: x is None,
        )
    except (ValueError, TypeError, IndexError, AttributeError) as error:
        warnings.warn(
            f"the optimizer state is replicated on every device: optax cannot map it onto the "
            f"parameters ({error}).",
            ShardingWarning,
            stacklevel=3,
        )
        return jax.tree.map(lambda leaf: whole if is_slot(leaf) else None, state)


def _put_all(tree: Any, where: Any) -> Any:
    return jax.tree.map(
        lambda leaf, sharding: leaf if sharding is None else _put(leaf, sharding),
        tree,
        where,
        is_leaf=lambda x: x is None,
    )


def _put(leaf: Any, sharding: NamedSharding) -> jax.Array:
    host = gather_to_host(leaf)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def place(tree: Any, mesh: Mesh, shard_params: bool = False) -> Any:
    """Put every array of `tree` (a model) on `mesh` as `partition_specs` says. Works across
    processes: every process holds the same values, and each keeps the shards of its own
    devices."""
    return _put_all(tree, shardings(tree, mesh, shard_params))


def place_optimizer_state(
    state: Any, optimizer: optax.GradientTransformation, model: Any, mesh: Mesh
) -> Any:
    """Put an optimizer state on `mesh`: each array that mirrors a parameter (Adam's moments)
    sharded like that parameter of `model` (already placed), the rest (step counts) replicated."""
    params = eqx.filter(model, eqx.is_inexact_array)
    where = optimizer_shardings(state, optimizer, jax.tree.map(lambda p: p.sharding, params), mesh)
    return _put_all(state, where)


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
