"""Recurrent layers and mixed stacks: against Equinox's cells, PyTorch's nn.GRU / nn.LSTM (golden
data made by tests/torch_reference/make_recurrent_golden.py), a float64 NumPy minGRU, and the
streaming protocol (step == forward, prefill == steps, masked steps keep the state), export."""

import pathlib

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from dense_armor.checkpoints import CheckpointError, ModelConfig, load_checkpoint, save_checkpoint
from dense_armor.export import check_golden, export_model, load
from dense_armor.export.golden import GOLDEN_STEPS
from dense_armor.utility.neural import (
    GRU,
    LSTM,
    HiddenState,
    LSTMState,
    MinGRU,
    RecurrentBlock,
    batch_streams,
    reset,
    transformer_encoder,
)
from streams import prefix_outputs, stream

KEY = jax.random.PRNGKey(0)
TORCH = pathlib.Path(__file__).resolve().parent / "data" / "torch"
LAYERS = {"gru": GRU, "lstm": LSTM, "mingru": MinGRU}


def with_weights(layer, **arrays):
    names = tuple(arrays)
    return eqx.tree_at(
        lambda m: tuple(getattr(m, n).value for n in names),
        layer,
        tuple(jnp.asarray(a, jnp.float32) for a in arrays.values()),
    )


def final_state(layer, x, state=None, mask=None):
    state = layer.init_cache() if state is None else state
    return layer.prefill(x, state, mask=mask)


# --- Equinox's cells, with copied weights ------------------------------------------------------


def test_gru_equals_equinox_grucell_under_scan():
    cell = eqx.nn.GRUCell(5, 7, key=KEY)
    layer = with_weights(
        GRU(5, 7, KEY),
        W_i=cell.weight_ih.T,
        W_h=cell.weight_hh.T,
        b_i=cell.bias,
        b_h=jnp.concatenate([jnp.zeros(14), cell.bias_n]),  # Equinox adds b_hn inside r * (.)
    )
    x = jax.random.normal(jax.random.PRNGKey(1), (40, 5))
    h0 = jax.random.normal(jax.random.PRNGKey(2), (7,))
    expected = jax.lax.scan(lambda h, x_t: (cell(x_t, h),) * 2, h0, x)[1]
    y, state = final_state(layer, x, HiddenState(h0))
    np.testing.assert_allclose(y, expected, atol=1e-6)
    np.testing.assert_allclose(state.h, expected[-1], atol=1e-6)


def test_lstm_equals_equinox_lstmcell_under_scan():
    cell = eqx.nn.LSTMCell(5, 7, key=KEY)
    layer = with_weights(
        LSTM(5, 7, KEY), W_i=cell.weight_ih.T, W_h=cell.weight_hh.T, b_i=cell.bias, b_h=np.zeros(28)
    )
    x = jax.random.normal(jax.random.PRNGKey(1), (40, 5))
    start = (jnp.full((7,), 0.3), jnp.full((7,), -0.2))

    def tick(state, x_t):
        state = cell(x_t, state)
        return state, state

    (h, c), (hs, _) = jax.lax.scan(tick, start, x)
    y, state = final_state(layer, x, LSTMState(*start))
    np.testing.assert_allclose(y, hs, atol=1e-6)
    np.testing.assert_allclose(state.h, h, atol=1e-6)
    np.testing.assert_allclose(state.c, c, atol=1e-6)


# --- PyTorch's nn.GRU and nn.LSTM, golden data ---------------------------------------------------


