"""The TPU's paged decode attention (`nn.kernels.paged`), run here in Pallas's interpret mode: the
kernel against a float64 NumPy attention over the same pages, and a model's steps through it
(`read="kernel"`) against the gather path (`read="gather"`), over pools full of NaN where no
stream wrote, alone and as a batch of streams sharing one pool, and a paged `Server`'s tokens."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dense_armor.huggingface import import_hf
from dense_armor.nn.kernels import paged as kernel
from dense_armor.nn.kernels.rotary import Rotary
from dense_armor.nn.models.generation import generate
from dense_armor.nn.models.stack import scanned
from dense_armor.nn.state.paged import (
    PagedKVCache,
    paged_cache,
    paged_streams,
    stream_axes,
    with_tables,
)
from dense_armor.serving import Server
from test_language_models import DATA, PREFILL, STEP
from test_paged import _poisoned


def _paged(node):
    return isinstance(node, PagedKVCache)


def _spy(monkeypatch):
    """The kernel's calls as they are traced (their queries' shapes)."""
    traced, call = [], kernel._call

    def counted(*args):
        traced.append(args[0].shape)
        return call(*args)

    monkeypatch.setattr(kernel, "_call", counted)
    return traced


TABLES = np.array([[5, 2, 7, 1, 3, 8, 4, 6], [8, 7, 6, 5, 4, 3, 2, 1]])


def _numpy_attention(q, keys, values, table, position, rotary, window, softcap):
    """One query row over a stream's pages in float64, the rotation written from its formula
    (`x cos + rotate_half(x) sin` on the first `dims` features, the rest passed through)."""
    d = keys.shape[3]
    k = keys[table].transpose(1, 0, 2, 3).reshape(keys.shape[1], -1, d).astype(np.float64)
    v = values[table].transpose(1, 0, 2, 3).reshape(keys.shape[1], -1, d).astype(np.float64)
    length = k.shape[1]
    if rotary is not None:
        dims, half = rotary.dims, rotary.dims // 2
        inverse = rotary.base ** (-np.arange(half) * 2.0 / dims)
        angles = np.arange(length)[:, None] * inverse[None, :]
        cos, sin = np.cos(angles), np.sin(angles)
        a, b = k[..., :half].copy(), k[..., half:dims].copy()
        k[..., :half], k[..., half:dims] = a * cos - b * sin, b * cos + a * sin
    col = np.arange(length)
    seen = (col <= position) & (col > position - (window or length + position + 1))
    grouped = q.reshape(keys.shape[1], -1, d).astype(np.float64)
    s = np.einsum("hgd,hld->hgl", grouped, k) / np.sqrt(d)
    if softcap is not None:
        s = np.tanh(s / softcap) * softcap
    s = np.where(seen, s, -np.inf)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    out = np.einsum(
        "hgl,hld->hgd", p / p.sum(axis=-1, keepdims=True), np.where(seen[:, None], v, 0)
    )
    return out.reshape(q.shape)


@pytest.mark.parametrize(
    "rotary, window, softcap, position",
    [
        (Rotary(10000.0, 16), None, None, 21),
        (None, None, None, 0),
        (Rotary(10000.0, 16, fraction=0.5), 5, None, 30),
        (Rotary(500.0, 16), 9, 3.0, 12),
        (Rotary(10000.0, 16), None, None, 40),  # past the stream's pages: every row seen
    ],
)
def test_the_kernel_equals_float64_attention_over_the_pages(rotary, window, softcap, position):
    rng = np.random.default_rng(0)
    keys = rng.normal(size=(9, 2, 4, 16)).astype(np.float32)
    values = rng.normal(size=(9, 2, 4, 16)).astype(np.float32)
    table = TABLES[0]
    # rows past the position and out of the window hold NaN: they must never reach the output
    for p, page in enumerate(table):
        rows = np.arange(4) + 4 * p
        hidden = (rows > position) | (rows <= position - (window or 10**6))
        keys[page][:, hidden], values[page][:, hidden] = np.nan, np.nan
    q = rng.normal(size=(6, 16)).astype(np.float32)
    rotation = kernel.rotation_tables(rotary, 32, 16)
    got = kernel.paged_decode(  # off a TPU: in Pallas's interpret mode
        jnp.asarray(q), jnp.asarray(keys), jnp.asarray(values), jnp.asarray(table),
        jnp.asarray(position), rotation, window, softcap,
    )  # fmt: skip
    expected = _numpy_attention(q, keys, values, table, position, rotary, window, softcap)
    np.testing.assert_allclose(np.asarray(got), expected, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["llama_gqa", "gpt2", "gemma2", "phi4_mini", "qwen3"])
def test_a_model_s_steps_through_the_kernel_equal_the_gather_path(name, monkeypatch):
    traced = _spy(monkeypatch)
    model, _ = import_hf(DATA / name)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, model.vocab, 16))
    runs = {}
    for read in ("gather", "kernel"):
        cache = _poisoned(paged_cache(model.init_cache(32, on_overflow="nan"), 9, 4, 8, read))
        cache = with_tables(cache, jnp.asarray(TABLES[0]))
        _, cache = PREFILL(model, ids[:9], cache)  # several rows: the gather path
        runs[read] = []
        for token in ids[9:]:
            logits, cache = STEP(model, token, cache)
            runs[read].append(logits)
        assert bool(traced) == (read == "kernel")  # the kernel ran, or did not
    got, expected = np.stack(runs["kernel"]), np.stack(runs["gather"])
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, expected, atol=2e-5, rtol=1e-5)


def test_a_batch_of_streams_runs_one_kernel_over_the_shared_pool():
    model, _ = import_hf(DATA / "llama_gqa")
    ids = np.random.default_rng(1).integers(0, model.vocab, (2, 6))
    runs = {}
    for read in ("gather", "kernel"):
        caches = paged_streams(_poisoned(paged_cache(model.init_cache(32), 9, 4, 8, read)), 2)
        caches = with_tables(caches, jnp.asarray(TABLES))
        axes = stream_axes(caches)
        step = jax.jit(jax.vmap(model.step, in_axes=(0, axes), out_axes=(0, axes)))
        jaxpr = str(jax.make_jaxpr(step)(jnp.asarray(ids[:, 0]), caches))
        # one kernel call per layer for both streams, none on the gather path
        layers = sum(isinstance(n, PagedKVCache) for n in jax.tree.leaves(caches, is_leaf=_paged))
        assert jaxpr.count("pallas_call[") == (layers if read == "kernel" else 0)
        outputs = []
        for t in range(ids.shape[1]):
            logits, caches = step(jnp.asarray(ids[:, t]), caches)
            outputs.append(logits)
        runs[read] = np.stack(outputs)
    np.testing.assert_allclose(runs["kernel"], runs["gather"], atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("name, scan", [("gemma2", False), ("llama_gqa", True)])
def test_a_paged_server_through_the_kernel_gives_solo_greedy_tokens(name, scan, monkeypatch):
    """Gemma 2's windows and softcap, and a scanned stack (the layers' pools stacked, each
    layer's slice read by the kernel), with shared prefixes and preemption."""
    traced = _spy(monkeypatch)
    model, _ = import_hf(DATA / name)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, model.vocab, n).tolist() for n in (5, 11, 3, 21)]
    prompts.append(prompts[3][:16])  # a shared prefix: its pages copied before a write
    greedy = np.asarray(generate(model, prompts, 6).tokens)
    served = eqx.tree_at(lambda m: m.blocks, model, scanned(model.blocks)) if scan else model
    server = Server(served, 3, 32, chunk=4, pages=10, page_size=4, share_prefixes=True,
                    decode_steps=2, paged_attention="kernel")  # fmt: skip
    done = server.serve([(p, 6) for p in prompts])
    assert traced  # the kernel ran
    for n, completion in enumerate(done):
        np.testing.assert_array_equal(completion.tokens, greedy[n], err_msg=str(n))
    assert sum(c.preempted for c in done) > 0


