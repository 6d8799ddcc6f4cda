"""Low precision: bfloat16 and float16 weights, int8 weights with a scale per output channel, and
an int8 key/value cache with a scale per head and position. The products and the cache's
attention against float64 NumPy of the same rounded operands; quantization against its rule done
by hand; a model's accuracy against its own float32 logits (the trained byte model of
examples/language_model.py, committed in tests/data/byte_lm, and an imported random checkpoint);
and a quantized model through checkpoints, `generate`, the `Server`, `import_hf` and `export_hf`."""

import pathlib
import re
import subprocess

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from dense_armor.checkpoints import ModelConfig, load_checkpoint, save_checkpoint
from dense_armor.cli import main as cli
from dense_armor.export import export_model, load
from dense_armor.export.iree import compile_artifact
from dense_armor.export.standalone import build_runner, check_iree, default_plugin
from dense_armor.huggingface import export_hf, import_hf
from dense_armor.huggingface._files import SafetensorsFile
from dense_armor.nn import precision, products
from dense_armor.nn.core import QuantizedParam
from dense_armor.nn.mixers.self_attention import MultiHeadSelfAttention
from dense_armor.nn.models.generation import generate, stream_tokens
from dense_armor.nn.state.cache import FixedKVCache, RingKVCache
from dense_armor.serving import Server

DATA = pathlib.Path(__file__).parent / "data"
BYTES = DATA / "byte_lm"  # examples/language_model.py's checkpoint (1500 steps, its defaults)
HELD_OUT = np.frombuffer((BYTES / "held_out.py.txt").read_bytes(), np.uint8).astype(np.int32)
GATES = {"bfloat16": 1e-3, "int8 weights": 5e-3, "int8 cache": 5e-3, "int8 both": 5e-3}
DECODING = ["init_cache", "sample_prefill", "sample_step"]


@pytest.fixture
def rng():
    """Each test's own random data, whatever ran before it."""
    return np.random.default_rng(0)


def _f64(a):
    return np.asarray(jnp.asarray(a).astype(jnp.float32), np.float64)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("lead", [(), (1,), (3,), (2, 5)])
def test_a_half_precision_product_is_float64s_of_its_rounded_operands(dtype, lead, rng):
    x = jnp.asarray(rng.standard_normal((*lead, 96)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((96, 40)), dtype)
    want = _f64(x.astype(dtype)) @ _f64(w)  # the operands rounded, the sums exact
    got = products.project(x, w)
    assert got.dtype == jnp.float32 and got.shape == (*lead, 40)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-5, atol=1e-5)
    table = jnp.asarray(rng.standard_normal((40, 96)), dtype)  # a tied head's (vocab, d) table
    got = products.project(x, table, jnp.float32, transposed=True)
    np.testing.assert_allclose(got, _f64(x.astype(dtype)) @ _f64(table).T, rtol=1e-5, atol=1e-5)


def _fused_int8(x, q, scale, transposed):
    """The formulation `project_int8` takes on a GPU or TPU (one product), run here."""
    y = products._int8_fused(x, q, transposed)
    return y * jnp.broadcast_to(scale.reshape(-1), y.shape)


@pytest.mark.parametrize("d", [64, 256, 768])  # one product; a block; three blocks of 256 rows
@pytest.mark.parametrize("lead", [(), (1,), (4,)])
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("path", ["cpu", "gpu and tpu"])
def test_an_int8_product_is_float64s_of_its_dequantized_matrix(d, lead, transposed, path, rng):
    n = 600 if transposed else 24  # a table's rows: two blocks of 256 and the rest
    q = rng.integers(-127, 128, (n, d) if transposed else (d, n)).astype(np.int8)
    scale = rng.uniform(0.001, 0.02, (n, 1) if transposed else (1, n)).astype(np.float32)
    x = jnp.asarray(rng.standard_normal((*lead, d)), jnp.float32)
    weights = q.astype(np.float64) * scale.astype(np.float64)
    weights = weights.T if transposed else weights
    want = np.asarray(x, np.float64) @ weights
    product = products.project_int8 if path == "cpu" else _fused_int8
    got = product(x, jnp.asarray(q), jnp.asarray(scale), transposed=transposed)
    assert got.dtype == jnp.float32
    # float32 round-off is relative to the terms summed, not to their sum, which may cancel: each
    # output within 16 units of float32's rounding (2**-24) of the sum of |x_i w_ij| (the errors
    # seen: up to 3 units, on an AVX2 CPU; a wrong scale or row block is off by whole percents)
    bound = 16 * 2.0**-24 * (np.abs(np.asarray(x, np.float64)) @ np.abs(weights))
    assert np.all(np.abs(np.asarray(got, np.float64) - want) <= bound)


