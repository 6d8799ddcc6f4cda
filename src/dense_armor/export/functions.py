"""One exported function as the export describes it: its inputs' and outputs' specs (names,
roles, dtypes, shapes with symbolic dimensions by name), its `jax.jit` wrappers (the cache
donated or not, laid out over a mesh or not) and its portable `jax.export` artifact, with the
debug locations stripped from a module."""

import dataclasses
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax import export

__all__ = ["DIMS", "Function", "Spec", "avals", "concrete", "spec", "strip_locations"]

Spec = dict[str, Any]  # {"name", "role", "dtype", "shape"}; shape entries are ints or dim names
DIMS = ("B", "T", "S")  # batch, time (or chunk length), context length


def spec(name: str, role: str, dtype: Any, shape: Sequence[Any]) -> Spec:
    return {
        "name": name,
        "role": role,
        "dtype": str(np.dtype(dtype)),
        "shape": [d if isinstance(d, int) else str(d) for d in shape],
    }


def concrete(shape: Sequence[Any], sizes: dict[str, Any]) -> tuple[Any, ...]:
    return tuple(sizes[d] if isinstance(d, str) else d for d in shape)


def avals(specs: Sequence[Spec], sizes: dict[str, Any]) -> list[jax.ShapeDtypeStruct]:
    return [jax.ShapeDtypeStruct(concrete(s["shape"], sizes), s["dtype"]) for s in specs]


@dataclasses.dataclass
class Function:
    """One exported function: `fn(weights, *plain, [cache])`, its non-weight inputs (the cache
    ones last), its outputs, and upper bounds on its dimensions (`{"T": max_len}`)."""

    fn: Callable[..., Any]
    inputs: list[Spec]
    outputs: list[Spec]
    bounds: dict[str, int] = dataclasses.field(default_factory=dict)
    # its portable `jax.export` (symbolic shapes, every platform), and whether its debug
    # locations were stripped: traced once, its outputs read from it
    portable: Any = None
    stripped: bool = False
    # its `in_shardings` and `out_shardings` over several devices (`layout.Layout`), or None
    layout: tuple[Any, Any] | None = None
    # its `jax.jit` wrappers by whether the cache is donated and whether they are laid out: one
    # each per function, so that the golden outputs computed at a static module's shape reuse
    # that module's trace
    _jitted: dict[tuple[bool, bool], Any] = dataclasses.field(
        default_factory=dict, repr=False, compare=False
    )

    @property
    def plain(self) -> list[Spec]:
        return [i for i in self.inputs if i["role"] != "cache"]

    @property
    def cache(self) -> list[Spec]:
        return [i for i in self.inputs if i["role"] == "cache"]

    @property
    def symbols(self) -> list[str]:
        """The dimension names of its inputs, in the order of `DIMS`."""
        used = {d for i in self.inputs for d in i["shape"] if isinstance(d, str)}
        return [d for d in DIMS if d in used]

    def jitted(self, donate: bool = True, laid_out: bool = False) -> Any:  # jax.stages.Wrapped
        """The function under `jax.jit`, its cache donated (so a step under JAX updates it in
        place) unless `donate=False`: the static modules for other runtimes are lowered without
        donation, because IREE (3.x, llvm-cpu) computes wrong results from a module whose
        inputs alias its outputs; such a runtime reuses buffers itself. `laid_out`: with its
        `layout`'s shardings (what is exported), where it has one."""
        key = (bool(self.cache) and donate, laid_out and self.layout is not None)
        if key not in self._jitted:
            donating = (1 + len(self.plain),) if key[0] else ()
            shardings = {}
            if key[1] and self.layout is not None:
                shardings = {"in_shardings": self.layout[0], "out_shardings": self.layout[1]}
            self._jitted[key] = jax.jit(self.fn, donate_argnums=donating, **shardings)
        return self._jitted[key]

    def arguments(self, weights: list[Any], sizes: dict[str, Any]) -> list[Any]:
        """`(weight avals, *plain avals, [cache avals])` at `sizes`."""
        args: list[Any] = [weights, *avals(self.plain, sizes)]
        return [*args, avals(self.cache, sizes)] if self.cache else args

    def symbolic_sizes(self) -> dict[str, Any]:
        names = self.symbols
        constraints = [f"{d} <= {self.bounds[d]}" for d in names if d in self.bounds]
        dims = export.symbolic_shape(", ".join(names), constraints=constraints) if names else ()
        return dict(zip(names, dims, strict=True))


def strip_locations(exported: export.Exported) -> tuple[export.Exported, bool]:
    """`exported` with every debug location removed from its module (JAX records the file and
    line of every traced call: the absolute paths of the sources and of the calling script, so
    the same model exported from two places gave two byte strings), and whether that worked.

    This reaches into `jax._src` (jax.export has no public switch for it); with a jax whose
    internals moved, the module keeps its locations and the export says so."""
    try:
        from jax._src.export._export import _module_to_bytecode
        from jax._src.interpreters import mlir
        from jax._src.lib import _jax
        from jax._src.lib.mlir import passmanager

        with mlir.make_ir_context():
            module = _jax.mlir.deserialize_portable_artifact(exported.mlir_module_serialized)
            passmanager.PassManager.parse("builtin.module(strip-debuginfo)").run(module.operation)
            serialized = _module_to_bytecode(module)
    except (ImportError, AttributeError, TypeError) as error:
        warnings.warn(
            f"this jax ({jax.__version__}) did not let the export strip debug locations "
            f"({error}); the modules keep them, with the paths of the source files.",
            stacklevel=2,
        )
        return exported, False
    return dataclasses.replace(exported, mlir_module_serialized=serialized), True
