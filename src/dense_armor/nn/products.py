"""The product of activations with a weight matrix, for every precision a weight is stored in.

Every projection of every layer (`Param.project`) goes through `project`, and every int8 one
(`QuantizedParam.project`) through `project_int8`; what each does was measured on XLA's CPU
compiler (jax 0.10.2, a decode-shaped `(B, 2048) @ (2048, 8192)`), where the obvious code runs
10-20x slower than float32 for narrow weights:

- 16-bit weights (bfloat16, float16): the operands in the narrower dtype, accumulated in float32
  (`preferred_element_type`), which XLA's CPU compiler runs through its library GEMM: 2.3-2.7 ms
  against float32's 1.6-2.6 at B=2-8, 3.6 against 5.0-5.4 at B=32, 7.3 against 11.7 at B=128. A
  single row (a batch-1 decode step) takes XLA's matrix-vector path instead, 20-30 ms: the row is
  padded to two. Widening the weights to float32 in the graph costs 25 ms: XLA hoists the
  conversion of the whole matrix into a new buffer (a loop over blocks does not keep it inside,
  nor does a bit-level widening through uint16, nor an optimisation barrier); XLA's XNNPACK and
  oneDNN options (`--xla_cpu_use_xnnpack`, `--xla_cpu_use_onednn`) change none of this. Weights
  held as rows `(n_out, n_in)` multiply 1.4-1.7x faster alone, but inside `generate`'s loop XLA
  transposes them back before it, a copy of every weight per call: not used. float32 rows stay
  rows inside a loop (2026-12-06, an Intel Xeon): a `(32, 768) x (768, 3072)` product 0.86 ms
  against 1.34 as stored, and in a GPT-2-small model converted to rows the first token came
  13-20% sooner and a batch-8 step 3-8% faster, a batch-1 step 1-3%. Not built: a layout every
  user of a matrix (checkpoints, tensor parallelism's splits, the export's tables, the experts'
  stacks) would have to know, for a model converted once before decoding. The GEMM's
  bfloat16 time is its packing's, 2.2 ms at B=1-8 whatever else was tried inside a decoding
  loop: blocks of 256 rows widened in a `lax.scan` 6.7 ms (XLA hoists the widening of the whole
  matrix: its CPU compiler computes bfloat16 data movement in float32), the blocks carried as
  `uint16` and widened by bit shifts 2.8, pairs of values read as `uint32` 5.7-8.8, a
  multiply-and-reduce 4.0-5.6. A tied 16-bit table (`transposed`) is the product's left operand
  as it lies, `(n, d) x (d, m)`: read as the right one, XLA transposes the whole table once per
  call of a loop (0.5 GB at Llama-3's vocabulary).
  The library GEMM is YNNPACK's (XLA's default `LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT`), whose
  bfloat16 kernels are the CPU's: on the same AMD machine with AVX2 only (its virtual machine
  hiding AVX-512, 2026-12-07), the padded row takes 3.8-4.9 ms against float32's 1.4-2.4, and a
  4-layer model of Llama-3.2-1B's shape decodes a batch-1 step in 173-205 ms against float32's
  71-84 (0.41x; batch 8: 0.8x). A single row goes to no YNNPACK kernel: XLA widens the whole
  matrix and runs float32's matrix-vector product (27-35 ms); YNNPACK's own fusions of the
  widening (`--xla_cpu_experimental_ynn_fusion_type=+LIBRARY_FUSION_TYPE_ELTWISE`, `..._DOT`)
  and XNNPACK's change none of these.
- float32 weights held as rows, read as the product's left operand (`nd,md->nm`), on that AVX2
  machine under YNNPACK: a `(M, 2048) x (2048, 8192)` product 5.3 ms against 10.6 as stored at
  M=8, 14 against 26 at M=32, 55 against 73 at M=256, equal at M=1; in the 4-layer model above
  the first token of a 32-token prompt 191-200 ms against 310-367, a step 10-20% faster at
  batch 1 and 8 (bfloat16 rows: no faster). Not built, for the reason above (a layout every
  user of a matrix would have to know); this CPU is where it would pay most.
- int8 weights: converted to float32 a block of 256 input rows at a time in a `lax.scan` over
  the blocks (a sequence the loop slices itself: no index in the graph), each block's product
  accumulated: 1.3-1.5 ms at B=1 against float32's 1.6-2.3 (the matrix is
  a quarter of the bytes), 1.8-2.1 against 2.7-4.2 at B=8, equal at B=64. Converting the whole
  matrix first costs 22-26 ms; 64-row blocks 2.8 ms, 512-row ones 2.2 (measured 128 to 512: 256
  is best at every batch); a `lax.map` over blocks of output columns 12-15 ms.
  On the AVX2-only machine (2026-12-07), int8 matrices held as rows `(n, d)` and widened a
  block of rows at a time as a table is (`_blocks_out`): `2048 -> 8192` at B=1 0.9-1.1 ms
  against 2.7 as stored (float32 2.5), but `8192 -> 2048` 36-40 ms against 3.7 and at B=8
  7.0-9.4 against 6.0; a multiply-and-reduce over each block 74-102 ms; held as tiles of 256
  output columns `(n / 256, d, 256)`, each widened whole: `2048 -> 8192` 3.5 ms at B=1 against
  2.1, `8192 -> 2048` 2.3 against 3.5. Not used: no one layout is faster for every matrix of a
  layer.
  int8 x int8 products accumulated in int32 (the activations quantized too, a scale per row,
  the matrix as rows `(n, d)`, a single row padded to two) take YNNPACK's int8 GEMM there:
  1.1-1.3 ms at B=1, 3.2-4.1 at B=8 and 8.6-10 at B=32 for both shapes, 2-3x float32; but the
  trained byte model of tests/test_precision.py then agrees with float32's top token at 97.4% of
  2048 bytes (96.9% with an int8 cache; KL 2.1e-3), below the 98% the weight-only path keeps
  (98.9%). A scale per 16 activations keeps 98.1% (97.9% with the cache) but its batched
  products of 16 take 11.7 ms at B=2 (per 256: 2.8 ms, no faster than float32). Not used.
"""