@pytest.mark.parametrize("name", ["gru", "lstm"])
def test_gru_and_lstm_equal_pytorch(name):
    weights = load_file(str(TORCH / f"{name}.safetensors"))
    io = load_file(str(TORCH / f"{name}.io.safetensors"))
    n_in, d = io["x"].shape[-1], io["h0"].shape[-1]
    layer = with_weights(
        LAYERS[name](n_in, d, KEY),
        W_i=weights["weight_ih_l0"].T,
        W_h=weights["weight_hh_l0"].T,
        b_i=weights["bias_ih_l0"],
        b_h=weights["bias_hh_l0"],
    )
    np.testing.assert_allclose(jax.vmap(layer)(io["x"]), io["y"], atol=2e-6)
    start = HiddenState(io["h0"]) if name == "gru" else LSTMState(io["h0"], io["c0"])
    y, state = jax.vmap(lambda x, s: layer.prefill(x, s))(io["x"], start)
    np.testing.assert_allclose(y, io["y_from_state"], atol=2e-6)
    np.testing.assert_allclose(state.h, io["h_n_from_state"], atol=2e-6)
    if name == "lstm":
        np.testing.assert_allclose(state.c, io["c_n_from_state"], atol=2e-6)


# --- minGRU: parallel == sequential == float64 NumPy --------------------------------------------


def mingru_numpy(layer, x, h0):
    """minGRU by its definition (Feng et al. 2024, Eq. 1-3 of Section 3.1), in float64."""
    x = np.asarray(x, np.float64)
    names = ("W_z", "b_z", "W_h", "b_h")
    weights = {n: np.asarray(getattr(layer, n).value, np.float64) for n in names}
    z = 1.0 / (1.0 + np.exp(-(x @ weights["W_z"] + weights["b_z"])))
    candidate = x @ weights["W_h"] + weights["b_h"]
    h, out = np.asarray(h0, np.float64), []
    for t in range(len(x)):
        h = (1.0 - z[t]) * h + z[t] * candidate[t]
        out.append(h)
    return np.stack(out)


@pytest.mark.parametrize("length", [1, 2, 3, 17, 4096])
def test_mingru_parallel_scan_equals_its_step_loop_and_float64(length):
    layer = MinGRU(6, 16, KEY)
    x = 3.0 * jax.random.normal(jax.random.PRNGKey(length), (length, 6))
    h0 = jax.random.normal(jax.random.PRNGKey(3), (16,))
    parallel, state = jax.jit(final_state)(layer, x, HiddenState(h0))

    def tick(state, x_t):
        y, state = layer.step(x_t, state)
        return state, y

    sequential = jax.jit(lambda x: jax.lax.scan(tick, HiddenState(h0), x)[1])(x)
    reference = mingru_numpy(layer, x, h0)
    np.testing.assert_allclose(parallel, reference, atol=2e-5)
    np.testing.assert_allclose(sequential, reference, atol=2e-5)
    np.testing.assert_allclose(state.h, reference[-1], atol=2e-5)


def test_mingru_gradients_at_4096_steps_are_finite_and_match_the_step_loop():
    layer = MinGRU(6, 16, KEY)
    x = jax.random.normal(jax.random.PRNGKey(1), (4096, 6))
    mask = jnp.arange(4096) % 7 != 3

    def loss(layer, sequential):
        if sequential:
            h = jax.lax.scan(lambda s, x_t: layer.step(x_t, s)[::-1], layer.init_cache(), x)[1]
        else:
            h = layer(x)
        return jnp.mean(jnp.square(h - 0.5))

    parallel = jax.jit(jax.grad(loss), static_argnums=1)(layer, False)
    sequential = jax.jit(jax.grad(loss), static_argnums=1)(layer, True)
    masked = jax.jit(jax.grad(lambda m: jnp.sum(m(x, mask=mask))))(layer)
    for grads in (parallel, masked):
        assert all(bool(jnp.isfinite(g.value).all()) for g in grads.params())
    for a, b in zip(parallel.params(), sequential.params(), strict=True):
        np.testing.assert_allclose(a.value, b.value, rtol=1e-4, atol=1e-6)


# --- the streaming protocol, for every layer and mixed stacks -----------------------------------