def test_int8_quantization_follows_its_rule_per_output_channel():
    w = np.array(
        [[1.27, 0.0, 0.3, np.nan, 1.0], [-0.5, 0.0, -0.6, 1.0, np.inf], [0.0, 0.0, 0.06, 2.0, 1.0]],
        np.float32,
    )  # columns: scale 0.01, an all-zero one (scale 1), 0.6 / 127, NaN, an infinity
    q, scale = products.quantize_int8(jnp.asarray(w), axis=-2)
    assert q.dtype == jnp.int8 and scale.shape == (1, 5)
    assert np.asarray(q)[:, 0].tolist() == [127, -50, 0]  # by hand: 1.27 / 0.01, -0.5 / 0.01
    assert np.asarray(q)[:, 1].tolist() == [0, 0, 0] and float(scale[0, 1]) == 1.0
    assert np.asarray(q)[:, 2].tolist() == [64, -127, 13]  # 0.3 * 127 / 0.6 = 63.5 -> 64
    np.testing.assert_allclose(float(scale[0, 2]), 0.6 / 127, rtol=1e-7)
    assert np.isnan(float(scale[0, 3])) and np.isinf(float(scale[0, 4]))  # never lost


def _dequantized_rows(a):
    """Rows `(heads, L, d)` quantized as the int8 cache does, in float64: the reference's."""
    peak = np.abs(a).max(axis=-1, keepdims=True)
    scale = np.where(peak == 0, 1.0, peak.astype(np.float32) / np.float32(127.0))
    return np.clip(np.round(a / scale), -127, 127) * scale


def _reference_attention(layer, x, window):
    """float64 causal attention of `layer` over `x (T, d)` with keys and values rounded to int8 per
    head and position: what an int8 cache must give, step by step."""
    w = {n: np.asarray(getattr(layer, n).value, np.float64) for n in ("W_Q", "W_K", "W_V", "W_O")}
    heads, d_head = layer.n_heads, layer.d_head
    x64 = np.asarray(x, np.float64)

    def split(a):  # (T, heads * d_head) -> (heads, T, d_head)
        return a.reshape(len(x), heads, d_head).transpose(1, 0, 2)

    q = split(x64 @ w["W_Q"]) / np.sqrt(d_head)
    k, v = (_dequantized_rows(split(x64 @ w[n])) for n in ("W_K", "W_V"))
    t, s = np.arange(len(x))[:, None], np.arange(len(x))[None, :]
    seen = (s <= t) & (t - s < (window or len(x)))
    scores = np.where(seen, q @ k.transpose(0, 2, 1), -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    out = (p / p.sum(-1, keepdims=True)) @ v
    return out.transpose(1, 0, 2).reshape(len(x), heads * d_head) @ w["W_O"]


@pytest.mark.parametrize("window", [None, 3])  # a fixed cache; a ring that wraps
def test_an_int8_cache_attends_as_float64_over_its_rounded_rows(getkey, window, rng):
    layer = MultiHeadSelfAttention(32, 4, getkey(), causal=True, window=window)
    x = jnp.asarray(rng.standard_normal((9, 32)), jnp.float32)
    cache = precision.cache_in(layer.init_cache(12), "int8")
    assert cache.keys.dtype == jnp.int8 and cache.key_scale.shape == (4, window or 12, 1)
    y, cache = layer.prefill(x[:4], cache)
    rows = [y]
    for t in range(4, 9):
        y_t, cache = layer.step(x[t], cache)
        rows.append(y_t[None])
    got = np.concatenate([np.asarray(r, np.float64) for r in rows])
    np.testing.assert_allclose(got, _reference_attention(layer, x, window), rtol=1e-4, atol=1e-5)


def _low(model, kind):
    """`model` as `kind` stores it, and the cache's dtype."""
    if kind == "bfloat16":
        return precision.cast(model, "bfloat16"), None
    quantized = precision.quantize(model) if kind in ("int8 weights", "int8 both") else model
    return quantized, "int8" if kind in ("int8 cache", "int8 both") else None


@eqx.filter_jit
def _forward(model, ids):
    return model(ids)


@eqx.filter_jit
def _cached(model, ids, cache):
    """The logits of `ids`: half prefilled, the rest stepped one by one (the cache's whole path)."""
    half = ids.shape[0] // 2
    first, cache = model.prefill(ids[:half], cache)
    _, rest = jax.lax.scan(lambda c, t: model.step(t, c)[::-1], cache, ids[half:])
    return jnp.concatenate([first, rest])


@pytest.mark.parametrize(
    "name, dtype",
    [("gemma2", "bfloat16"), ("gpt2", "bfloat16"), ("qwen3_5", "bfloat16"), ("qwen3", "float16")],
)
def test_a_narrow_model_s_cache_is_in_its_dtype_and_loses_nothing(name, dtype):
    """A bfloat16 (float16) model's caches hold its keys and values in that dtype by default:
    its logits, prefilled then stepped, equal those over a float32 cache bit for bit (what it
    writes is a value of its dtype); windowed rings, query/key norms, learned positions and a
    hybrid's recurrent states included."""
    model = precision.cast(import_hf(DATA / "hf" / name)[0], dtype)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, model.vocab, 12), jnp.int32)
    default, wide = model.init_cache(12), model.init_cache(12, kv_dtype="float32")

    def keys(cache):  # the key/value caches' dtypes (the recurrent states stay float32)
        kv = lambda n: isinstance(n, FixedKVCache | RingKVCache)  # noqa: E731
        nodes = [n for n in jax.tree.leaves(cache, is_leaf=kv) if kv(n)]
        return {str(a.dtype) for n in nodes for a in (n.keys, n.values)}

    assert dtype in keys(default) and "float32" not in keys(default)
    assert "float32" in keys(wide)
    got, expected = _cached(model, ids, default), _cached(model, ids, wide)
    assert got.dtype == expected.dtype and np.array_equal(np.asarray(got), np.asarray(expected))


