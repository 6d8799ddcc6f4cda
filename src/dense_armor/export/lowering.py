"""The plain-array functions an artifact exports, built for any model family.

Every exported function takes the weights (a list of arrays, in the order of the manifest's
`weights.names`) first, then its plain inputs, then, for the streaming functions, the cache (a list
of arrays, batch `B` first, in the order of the manifest's `cache.layout`):

- `forward(weights, x, *context) -> y`;
- `init_cache(weights, streams | *context) -> cache`: the empty cache of `B` streams (`streams
  (B,)` only carries `B` for a family without a context; a decoder's comes from its context);
- `step(weights, x_t, cache) -> (y_t, cache, overflow)`;
- `prefill(weights, x, cache) -> (y, cache, overflow)`: `T` steps in one call;
- `reset(weights, streams, *context, cache) -> cache`: the streams where `streams` is true back to
  their empty state (with their new context), the others untouched;
- for a family of token ids (a language model), decoding with the sampling in the graph:
  `sample_prefill(weights, x, key, cache) -> (token, cache, overflow)`, the prompt's tokens and
  each stream's first new token, and `sample_step(weights, x_t, key, cache) -> (token, cache,
  overflow)`, one token in and the next out; `key` is a raw PRNG key (`uint32[2]`), stream `b`
  drawing its token at position `p` with `fold_in(fold_in(key, b), p)` (`draw_tokens`, the rule
  of `generate`), under the sampling rules fixed at export (greedy by default: the key unused).

Shapes, dtypes and names of every input and output are read from the model (`jax.eval_shape` on
symbolic shapes), never written by hand; Equinox classes never reach a signature.
"""

import copy
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import export
from jax.sharding import AbstractMesh
from jax.tree_util import GetAttrKey

from ..checkpoints.families import FAMILIES
from ..checkpoints.single import ModelConfig
from ..distributed import gather_to_host
from ..nn import precision
from ..nn.sampling import draw_tokens
from ..nn.state.counter import Counter
from ..nn.state.streams import reset as reset_streams
from .functions import DIMS, Function, Spec, concrete, spec, strip_locations
from .layout import Layout

__all__ = ["GREEDY", "Lowering"]

# The sampling rules of `sample_prefill` and `sample_step` unless the export names others.
GREEDY = {"temperature": 0.0, "top_k": None, "top_p": None, "min_p": None}


def _is_counter(node: Any) -> bool:
    return isinstance(node, Counter)


def describe_cache(tree: Any) -> list[dict[str, Any]]:
    """One entry per array of a cache tree: its path, the cache classes that hold it (outermost
    first) and the innermost one's description (its docstring's first sentence)."""
    entries = []
    for path, _ in jax.tree_util.tree_leaves_with_path(tree):
        node, holders = tree, []
        for key in path:
            if isinstance(node, eqx.Module) or hasattr(node, "_fields"):
                holders.append(node)
            node = (
                getattr(node, key.name)
                if isinstance(key, jax.tree_util.GetAttrKey)
                else node[getattr(key, "idx", getattr(key, "key", None))]
            )
        doc = " ".join((type(holders[-1]).__doc__ or "").split()) if holders else ""
        entries.append(
            {
                "path": "cache" + jax.tree_util.keystr(path),
                "holders": [type(h).__name__ for h in holders],
                "about": doc.split(". ")[0].rstrip("."),
            }
        )
    return entries


