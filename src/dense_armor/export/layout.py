"""An artifact's modules laid out over several devices (`export_model(..., mesh=)`).

A model larger than one device exports as generation and the server run it (`nn.sharding`): its
heads and hidden units split over the mesh's `"model"` axis by `partition_specs`, the key/value
cache split by its key/value heads by `cache_specs`, every other input and output whole on every
device. Each exported function is traced under `jax.jit` with those shardings on an abstract mesh
of `N` devices, so its StableHLO carries them (Shardy's `sdy.sharding` on every argument and
result, `mhlo.num_partitions = N`) and any machine can export for any `N`: the devices are needed
only to run the artifact. The manifest's `mesh` records the axis and the device count, and every
input's and output's `sharding` names the mesh axis of each of its dimensions.
"""

from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ..nn.sharding import axis_size, cache_specs, partition_specs
from .standalone import ArtifactError

__all__ = ["Layout", "export_mesh", "sharding_entry"]


def export_mesh(mesh: Any) -> AbstractMesh | None:
    """`export_model`'s `mesh` (a `Mesh` or an `AbstractMesh` whose `"model"` axis splits the
    model; a `"data"` axis, if any, of one device) as the abstract mesh the modules are traced
    on, `("data", "model")` of `(1, N)` as every mesh of the library; None for one device."""
    if mesh is None:
        return None
    if not isinstance(mesh, Mesh | AbstractMesh):
        raise ArtifactError(
            "export_model: `mesh` must be a jax.sharding.Mesh or AbstractMesh with a "
            f'"model" axis, e.g. AbstractMesh((4,), ("model",)); received {mesh!r}.'
        )
    names = tuple(mesh.axis_names)
    if names != ("model",) and ("data" not in names or not set(names) <= {"data", "model"}):
        raise ArtifactError(
            f'export_model: a mesh\'s axes are ("model",) or ("data", "model"); received {names}.'
        )
    if 0 in dict(mesh.shape).values():
        raise ArtifactError(f"export_model: the mesh holds no device ({dict(mesh.shape)}).")
    if axis_size(mesh, "data") != 1:
        raise ArtifactError(
            'export_model: an artifact splits a model over the mesh\'s "model" axis only; '
            f'this mesh\'s "data" axis holds {axis_size(mesh, "data")} devices.'
        )
    devices = axis_size(mesh, "model")
    auto = (AxisType.Auto, AxisType.Auto)
    return None if devices == 1 else AbstractMesh((1, devices), ("data", "model"), auto)


class Layout:
    """The shardings of one lowering's functions on `mesh`: its weights' (in the order of the
    manifest's `weights.names`) and its cache's (in the order of `cache.layout`)."""

    def __init__(self, mesh: AbstractMesh, model: Any, weights: Sequence[Any], cache: Any):
        self.mesh = mesh
        try:
            specs = partition_specs(model, mesh)
        except ValueError as error:  # heads the axis does not divide, named by layer
            raise ArtifactError(f"export_model: {error}") from None
        self.weights = _leaves(specs)
        self.cache = _leaves(cache_specs(cache))
        assert len(self.weights) == len(weights), (len(self.weights), len(weights))

    def _named(self, specs: Sequence[P]) -> list[NamedSharding]:
        return [NamedSharding(self.mesh, spec) for spec in specs]

    def whole(self) -> NamedSharding:
        return NamedSharding(self.mesh, P())

    def inputs(self, n_plain: int, cache: bool) -> tuple[Any, ...]:
        """`in_shardings` of `fn(weights, *plain, [cache])`."""
        shardings: list[Any] = [self._named(self.weights), *[self.whole()] * n_plain]
        return (*shardings, self._named(self.cache)) if cache else tuple(shardings)

    def outputs(self, leading: int, streaming: bool) -> Any:
        """`out_shardings` of a function that returns `leading` outputs, then (`streaming`) the
        cache and, after outputs, the overflow flags."""
        if not streaming:
            return self.whole()
        if not leading:
            return self._named(self.cache)
        return (*[self.whole()] * leading, self._named(self.cache), self.whole())

    def manifest(self) -> dict[str, Any]:
        devices = self.mesh.shape["model"]
        return {
            "axes": dict(self.mesh.shape),
            "devices": devices,
            "note": f"every module runs on {devices} devices at once (mhlo.num_partitions); "
            "each input's and output's `sharding` names the mesh axis that splits each of its "
            "dimensions (null: whole on every device). Placed on a mesh of that many devices, "
            "the module's inputs are split as it says (jax: Exported.in_shardings_jax).",
        }


def sharding_entry(spec: P, ndim: int) -> list[str | None]:
    """A `PartitionSpec` as the manifest writes it: one mesh axis name (or null) per dimension."""
    named = list(spec) + [None] * (ndim - len(spec))
    return [axis if axis is None or isinstance(axis, str) else "+".join(axis) for axis in named]


def _leaves(specs: Any) -> list[P]:
    return [s for s in jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P)) if s is not None]