def _kl_and_top1(model, windows, margin=0.0):
    """Mean KL(float32 || low) per token (float64) and top-1 agreement, for each precision: at
    the positions where float32's two best logits are at least `margin` apart."""
    out = {}
    for kind in GATES:
        low, kv = _low(model, kind)
        kls, agree = [], []
        for ids in windows:
            ref = np.asarray(_forward(model, jnp.asarray(ids)), np.float64)
            cache = low.init_cache(len(ids), kv_dtype=kv)
            got = np.asarray(_cached(low, jnp.asarray(ids), cache), np.float64)
            lp = ref - np.logaddexp.reduce(ref, axis=-1, keepdims=True)
            lq = got - np.logaddexp.reduce(got, axis=-1, keepdims=True)
            kls.append((np.exp(lp) * (lp - lq)).sum(-1))
            best = np.sort(ref, axis=-1)
            decided = best[:, -1] - best[:, -2] >= margin
            agree.append((ref.argmax(-1) == got.argmax(-1))[decided])
        out[kind] = (float(np.concatenate(kls).mean()), float(np.concatenate(agree).mean()))
    return out


def test_the_trained_byte_model_keeps_its_predictions_in_every_precision():
    model = load_checkpoint(BYTES).model
    windows = [HELD_OUT[i : i + 128] for i in range(0, 2048, 128)]  # 2048 held-out bytes
    for kind, (kl, top1) in _kl_and_top1(model, windows).items():
        assert kl < GATES[kind] and top1 >= 0.98, (kind, kl, top1)


def test_an_imported_checkpoint_keeps_its_predictions_in_every_precision():
    """A random checkpoint's logits are near-flat: of Llama's (d_model 32) 2% of positions have
    their two best logits within 0.01, where the argmax is a coin toss under any rounding; top-1
    agreement counts the positions whose float32 margin is at least 0.05 (92% of them)."""
    model, arguments = import_hf(DATA / "hf" / "llama_gqa")
    draw = np.random.default_rng(0)  # its own: the same tokens whichever tests ran before
    windows = [draw.integers(0, arguments["vocab"], 128).astype(np.int32) for _ in range(8)]
    for kind, (kl, top1) in _kl_and_top1(model, windows, margin=0.05).items():
        assert kl < GATES[kind] and top1 >= 0.98, (kind, kl, top1)


def _low_config(arguments, **precision_options):
    return ModelConfig("transformer_lm", {**arguments, **precision_options})


