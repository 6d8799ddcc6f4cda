"""Precision: the dtype a model's weights are stored in, int8 weights, and the key/value cache's.

- `cast(tree, dtype)`: every floating weight (`Param`) in `"float32"`, `"bfloat16"` or
  `"float16"`. A model computes in the dtype of its activations: a `TransformerLM`'s come from its
  embedding (its `compute_dtype` apart), so a bfloat16 model runs in bfloat16, with the
  softmax, the norms' statistics, the router and the logits in float32 (`products.project`
  multiplies in the narrower dtype and accumulates in float32).
- `quantize(tree, embeddings=False)`: every projection matrix as int8 with a float32 scale per
  output channel (`QuantizedParam`): the attention's, the feed-forward's, the experts'. The
  router, a shared expert's gate, norms and biases stay as they are, and so do the embedding
  table, a learned positional table and an untied head unless `embeddings=True` (the table then
  with a scale per row, which is also the tied head's output channel).
- `cache_in(cache, dtype)`: a cache whose key/value buffers are stored in `dtype`: a float dtype,
  or `"int8"`, each key and value row over `d_head` with a float32 scale per head and position
  (`FixedKVCache` and `RingKVCache`; a growing cache refuses int8).

`TransformerLM(..., param_dtype=, compute_dtype=, quantize=, quantize_embeddings=)` applies the
first two at construction, so a config (and so a checkpoint, an import, an export) says them.
"""

from typing import Any

import jax
import jax.numpy as jnp

from .core import Param, QuantizedParam, require_bool, require_choice
from .products import quantize_int8
from .state.cache import FixedKVCache, KVCache, RingKVCache

__all__ = ["KV_DTYPES", "PARAM_DTYPES", "QUANTIZE", "cache_in", "cast", "quantize"]

PARAM_DTYPES = ("float32", "bfloat16", "float16")
KV_DTYPES = ("float32", "bfloat16", "float16", "int8")
QUANTIZE = ("int8",)
_TABLES = (".embed.table", ".positions.P", ".head.W")  # float unless `embeddings=True`
_KEPT = (".router", ".shared_gate")  # never quantized


def _is_param(node: Any) -> bool:
    return isinstance(node, Param)


def cast(tree: Any, dtype: str) -> Any:
    """`tree` with every floating `Param` (a quantized one's scales excepted) in `dtype`."""
    require_choice("dtype", dtype, PARAM_DTYPES)

    def one(node: Any) -> Any:
        if isinstance(node, QuantizedParam) or not isinstance(node, Param):
            return node
        if not jnp.issubdtype(node.value.dtype, jnp.floating):
            return node
        return Param(node.value.astype(dtype))

    return jax.tree.map(one, tree, is_leaf=_is_param)


def _name(path: Any) -> str:
    """A leaf's path as `.a.b[0].c`, a dict's keys too."""
    return jax.tree_util.keystr(path).replace("['", ".").replace("']", "")


def quantize(tree: Any, embeddings: bool = False) -> Any:
    """`tree` with its projection matrices (every `Param` of two or more axes, a `Stack`'s layer
    axis not counted, but the router and,
    unless `embeddings`, the tables and the untied head) as int8 `QuantizedParam`s, one scale per
    output channel: over the input axis (`-2`) of a matrix read as `x @ W`, over the features of
    an embedding table's row. Quantizing twice changes nothing."""
    require_bool(embeddings=embeddings)
    paths, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_param)
    out = []
    for path, node in paths:
        name = _name(path)
        skip = any(part in name for part in _KEPT) or (
            not embeddings and any(part in name for part in _TABLES)
        )
        if (
            isinstance(node, QuantizedParam)
            or not isinstance(node, Param)
            or node.value.ndim - name.count(".stacked") < 2  # a Stack's axis is not a matrix's
            or skip
            or ".positions.P" in name  # positions are added, not projected: kept float
        ):
            out.append(node)
            continue
        axis = -1 if ".embed.table" in name else -2
        out.append(QuantizedParam(*quantize_int8(node.value, axis)))
    return jax.tree_util.tree_unflatten(treedef, out)


def _kv_caches(node: Any) -> bool:
    return isinstance(node, FixedKVCache | RingKVCache | KVCache)


def cache_in(cache: Any, dtype: str | None) -> Any:
    """`cache` (a fresh one, from `init_cache`) with its key/value buffers stored in `dtype`
    (`KV_DTYPES`; `None` leaves it as it is): int8 buffers gain their scales (zeros, as every
    unwritten row)."""
    if dtype is None:
        return cache
    require_choice("kv_dtype", dtype, KV_DTYPES)

    def one(node: Any) -> Any:
        if not _kv_caches(node):
            return node
        if dtype != "int8":
            return node.in_dtype(dtype)
        if isinstance(node, KVCache):
            raise ValueError(
                "kv_dtype='int8' needs a fixed-shape cache: pass a `capacity` to `init_cache` "
                "(a growing cache is float)."
            )
        return node.quantized()

    return jax.tree.map(one, cache, is_leaf=_kv_caches)