@pytest.mark.parametrize("name", list(LAYERS))
def test_layer_step_equals_forward_and_prefill_equals_steps(name):
    layer = LAYERS[name](4, 6, KEY)
    x = jax.random.normal(jax.random.PRNGKey(1), (13, 4))
    expected = layer(x)
    ys, state = stream(layer, x, layer.init_cache())
    np.testing.assert_allclose(ys, expected, atol=1e-6)
    first, middle = layer.prefill(x[:5], layer.init_cache())
    rest, last = layer.prefill(x[5:], middle)
    np.testing.assert_allclose(jnp.concatenate([first, rest]), ys, atol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), last, state)
    empty, unchanged = layer.prefill(x[:0], middle)
    assert empty.shape == (0, 6)
    jax.tree.map(np.testing.assert_array_equal, unchanged, middle)


@pytest.mark.parametrize("name", list(LAYERS))
def test_masked_steps_leave_the_state_unchanged(name):
    layer = LAYERS[name](4, 6, KEY)
    x = jax.random.normal(jax.random.PRNGKey(1), (11, 4))
    mask = jnp.array([1, 1, 0, 1, 0, 0, 1, 1, 1, 0, 1], bool)
    start = jax.tree.map(lambda a: a + 0.25, layer.init_cache())
    y, state = final_state(layer, x, start, mask)
    y_valid, state_valid = final_state(layer, x[mask], start)
    np.testing.assert_allclose(y[mask], y_valid, atol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), state, state_valid)
    # A skipped step's row is the state it kept: the previous row (the start for step 0).
    np.testing.assert_allclose(y[2], y[1], atol=0)
    np.testing.assert_allclose(y[5], y[3], atol=0)
    _, nothing = final_state(layer, x, start, jnp.zeros(11, bool))
    jax.tree.map(np.testing.assert_array_equal, nothing, start)


def test_bfloat16_inputs_compute_in_bfloat16_with_a_float32_state():
    x = jax.random.normal(jax.random.PRNGKey(1), (9, 4))
    for layer in (GRU(4, 6, KEY), LSTM(4, 6, KEY), MinGRU(4, 6, KEY)):
        y, state = final_state(layer, x.astype(jnp.bfloat16))
        assert y.dtype == jnp.bfloat16
        assert all(a.dtype == jnp.float32 for a in jax.tree.leaves(state))
        np.testing.assert_allclose(y.astype(jnp.float32), layer(x), atol=3e-2)


STACKS = ["gru", "lstm", "mingru", ("mingru", "attention"), ("attention", "gru")]


def stack_model(mixers, **options):
    return transformer_encoder(
        3, 8, 2, 16, len(mixers) if isinstance(mixers, tuple) else 2, 4, KEY, 10,
        causal=True, mixers=mixers, **options,
    )  # fmt: skip


@pytest.mark.parametrize("mixers", STACKS, ids=str)
def test_mixed_stack_streams_prefills_and_masks_like_its_forward(mixers):
    model = stack_model(mixers)
    x = jax.random.normal(jax.random.PRNGKey(1), (10, 3))
    on_prefixes = prefix_outputs(model, x)  # padded forward == unpadded, at two prefixes
    ys, _ = stream(model, x, model.init_cache(10, on_overflow="nan"), eqx.filter_jit(model.step))
    np.testing.assert_allclose(ys, on_prefixes, atol=2e-5)
    prefill = eqx.filter_jit(model.prefill)
    first, middle = prefill(x[:4], model.init_cache(10, on_overflow="nan"))
    rest, _ = prefill(x[4:], middle)
    np.testing.assert_allclose(jnp.concatenate([first, rest]), ys, atol=2e-5)
    growing, _ = model.prefill(x, model.init_cache())  # the growing attention cache
    np.testing.assert_allclose(growing, ys, atol=2e-5)