def test_a_quantized_bfloat16_model_saves_loads_generates_and_serves_alike(tmp_path):
    saved = load_checkpoint(BYTES)
    model = precision.cast(precision.quantize(saved.model), "bfloat16")
    config = _low_config(saved.config.arguments, param_dtype="bfloat16", quantize="int8")
    save_checkpoint(tmp_path / "low", model, config)  # the config says the structure
    stored = load_file(str(tmp_path / "low" / "weights.safetensors"))
    w_q = ".blocks[0].attention.W_Q"
    assert stored[f"{w_q}.value"].dtype == np.int8 and stored[f"{w_q}.scale"].dtype == np.float32
    assert stored[".norm.gain.value"].dtype == jnp.bfloat16
    assert stored[".embed.table.value"].dtype == jnp.bfloat16  # tables: not quantized by default
    loaded = load_checkpoint(tmp_path / "low").model
    assert bool(eqx.tree_equal(loaded, model))
    assert isinstance(loaded.blocks[0].attention.W_Q, QuantizedParam)

    prompts = [list(b"def "), list(b"class Heap(")]
    made = generate(loaded, prompts, 12, kv_dtype="int8")
    want = [row[:n].tolist() for row, n in zip(made.tokens, made.lengths, strict=True)]
    server = Server(loaded, slots=2, capacity=32, kv_dtype="int8", chunk=4)
    assert [c.tokens.tolist() for c in server.serve([(p, 12) for p in prompts])] == want
    assert list(stream_tokens(loaded, prompts[1], 12, kv_dtype="int8")) == want[1]


def test_an_int8_cache_keeps_a_non_finite_key_visible(rng):
    """A NaN or infinite key quantizes to a non-finite scale: the rows that see it are NaN, as
    with a float cache, never a finite row from a lost value."""
    layer = MultiHeadSelfAttention(16, 2, jax.random.PRNGKey(1), causal=True)
    x = jnp.asarray(rng.standard_normal((4, 16)), jnp.float32).at[1, 3].set(jnp.nan)
    for kv in ("int8", None):
        y, _ = layer.prefill(x, precision.cache_in(layer.init_cache(6), kv))
        finite = np.isfinite(np.asarray(y)).all(axis=-1)
        assert finite.tolist() == [True, False, False, False], kv


def test_import_hf_keeps_a_bfloat16_checkpoint_as_stored_and_writes_it_back(tmp_path):
    source = DATA / "hf" / "qwen3"
    hf = tmp_path / "bf16"
    hf.mkdir()
    (hf / "config.json").write_text((source / "config.json").read_text())
    tensors = {
        k: v.astype(jnp.bfloat16) for k, v in load_file(str(source / "model.safetensors")).items()
    }
    save_file(tensors, str(hf / "model.safetensors"))
    table = "model.embed_tokens.weight"
    assert SafetensorsFile(hf / "model.safetensors").get_tensor(table).dtype == jnp.bfloat16

    model, arguments = import_hf(hf, dtype="bfloat16")
    assert arguments["param_dtype"] == "bfloat16"
    held = np.asarray(model.embed.table.value)
    assert (
        held.dtype == jnp.bfloat16
        and held.view(np.uint16).tolist() == tensors[table].view(np.uint16).tolist()
    )
    same = export_hf(model, arguments, tmp_path / "same", architecture="Qwen3ForCausalLM")
    written = load_file(str(same / "model.safetensors"))  # every tensor back, bit for bit
    assert sorted(written) == sorted(tensors)
    assert all(
        np.array_equal(written[k].view(np.uint16), t.view(np.uint16)) for k, t in tensors.items()
    )
    save_checkpoint(tmp_path / "ckpt", model, _low_config(arguments))
    assert bool(eqx.tree_equal(load_checkpoint(tmp_path / "ckpt").model, model))
    wide, _ = import_hf(hf)  # float32: bfloat16 widened exactly
    assert np.array_equal(np.asarray(wide.embed.table.value), tensors[table].astype(np.float32))

    quantized, q_arguments = import_hf(hf, dtype="bfloat16", quantize="int8")
    assert q_arguments["quantize"] == "int8"
    built = eqx.filter_eval_shape(_low_config(q_arguments).build)  # the arguments say its form
    assert jax.tree.structure(built) == jax.tree.structure(quantized)
    assert [(a.shape, a.dtype) for a in jax.tree.leaves(built)] == [
        (a.shape, a.dtype) for a in jax.tree.leaves(quantized)
    ]
    out = export_hf(quantized, q_arguments, tmp_path / "back", architecture="Qwen3ForCausalLM")
    back = load_file(str(out / "model.safetensors"))
    assert {v.dtype for v in back.values()} == {np.dtype(jnp.bfloat16)}
    w_q = quantized.blocks[0].attention.W_Q
    dequantized = np.asarray(w_q.array(jnp.float32).astype(jnp.bfloat16)).T
    assert np.array_equal(back["model.layers.0.self_attn.q_proj.weight"], dequantized)