def test_what_the_kernel_does_not_cover_takes_the_gather_path():
    pool = jnp.zeros((9, 2, 4, 16), jnp.bfloat16)
    assert kernel.kernel_fits(pool, 8, 1, False, "kernel")
    assert not kernel.kernel_fits(pool, 8, 3, False, "kernel")  # a prefill
    assert not kernel.kernel_fits(pool, 8, 1, True, "kernel")  # an int8 cache
    assert not kernel.kernel_fits(pool.astype(jnp.int8), 8, 1, False, "kernel")
    big = jnp.zeros((2, 8, 16, 128), jnp.float32)  # pages of 64 KiB, keys' and values'
    most = kernel.VMEM_BUDGET // (2 * 64 * 2**10 * kernel._DEPTH)  # pages per stream at most
    assert kernel.kernel_fits(big, most, 1, False, "kernel")
    assert not kernel.kernel_fits(big, most + 1, 1, False, "kernel")
    assert not kernel.kernel_fits(pool, 8, 1, False, "gather")
    assert kernel.kernel_fits(pool, 8, 1, False, "auto") == (jax.default_backend() == "tpu")
    with pytest.raises(ValueError, match="`read` must be one of"):
        paged_cache(_one_cache(), 9, 4, 8, "fast")
    with pytest.raises(ValueError, match="`paged_attention` must be one of"):
        Server(import_hf(DATA / "gpt2")[0], 2, 32, pages=12, paged_attention="pallas")


def _one_cache():
    return import_hf(DATA / "gpt2")[0].init_cache(16)


def test_a_server_that_reads_pages_in_place_runs_one_table_width():
    """Its ticks cost the same at any width (the kernel copies only the pages in use), so it
    compiles the whole table's alone; the gather's cost grows with the width, so its tables
    are cut to the next power of two of the pages in use, and an int8 cache always gathers."""
    model, _ = import_hf(DATA / "gpt2")
    widths = {}
    for read, kv_dtype in (("kernel", None), ("gather", None), ("kernel", "int8")):
        server = Server(model, 2, 32, pages=12, page_size=4, paged_attention=read,
                        kv_dtype=kv_dtype)  # fmt: skip
        store = server._slots()
        widths[read, kv_dtype] = sorted({store._width(k) for k in range(1, store.width + 1)})
    assert widths == {("kernel", None): [8], ("gather", None): [1, 2, 4, 8],
                      ("kernel", "int8"): [1, 2, 4, 8]}  # fmt: skip