def test_a_batch_of_mixed_streams_resets_one_stream():
    model = stack_model(("mingru", "attention"))
    x = jax.random.normal(jax.random.PRNGKey(1), (2, 8, 3))
    caches = batch_streams(model.init_cache(8, on_overflow="nan"), 2)
    step = jax.jit(jax.vmap(model.step))
    for t in range(3):
        _, caches = step(x[:, t], caches)
    caches = reset(caches, jnp.array([False, True]))
    outputs = []
    for t in range(3, 8):
        y, caches = step(x[:, t], caches)
        outputs.append(y)
    np.testing.assert_allclose(outputs[-1][0], model(x[0]), atol=2e-5)
    np.testing.assert_allclose(outputs[-1][1], model(x[1, 3:]), atol=2e-5)


def test_a_recurrent_stack_without_positions_streams_past_max_len_in_constant_memory():
    model = transformer_encoder(3, 8, 2, 16, 2, 4, KEY, 4, mixers="mingru", positions="none")
    x = jax.random.normal(jax.random.PRNGKey(1), (30, 3))
    cache = model.init_cache(4, on_overflow="nan")
    size = sum(a.size for a in jax.tree.leaves(cache))
    ys, cache = stream(model, x, cache, eqx.filter_jit(model.step))
    assert sum(a.size for a in jax.tree.leaves(cache)) == size
    np.testing.assert_allclose(ys[-1], model.prefill(x, model.init_cache())[0][-1], atol=2e-5)


def test_recurrent_blocks_have_the_blocks_parameters_and_scan_as_a_stack():
    block = RecurrentBlock(8, 16, KEY, "lstm", gate=True, norm_first=True)
    assert [p.value.shape for p in block.params()[:4]] == [(8, 32), (8, 32), (32,), (32,)]
    assert len(RecurrentBlock(8, 16, KEY).params()) == 12 and len(block.params()) == 18
    unrolled = stack_model("mingru")
    scanned = stack_model("mingru", scan_layers=True)
    x = jax.random.normal(jax.random.PRNGKey(1), (10, 3))
    np.testing.assert_allclose(scanned(x), unrolled(x), atol=1e-6)
    ys, _ = stream(scanned, x, scanned.init_cache(10, on_overflow="nan"))
    np.testing.assert_allclose(ys[-1], unrolled(x), atol=2e-5)


def test_remat_and_dropout_reach_the_recurrent_blocks():
    x = jax.random.normal(jax.random.PRNGKey(1), (10, 3))
    gradient = eqx.filter_jit(jax.grad(lambda m: jnp.sum(m(x))))
    expected = gradient(stack_model(("gru", "attention")))
    for remat in ("block", "attention"):
        grads = gradient(stack_model(("gru", "attention"), remat=remat))
        for a, b in zip(grads.params(), expected.params(), strict=True):
            np.testing.assert_allclose(a.value, b.value, atol=1e-5)
    dropping = stack_model("gru", dropout=0.5)
    assert not np.allclose(dropping(x, key=KEY), dropping(x))


# --- checkpoints and export ---------------------------------------------------------------------

MIXED = ModelConfig(
    "transformer_encoder",
    {"n_in": 3, "d_model": 8, "n_heads": 2, "d_ff": 16, "depth": 3, "n_out": 4, "max_len": 8,
     "causal": True, "mixers": ["mingru", "attention", "lstm"]},
)  # fmt: skip


def test_a_mixed_stack_checkpoints(tmp_path):
    model = MIXED.build(jax.random.PRNGKey(3))
    save_checkpoint(tmp_path / "c", model, MIXED)
    loaded = load_checkpoint(tmp_path / "c")
    x = jax.random.normal(jax.random.PRNGKey(1), (8, 3))
    np.testing.assert_array_equal(loaded.model(x), model(x))
    assert loaded.config.arguments["mixers"] == ["mingru", "attention", "lstm"]