import math
from functools import partial
from typing import Any

import jax.numpy as jnp
from jax import lax
from jaxtyping import Array

__all__ = ["INT8_BLOCK", "gathered_in_place", "project", "project_int8", "quantize_int8"]

INT8_BLOCK = 256  # input rows of an int8 matrix widened at a time (see the module's docstring)


def _narrow(x: Any, w: Any) -> Any:
    """The narrower of two floating dtypes (the product's operand dtype)."""
    return x if jnp.finfo(x).bits <= jnp.finfo(w).bits else w


def _single_row(x: Array) -> bool:
    lead = x.shape[:-1]
    return all(isinstance(n, int) for n in lead) and math.prod(lead) == 1


def project(x: Array, w: Array, out_dtype: Any = None, transposed: bool = False) -> Array:
    """`x @ w` over the last axis of `x` (`w (d, n)`, or `(n, d)` with `transposed`: an
    embedding table read as a tied head), in `out_dtype` (default `x.dtype`)."""
    out_dtype = x.dtype if out_dtype is None else out_dtype
    spec = "...d,nd->...n" if transposed else "...d,dn->...n"
    if x.dtype == w.dtype == jnp.float32:
        return jnp.einsum(spec, x, w).astype(out_dtype)
    operand = _narrow(x.dtype, w.dtype)
    a, b = x.astype(operand), w.astype(operand)
    lead = x.shape[:-1]
    if jnp.finfo(operand).bits == 16 and _single_row(x):  # XLA CPU's slow matrix-vector path
        a = jnp.pad(a.reshape(1, -1), ((0, 1), (0, 0)))
    rows = a.reshape(-1, a.shape[-1])
    if transposed:  # the table as the left operand, as it lies: no transposed copy of it
        y = jnp.einsum("nd,md->nm", b, rows, preferred_element_type=jnp.float32).T
    else:
        y = jnp.einsum("md,dn->mn", rows, b, preferred_element_type=jnp.float32)
    y = y[: math.prod(lead)] if _single_row(x) else y
    return y.reshape(*lead, y.shape[-1]).astype(out_dtype)


def project_int8(
    x: Array, q: Array, scale: Array, out_dtype: Any = None, transposed: bool = False
) -> Array:
    """`x @ (q * scale)` for int8 `q (d, n)` and a float scale per output column (`(1, n)`;
    `q (n, d)` and scales `(n, 1)` with `transposed`: a table read as a tied head), in
    `out_dtype` (default `x.dtype`): the product in float32, `q` widened a block of `INT8_BLOCK`
    rows at a time (`_blocks_in`, `_blocks_out`), then the columns scaled. Never a float copy of
    the whole of `q`."""
    out_dtype = x.dtype if out_dtype is None else out_dtype
    h = x.astype(jnp.float32)
    y = lax.platform_dependent(
        h, q, cpu=partial(_int8_on_cpu, transposed=transposed),
        default=partial(_int8_fused, transposed=transposed),
    )  # fmt: skip
    n = y.shape[-1]
    scale = jnp.broadcast_to(scale.reshape(n).astype(jnp.float32), y.shape)
    return (y * scale).astype(out_dtype)