def test_a_quantized_artifact_decodes_the_models_tokens_in_jax_iree_and_c(tmp_path):
    """bfloat16 tables and norms, int8 projections and an int8 cache, exported: the artifact's
    greedy decoding (each token chosen in `sample_step`'s graph) is the model's own `generate`
    in JAX's loader, in IREE and from C through XLA's PJRT plugin."""
    saved = load_checkpoint(BYTES)
    config = _low_config(saved.config.arguments, param_dtype="bfloat16", quantize="int8")
    model = precision.cast(precision.quantize(saved.model), "bfloat16")
    prompt = list(b"def heap")
    want = generate(model, [prompt], 16, kv_dtype="int8").tokens[0].tolist()
    out = tmp_path / "art"
    summary = export_model(
        model, config, out, capacity=32, platforms=["cpu"], static_shapes=[(1, 8)], kv_dtype="int8"
    )
    described = summary.manifest["precision"]
    assert described["kv_dtype"] == "int8" and described["weights"]["int8"] == 14
    assert {e["dtype"] for e in summary.manifest["streaming"]["layout"]} >= {"int8"}
    # the checkers compare with bfloat16's round-off at the outputs' scale: 2**-6 of the
    # largest golden output (the logits, near 10: two or three bfloat16 steps), or 5e-2
    golden = load_file(str(out / "golden.safetensors"))
    floats = [a for a in golden.values() if a.dtype.kind not in "biu"]  # not ids, keys, masks
    largest = max(float(np.abs(a.astype(np.float32)).max()) for a in floats)
    assert 8 < largest < 16 and described["tolerance"] == largest / 64

    artifact = load(out)
    token, cache, overflow = artifact.sample_prefill(
        np.array([prompt], np.int32), artifact.init_cache(1)
    )
    tokens = [int(token[0])]
    while len(tokens) < len(want):
        token, cache, overflow = artifact.sample_step(token, cache)
        tokens.append(int(token[0]))
    assert tokens == want and not overflow.any()

    compile_artifact(out, ["llvm-cpu"], jobs=2, functions=DECODING)
    errors = check_iree(out)
    assert errors["iree sample_step B=1, 32 tokens (tokens that differ)"] == 0.0, errors
    assert max(errors.values()) <= described["tolerance"], errors

    runner = tmp_path / "runner"
    assert build_runner(out, runner) == ""
    done = subprocess.run(
        [str(runner), str(out), "--plugin", str(default_plugin())], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr  # every function within tolerance
    assert re.search(
        r"sample_step B=1, 32 tokens \(tokens that differ\)\s+max \|error\| = 0\.000e\+00",
        done.stdout,
    )


def test_the_command_line_imports_low_and_decodes_with_an_int8_cache(tmp_path, capsys):
    out = tmp_path / "ckpt"
    hf = ["import-hf", str(DATA / "hf" / "qwen3"), "--out", str(out)]
    assert cli([*hf, "--dtype", "bfloat16", "--quantize", "int8"]) == 0
    saved = load_checkpoint(out)
    assert saved.config.arguments["param_dtype"] == "bfloat16"
    assert isinstance(saved.model.blocks[0].attention.W_Q, QuantizedParam)
    capsys.readouterr()
    assert (
        cli(["generate", str(out), "--ids", "1,2,3", "--max-new-tokens", "5", "--kv-dtype", "int8"])
        == 0
    )
    printed = [int(t) for t in capsys.readouterr().out.split()]
    assert printed == generate(saved.model, [[1, 2, 3]], 5, kv_dtype="int8").tokens[0].tolist()
    assert cli([*hf, "--quantize-embeddings"]) == 2  # without --quantize: refused in one line
    assert "--quantize-embeddings needs --quantize int8" in capsys.readouterr().err


def test_a_scanned_model_quantizes_as_its_unrolled_twin():
    """Stacked blocks (`scan_layers=True`) carry a scale per layer and output channel (a stacked
    norm's gain, two axes with the layers', is no matrix and stays float); the scanned int8 model
    computes what the unrolled one does, with an int8 cache too."""
    arguments = {**load_checkpoint(BYTES).config.arguments, "quantize": "int8"}
    unrolled = _low_config(arguments).build(jax.random.PRNGKey(2))
    scanned = _low_config(arguments, scan_layers=True).build(jax.random.PRNGKey(2))
    assert scanned.blocks.stacked.attention.W_Q.scale.shape == (2, 1, 64)
    assert not isinstance(scanned.blocks.stacked.norm1.gain, QuantizedParam)
    ids = jnp.asarray(HELD_OUT[:24])
    np.testing.assert_allclose(_forward(scanned, ids), _forward(unrolled, ids), atol=1e-5)
    cache = scanned.init_cache(24, kv_dtype="int8")
    np.testing.assert_allclose(
        _cached(scanned, ids, cache),
        _cached(unrolled, ids, unrolled.init_cache(24, kv_dtype="int8")),
        atol=1e-5,
    )