def test_export_of_a_mixed_stack_matches_its_python_model(tmp_path):
    model = MIXED.build(jax.random.PRNGKey(3))
    export_model(model, MIXED, tmp_path / "art", capacity=8, platforms=["cpu"], static_shapes=[])
    artifact = load(tmp_path / "art")
    layout = artifact.manifest["streaming"]["layout"]
    assert {"HiddenState", "LSTMState", "FixedKVCache"} <= {h for e in layout for h in e["holders"]}
    assert max(check_golden(artifact).values()) < 1e-5
    x = jax.random.normal(jax.random.PRNGKey(5), (2, 8, 3))
    expected = jax.vmap(model)(x)
    np.testing.assert_allclose(artifact.forward(x), expected, atol=1e-5)
    cache = artifact.init_cache(2)
    cache = artifact.prefill(x[:, :3], cache)[1]
    for t in range(3, 8):
        y_t, cache, overflow = artifact.step(x[:, t], cache)
        assert not bool(overflow.any())
    np.testing.assert_allclose(y_t, expected, atol=1e-5)


def test_a_huge_capacity_exports_with_a_bounded_golden_stream(tmp_path):
    """A recurrent state does not grow with the capacity, so a capacity of a million slots is a
    fair export; its golden stream, stepped in Python one step at a time, stops at
    GOLDEN_STEPS and still checks init_cache, prefill, step and reset."""
    config = ModelConfig(
        "transformer_encoder",
        {**MIXED.arguments, "depth": 1, "mixers": "gru", "positions": "none"},
    )
    model = config.build(jax.random.PRNGKey(3))
    export_model(model, config, tmp_path / "art", capacity=10**6, platforms=["cpu"],
                 static_shapes=[])  # fmt: skip
    artifact = load(tmp_path / "art")
    assert artifact.manifest["streaming"]["capacity"] == 10**6
    stream = artifact.manifest["golden"]["stream"]
    assert stream["steps"] == GOLDEN_STEPS and stream["prefill"] < stream["reset_at"] < 10**6
    errors = check_golden(artifact)
    assert {"init_cache", f"reset at step {stream['reset_at']}"} <= set(errors)
    assert max(errors.values()) < 1e-5


def test_checkpoints_convert_between_scanned_and_unrolled_recurrent_blocks(tmp_path):
    config = ModelConfig("transformer_encoder", {**MIXED.arguments, "mixers": "gru"})
    model = config.build(jax.random.PRNGKey(3))
    save_checkpoint(tmp_path / "c", model, config)
    scanned = load_checkpoint(tmp_path / "c", scan_layers=True).model
    assert sum(type(layer).__name__ == "Stack" for layer in scanned.layers) == 1
    x = jax.random.normal(jax.random.PRNGKey(1), (8, 3))
    np.testing.assert_allclose(scanned(x), model(x), atol=1e-6)
    unrolled = load_checkpoint(tmp_path / "c", scan_layers=False).model
    np.testing.assert_array_equal(unrolled(x), model(x))
    # A mixed stack's blocks are not copies of one block: scanned, it cannot be built.
    save_checkpoint(tmp_path / "m", MIXED.build(jax.random.PRNGKey(3)), MIXED)
    with pytest.raises(CheckpointError, match="`scan_layers=True` stacks copies of one block"):
        load_checkpoint(tmp_path / "m", scan_layers=True)


@pytest.mark.parametrize("name", list(LAYERS))
def test_nan_in_a_padded_step_never_reaches_the_state_or_the_valid_rows(name):
    layer = LAYERS[name](4, 6, KEY)
    x = jax.random.normal(jax.random.PRNGKey(1), (6, 4)).at[2].set(jnp.nan).at[5].set(jnp.inf)
    mask = jnp.array([1, 1, 0, 1, 1, 0], bool)
    y, state = final_state(layer, x, mask=mask)
    assert bool(jnp.isfinite(y[mask]).all())
    assert all(bool(jnp.isfinite(a).all()) for a in jax.tree.leaves(state))
    y_valid, _ = final_state(layer, x[mask])
    np.testing.assert_allclose(y[mask], y_valid, atol=1e-6)