class Lowering:
    """The exported functions of one model (and its causal form, which streams)."""

    def __init__(
        self,
        model: Any,
        causal_model: Any,
        config: ModelConfig,
        capacity: int,
        sampling: dict[str, Any] | None = None,
        kv_dtype: str | None = None,
        mesh: AbstractMesh | None = None,
    ):
        self.family = FAMILIES[config.factory]
        self.kv_dtype = kv_dtype
        self.sampling = {**GREEDY, **(sampling or {})}
        arguments = self.arguments = config.arguments
        self.max_len = self.family.max_length(arguments)
        self.vocab = self.family.vocabulary(arguments)
        self.width = self.family.context_width(arguments)
        self.capacity = capacity
        self._take_weights(model, causal_model)
        self._input_specs()
        self._cache_specs()
        self.layout = None if mesh is None else Layout(mesh, model, self.weights, self._shapes())

    def _shapes(self) -> Any:
        """The cache's tree of one stream per batch (every symbolic dimension 1): its arrays'
        ranks and types, all `layout.Layout` reads."""
        leaves = [
            jax.ShapeDtypeStruct(concrete(s["shape"], dict.fromkeys(DIMS, 1)), s["dtype"])
            for s in self.cache
        ]
        return jax.tree_util.tree_unflatten(self.cache_treedef, leaves)

    def _take_weights(self, model: Any, causal_model: Any) -> None:
        """The model's arrays as named host copies (a model trained sharded exports exactly as
        its single-device twin), its structure, and the causal model over those copies (the
        Python model the golden data runs)."""
        params, self.static = eqx.partition(model, eqx.is_array)
        paths_and_leaves = jax.tree_util.tree_leaves_with_path(params)
        self.names = [jax.tree_util.keystr(path) for path, _ in paths_and_leaves]
        self.weights = [jnp.asarray(gather_to_host(leaf)) for _, leaf in paths_and_leaves]
        self.treedef = jax.tree_util.tree_structure(params)
        causal_params, self.causal_static = eqx.partition(causal_model, eqx.is_array)
        self.causal_treedef = jax.tree_util.tree_structure(causal_params)
        self.causal_model = self._model(self.weights, causal=True)

    def _input_specs(self) -> None:
        """The specs of the functions' inputs: a sequence, a step, the streams' flags, a key, and
        a decoder's context with its mask."""
        dtype, self.step_shape = self.family.input_spec(self.arguments)
        self.x = spec("x", "input", dtype, ["B", "T", *self.step_shape])
        self.x_t = spec("x_t", "input", dtype, ["B", *self.step_shape])
        self.streams = spec("streams", "streams", bool, ["B"])
        self.key = spec("key", "key", np.uint32, [2])
        self.context = []
        if self.width is not None:
            self.context = [
                spec("context", "context", jnp.float32, ["B", "S", self.width]),
                spec("context_mask", "context", bool, ["B", "S"]),
            ]

    def _cache_specs(self) -> None:
        """The cache's structure and shapes (symbolic in S for a context), read from the model;
        which of its arrays are the overflow flags, and each stream's count of steps."""
        (s_dim,) = export.symbolic_shape("S")
        one_context = [
            jax.ShapeDtypeStruct(concrete(s["shape"][1:], {"S": s_dim}), s["dtype"])
            for s in self.context
        ]
        cache_shape = jax.eval_shape(lambda *c: self.start(self.causal_model, c), *one_context)
        self.cache_treedef = jax.tree_util.tree_structure(cache_shape)
        self.cache_layout = describe_cache(cache_shape)
        leaves = jax.tree_util.tree_leaves(cache_shape)
        self.cache = [
            spec(entry["path"], "cache", leaf.dtype, ["B", *leaf.shape])
            for entry, leaf in zip(self.cache_layout, leaves, strict=True)
        ]
        for entry, s in zip(self.cache_layout, self.cache, strict=True):
            entry.update(dtype=s["dtype"], shape=s["shape"])
        # The overflow flags are those of the cache's counters, found by type; a stream's count
        # of steps (the position of its next token) is the first counter's.
        counters = jax.tree_util.tree_flatten_with_path(cache_shape, is_leaf=_is_counter)[0]
        paths = [path for path, node in counters if _is_counter(node)]
        flags = {"cache" + jax.tree_util.keystr((*p, GetAttrKey("overflow"))) for p in paths}
        indices = ["cache" + jax.tree_util.keystr((*p, GetAttrKey("index"))) for p in paths]
        self.overflow_flags = [i for i, s in enumerate(self.cache) if s["name"] in flags]
        self.position_index = next(
            (i for i, s in enumerate(self.cache) if s["name"] in indices[:1]), None
        )

    def draw_inputs(self, rng: np.random.Generator, leading: tuple[int, ...]) -> np.ndarray:
        """Inputs of shape `leading + step_shape` from `rng`: standard normal features, or token
        ids uniform in `[0, vocab)`."""
        shape = (*leading, *self.step_shape)
        if self.vocab is not None:
            return rng.integers(0, self.vocab, shape, dtype=np.int32)
        return rng.standard_normal(shape, dtype=np.float32)

    # -- the model's pieces -----------------------------------------------------------------

    def on_host(self) -> "Lowering":
        """This lowering with its weights (and the causal model over them) on the host's CPU
        device: what the golden outputs are computed with, so that they are the same values
        whichever machine exports (an accelerator's float32 arithmetic differs from the host's,
        and the golden data must never carry it)."""
        cpu = jax.devices("cpu")[0]
        host = copy.copy(self)
        host.weights = [jax.device_put(w, cpu) for w in self.weights]
        host.causal_model = host._model(host.weights, causal=True)
        return host

    def _model(self, weights: list[jax.Array], causal: bool) -> Any:
        treedef, static = (
            (self.causal_treedef, self.causal_static) if causal else (self.treedef, self.static)
        )
        return eqx.combine(jax.tree_util.tree_unflatten(treedef, weights), static)

    def start(self, model: Any, context: Sequence[Any]) -> Any:
        """One stream's empty cache (its keys and values in `kv_dtype`); an exported stream marks
        overflow, it never calls back."""
        cache = self.family.start(model, self.capacity, context, "nan")
        return precision.cache_in(cache, self.kv_dtype)

    def _fresh(self, model: Any, streams: jax.Array, context: Sequence[jax.Array]) -> Any:
        """The empty caches of `B` streams (`streams (B,)` carries `B`), batch first."""
        return jax.vmap(lambda _, *c: self.start(model, c))(streams, *context)

    def _cache_tree(self, cache: list[jax.Array]) -> Any:
        return jax.tree_util.tree_unflatten(self.cache_treedef, cache)

    def _overflow(self, leaves: list[jax.Array], batch: int) -> jax.Array:
        # A stack of layers holds one flag per layer: `(B, depth)`.
        flags = [leaves[i].reshape(leaves[i].shape[0], -1).any(axis=1) for i in self.overflow_flags]
        return jnp.stack(flags).any(axis=0) if flags else jnp.zeros(batch, bool)

    # -- the exported functions ---------------------------------------------------------------

    def forward(self, weights: list[jax.Array], x: jax.Array, *context: jax.Array) -> jax.Array:
        model = self._model(weights, causal=False)
        return jax.vmap(lambda x, *c: self.family.apply(model, x, c))(x, *context)

    def init_cache(self, weights: list[jax.Array], *inputs: jax.Array) -> list[jax.Array]:
        context = inputs if self.context else ()
        streams = jnp.ones(inputs[0].shape[0], bool)
        return jax.tree_util.tree_leaves(
            self._fresh(self._model(weights, causal=True), streams, context)
        )

    def prefill(
        self, weights: list[jax.Array], x: jax.Array, cache: list[jax.Array]
    ) -> tuple[jax.Array, list[jax.Array], jax.Array]:
        model = self._model(weights, causal=True)
        y, tree = jax.vmap(model.prefill)(x, self._cache_tree(cache))
        leaves = jax.tree_util.tree_leaves(tree)
        return y, leaves, self._overflow(leaves, x.shape[0])

    def step(
        self, weights: list[jax.Array], x_t: jax.Array, cache: list[jax.Array]
    ) -> tuple[jax.Array, list[jax.Array], jax.Array]:
        y, leaves, overflow = self.prefill(weights, x_t[:, None], cache)
        return y[:, 0], leaves, overflow

    def reset(self, weights: list[jax.Array], streams: jax.Array, *rest: Any) -> list[jax.Array]:
        *context, cache = rest
        fresh = self._fresh(self._model(weights, causal=True), streams, context)
        return jax.tree_util.tree_leaves(reset_streams(self._cache_tree(cache), streams, fresh))

    def sample_prefill(
        self, weights: list[jax.Array], x: jax.Array, key: jax.Array, cache: list[jax.Array]
    ) -> tuple[jax.Array, list[jax.Array], jax.Array]:
        model = self._model(weights, causal=True)  # the last position's logits only
        logits, tree = jax.vmap(model.prefill_last)(x, self._cache_tree(cache))
        leaves = jax.tree_util.tree_leaves(tree)
        overflow = self._overflow(leaves, x.shape[0])
        assert self.position_index is not None  # a language model's cache counts its steps
        batch = x.shape[0]
        positions = leaves[self.position_index].reshape(batch, -1)[:, 0].astype(jnp.int32)
        rows = jnp.arange(batch, dtype=jnp.int32)
        return draw_tokens(logits, key, rows, positions, **self.sampling), leaves, overflow

    def sample_step(
        self, weights: list[jax.Array], x_t: jax.Array, key: jax.Array, cache: list[jax.Array]
    ) -> tuple[jax.Array, list[jax.Array], jax.Array]:
        return self.sample_prefill(weights, x_t[:, None], key, cache)

    def plans(self) -> dict[str, tuple[Function, list[str], bool]]:
        """Every function to export, not yet exported (no outputs): each with the names of its
        outputs before the cache, and whether the cache and overflow follow them."""
        # name: (function, inputs, outputs before the cache, whether the cache and overflow
        # follow them, bounds)
        plans: dict[str, tuple[Callable[..., Any], list[Spec], list[str], bool, dict[str, int]]]
        plans = {
            "forward": (self.forward, [self.x, *self.context], ["y"], False, {"T": self.max_len}),
            "init_cache": (self.init_cache, self.context or [self.streams], [], True, {}),
            "step": (self.step, [self.x_t, *self.cache], ["y_t"], True, {}),
            "prefill": (self.prefill, [self.x, *self.cache], ["y"], True, {}),
            "reset": (self.reset, [self.streams, *self.context, *self.cache], [], True, {}),
        }
        if self.vocab is not None:  # decoding, the sampling in the graph
            key_and_cache = [self.key, *self.cache]
            plans["sample_prefill"] = (
                self.sample_prefill,
                [self.x, *key_and_cache],
                ["token"],
                True,
                {},
            )
            plans["sample_step"] = (
                self.sample_step,
                [self.x_t, *key_and_cache],
                ["token"],
                True,
                {},
            )
        functions = {}
        for name, (fn, inputs, leading, streaming, bounds) in plans.items():
            layout = self._layout(inputs, leading, streaming)
            functions[name] = (Function(fn, inputs, [], bounds, layout=layout), leading, streaming)
        return functions

    def _layout(
        self, inputs: list[Spec], leading: list[str], streaming: bool
    ) -> tuple[Any, Any] | None:
        """A function's `in_shardings` and `out_shardings` over the export's mesh, or None."""
        if self.layout is None:
            return None
        plain = len([i for i in inputs if i["role"] != "cache"])
        cache = len(inputs) > plain
        return self.layout.inputs(plain, cache), self.layout.outputs(len(leading), streaming)

    def functions(self, platforms: Sequence[str]) -> dict[str, Function]:
        """Every exported function, exported for `platforms` on symbolic shapes (its portable
        artifact), its outputs read from that export."""
        functions = {}
        weight_avals = [jax.ShapeDtypeStruct(w.shape, w.dtype) for w in self.weights]
        for name, (function, leading, streaming) in self.plans().items():
            traced = export.export(function.jitted(laid_out=True), platforms=tuple(platforms))(
                *function.arguments(weight_avals, function.symbolic_sizes())
            )
            function.portable, function.stripped = strip_locations(traced)
            shapes = traced.out_avals
            names, roles = list(leading), ["output"] * len(leading)
            if streaming:
                names += [s["name"] for s in self.cache]
                roles += ["cache"] * len(self.cache)
            if len(shapes) > len(names):  # step and prefill also return the overflow flags
                names, roles = [*names, "overflow"], [*roles, "output"]
            function.outputs = [
                spec(n, r, s.dtype, s.shape) for n, r, s in zip(names, roles, shapes, strict=True)
            ]
            functions[name] = function
        return functions