def _int8_on_cpu(h: Array, q: Array, transposed: bool) -> Array:
    """`h @ q` (`h @ q.T` with `transposed`) as XLA's CPU compiler runs it fastest: widened in
    blocks (`_blocks_out`, `_blocks_in`), or in one product where `q` is a single block."""
    if transposed:
        return _blocks_out(h, q)
    if q.shape[0] % INT8_BLOCK == 0 and q.shape[0] > INT8_BLOCK:
        return _blocks_in(h, q)
    return jnp.einsum("...k,kn->...n", h, q.astype(jnp.float32))


def _int8_fused(h: Array, q: Array, transposed: bool) -> Array:
    """`h @ q` (`h @ q.T` with `transposed`) in one product, the widening of `q` left to the
    compiler: XLA's TPU compiler fuses it into the product, which reads the int8 bytes. On a
    TPU v5e (2026-12-06), Llama-3.2-1B's greedy decoding at batch 1 (32 tokens after 32, int8
    projections, bfloat16 tables): 456 tokens/s this way, 270 with the CPU's loop over blocks
    (bfloat16 weights 288, float32 149); with the tables in int8 too, 380 against 218."""
    return jnp.einsum("...k,nk->...n" if transposed else "...k,kn->...n", h, q.astype(jnp.float32))


def _blocks_in(h: Array, q: Array) -> Array:
    """`h @ q` for `q (d, n)`, over blocks of `INT8_BLOCK` input rows, each block's product
    added: the blocks are a `lax.scan`'s sequence, sliced by the loop itself (no index in the
    graph)."""
    n, blocks = q.shape[1], q.shape[0] // INT8_BLOCK
    hb = jnp.moveaxis(h.reshape(*h.shape[:-1], blocks, INT8_BLOCK), -2, 0)

    def add(acc: Array, block: tuple[Array, Array]) -> tuple[Array, None]:
        rows, weights = block
        return acc + jnp.einsum("...k,kn->...n", rows, weights.astype(jnp.float32)), None

    qb = q.reshape(blocks, INT8_BLOCK, n)
    return lax.scan(add, jnp.zeros((*h.shape[:-1], n), jnp.float32), (hb, qb))[0]


def _blocks_out(h: Array, q: Array) -> Array:
    """`h @ q.T` for a table `q (n, d)`, over blocks of `INT8_BLOCK` of its rows (output
    columns), the last `n % INT8_BLOCK` rows in one product. Each block is widened and
    transposed in one pass, `(d, 256)` in float32, for the product's fast layout: at Llama-3's
    vocabulary (128256 x 2048) 9-11 ms at B=1 against float32's table's 27-39; reading the block
    as it lies (`...k,nk`) takes 33 ms, and blocks of 512 rows or more 77-176 ms (the widened
    block past the core's cache)."""
    n, d = q.shape
    whole = n - n % INT8_BLOCK
    parts = []
    if whole:

        def columns(carry: None, block: Array) -> tuple[None, Array]:
            return None, jnp.einsum("...k,kn->...n", h, block.astype(jnp.float32).T)

        ys = lax.scan(columns, None, q[:whole].reshape(whole // INT8_BLOCK, INT8_BLOCK, d))[1]
        parts.append(jnp.moveaxis(ys, 0, -2).reshape(*h.shape[:-1], whole))
    if whole < n:
        parts.append(jnp.einsum("...k,nk->...n", h, q[whole:].astype(jnp.float32)))
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=-1)


def gathered_in_place(table: Array, indices: Array) -> tuple[Array, Array]:
    """`(table, indices)` for a gather of rows, tied in an optimisation barrier where `table`
    holds 16-bit floats. XLA's CPU compiler gathers such rows from a float32 copy of the table,
    and inside a compiled loop (`generate`'s) it hoists that copy out: a widening of the whole
    table per call (1 GB at Llama-3's vocabulary, 0.6 s). Tied to the indices, which change
    every step, the widening stays in the gather and touches only the rows taken."""
    if jnp.issubdtype(table.dtype, jnp.floating) and jnp.finfo(table.dtype).bits == 16:
        return lax.optimization_barrier((table, indices))
    return table, indices


def quantize_int8(w: Array, axis: int) -> tuple[Array, Array]:
    """`w` as int8 values and float32 scales over `axis` (symmetric, per channel: each scale
    `max |w| / 127` over `axis`, kept with `keepdims`; an all-zero channel has scale 1, and a
    channel holding NaN or an infinity a NaN or infinite scale, so it is not lost)."""
    w = w.astype(jnp.float32)
    peak = jnp.max(jnp.abs(w), axis=axis, keepdims=True)
    scale = jnp.where(peak == 0, 1.0, peak / 127.0)
    q = jnp.clip(jnp.round(w / scale), -127, 127).astype(jnp.int8)
    return q, scale
