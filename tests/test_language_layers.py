"""The layers of a token language model and the sampling rules, against float64 NumPy written
from the papers' and transformers' formulas, hand-made logits and a chi-square test."""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dense_armor.nn.core import ShapeError
from dense_armor.nn.kernels.choice import exporting
from dense_armor.nn.layers.basic import FeedForward
from dense_armor.nn.layers.language import (
    Embedding,
    GatedFeedForward,
    LMHead,
    RMSNorm,
    TokenIdError,
    ids_checked,
)
from dense_armor.nn.sampling import (
    draw_rows,
    draw_tokens,
    filter_logits,
    filter_rows,
    greedy,
    sample,
)

KEY = jax.random.PRNGKey(0)


def f64(a):
    return np.asarray(a, np.float64)


def silu(x):
    return x / (1.0 + np.exp(-x))


def gelu_tanh(x):  # GPT-2's gelu_new
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def gelu_erf(x):
    return 0.5 * x * (1.0 + np.vectorize(math.erf)(x / math.sqrt(2.0)))


# Embedding and the heads


def test_embedding_gives_the_rows_of_its_ids_on_any_batch_shape():
    emb = Embedding(11, 4, KEY)
    ids = np.array([[0, 10, 3], [3, 3, 7]])
    np.testing.assert_array_equal(
        np.asarray(emb(jnp.asarray(ids))), np.asarray(emb.table.value)[ids]
    )
    assert emb.params() == [emb.table]
    assert emb.table.value.shape == (11, 4)
    assert 0.015 < float(jnp.std(Embedding(1000, 16, KEY).table.value)) < 0.025  # std 0.02


def test_embedding_steps_one_id_as_its_forward_row():
    emb = Embedding(11, 4, KEY)
    y, cache = emb.step(jnp.array(7), emb.init_cache())
    assert cache is None
    np.testing.assert_array_equal(np.asarray(y), np.asarray(emb.table.value)[7])


@pytest.mark.parametrize("bad", [11, -1, 1000])
def test_an_id_outside_the_vocabulary_is_refused_eagerly_naming_it(bad):
    emb = Embedding(11, 4, KEY)
    with pytest.raises(
        TokenIdError, match=rf"token id {bad} at position \(1, 0\) is outside .*\[0, 11\)"
    ):
        emb(jnp.array([[1, 2], [bad, 3]]))


def test_an_id_outside_the_vocabulary_is_refused_under_filter_jit():
    emb = Embedding(11, 4, KEY)
    forward = eqx.filter_jit(lambda m, ids: m(ids))
    forward(emb, jnp.array([1, 2]))  # compiles, and runs
    with pytest.raises(Exception, match=r"token id is outside \[0, 11\)"):
        jax.block_until_ready(forward(emb, jnp.array([1, 11])))


def test_with_on_invalid_nan_an_outside_id_is_a_nan_row_and_a_false_flag():
    emb = Embedding(11, 4, KEY, on_invalid="nan")
    ids = jnp.array([1, 11, -3, 10])
    rows = np.asarray(jax.jit(lambda i: emb(i))(ids))
    assert np.isnan(rows[1]).all() and np.isnan(rows[2]).all()
    np.testing.assert_array_equal(rows[[0, 3]], np.asarray(emb.table.value)[[1, 10]])
    np.testing.assert_array_equal(np.asarray(emb.in_range(ids)), [True, False, False, True])


def test_a_caller_that_checked_its_ids_traces_no_callback_and_gets_nan_rows():
    """Inside `ids_checked()` (and the export stage's `exporting()`), a traced `"raise"`
    embedding has no callback to Python (which JAX's persistent cache would never keep) and gives
    NaN rows for outside ids; outside them it has the callback; eager calls raise in both."""
    emb = Embedding(11, 4, KEY)
    ids = jnp.array([1, 11])
    assert "callback" in str(jax.make_jaxpr(emb)(ids))
    for context in (ids_checked, exporting):
        with context():
            assert "callback" not in str(jax.make_jaxpr(emb)(ids))
            rows = np.asarray(jax.jit(lambda i: emb(i))(ids))
            with pytest.raises(TokenIdError):
                emb(ids)
        assert np.isnan(rows[1]).all()
        np.testing.assert_array_equal(rows[0], np.asarray(emb.table.value)[1])


def test_float_ids_are_refused():
    with pytest.raises(ShapeError, match=r"ids.*expected Int"):
        Embedding(11, 4, KEY)(jnp.array([1.0, 2.0]))


def test_the_tied_head_is_the_table_transposed_and_its_gradient_is_the_sum_of_both_uses():
    emb = Embedding(7, 4, KEY)
    h = jax.random.normal(jax.random.PRNGKey(1), (3, 4))
    table = f64(emb.table.value)
    np.testing.assert_allclose(np.asarray(emb.attend(h)), f64(h) @ table.T, rtol=1e-5, atol=1e-6)

    ids = jnp.array([2, 5, 2])

    def tied(e):
        return jnp.sum(jnp.sin(e.attend(jnp.tanh(e(ids)))))

    def untied(t_in, t_out):  # the same computation with the two uses given separate arrays
        return jnp.sum(jnp.sin(jnp.tanh(t_in[ids]) @ t_out.T))

    grad = eqx.filter_grad(tied)(emb).table.value
    g_in, g_out = jax.grad(untied, argnums=(0, 1))(emb.table.value, emb.table.value)
    np.testing.assert_allclose(np.asarray(grad), np.asarray(g_in + g_out), rtol=1e-5, atol=1e-7)
    assert float(jnp.abs(g_in).sum()) > 0 and float(jnp.abs(g_out).sum()) > 0


def test_the_untied_head_is_a_product_without_bias():
    head = LMHead(4, 9, KEY)
    h = jax.random.normal(jax.random.PRNGKey(2), (5, 4))
    np.testing.assert_allclose(
        np.asarray(head(h)), f64(h) @ f64(head.W.value), rtol=1e-5, atol=1e-6
    )
    assert head.params() == [head.W] and head.W.value.shape == (4, 9)


# RMSNorm and the feed-forwards


def test_rms_norm_is_llamas_formula():
    norm = RMSNorm(6, eps=1e-6)
    norm = eqx.tree_at(lambda m: m.gain.value, norm, jnp.arange(1.0, 7.0))
    x = jax.random.normal(jax.random.PRNGKey(3), (4, 6)) * 3.0
    xs = f64(x)
    want = xs / np.sqrt((xs**2).mean(-1, keepdims=True) + 1e-6) * np.arange(1.0, 7.0)
    np.testing.assert_allclose(np.asarray(norm(x)), want, rtol=1e-5, atol=1e-6)
    assert norm(x.astype(jnp.bfloat16)).dtype == jnp.bfloat16
    assert norm.params() == [norm.gain]


@pytest.mark.parametrize(
    "activation, act", [("silu", silu), ("gelu_tanh", gelu_tanh), ("gelu", gelu_erf)]
)
def test_the_gated_feed_forward_is_shazeers_glu(activation, act):
    ff = GatedFeedForward(4, 10, KEY, activation)
    x = jax.random.normal(jax.random.PRNGKey(4), (3, 4))
    g, u, d = (f64(p.value) for p in ff.params())
    want = (act(f64(x) @ g) * (f64(x) @ u)) @ d
    np.testing.assert_allclose(np.asarray(ff(x)), want, rtol=1e-4, atol=1e-7)
    assert [p.value.shape for p in ff.params()] == [(4, 10), (4, 10), (10, 4)]


def test_the_feed_forward_takes_gpt2s_tanh_gelu():
    ff = FeedForward(4, 8, KEY, activation="gelu_tanh")
    x = jax.random.normal(jax.random.PRNGKey(5), (3, 4))
    w1, b1, w2, b2 = (f64(p.value) for p in ff.params())
    want = gelu_tanh(f64(x) @ w1 + b1) @ w2 + b2
    np.testing.assert_allclose(np.asarray(ff(x)), want, rtol=1e-5, atol=1e-6)


# Sampling

PROBS = np.array([0.5, 0.2, 0.15, 0.1, 0.05])
LOGITS = jnp.asarray(np.log(PROBS), jnp.float32)


def kept(**rules):
    return np.isfinite(np.asarray(filter_logits(LOGITS, **rules)))


@pytest.mark.parametrize(
    "rules, keep",
    [
        ({"top_k": 2}, [1, 1, 0, 0, 0]),
        ({"top_k": 5}, [1, 1, 1, 1, 1]),
        ({"top_k": 50}, [1, 1, 1, 1, 1]),
        # mass before each token: 0, .5, .7, .85, .95
        ({"top_p": 0.75}, [1, 1, 1, 0, 0]),
        ({"top_p": 0.4}, [1, 0, 0, 0, 0]),
        ({"top_p": 0.9}, [1, 1, 1, 1, 0]),
        ({"top_p": 1.0}, [1, 1, 1, 1, 1]),
        # the floor is min_p * 0.5
        ({"min_p": 0.25}, [1, 1, 1, 0, 0]),
        ({"min_p": 0.5}, [1, 0, 0, 0, 0]),
        ({"min_p": 0.0}, [1, 1, 1, 1, 1]),
        ({"min_p": 1.0}, [1, 0, 0, 0, 0]),
        # in order: top-k 4 leaves .5 .2 .15 .1 (mass .95); top-p .8 of those keeps three
        ({"top_k": 4, "top_p": 0.8}, [1, 1, 1, 0, 0]),
    ],
)
def test_each_rule_keeps_exactly_the_tokens_it_should(rules, keep):
    np.testing.assert_array_equal(kept(**rules), np.array(keep, bool))


RULES_TABLE = [  # each rule and what it keeps (above), as rows of one batch
    ({"top_k": 2}, [1, 1, 0, 0, 0]), ({"top_p": 0.75}, [1, 1, 1, 0, 0]),
    ({"min_p": 0.25}, [1, 1, 1, 0, 0]), ({}, [1, 1, 1, 1, 1]),
    ({"top_k": 4, "top_p": 0.8}, [1, 1, 1, 0, 0]), ({"top_p": 0.4, "min_p": 0.1}, [1, 0, 0, 0, 0]),
]  # fmt: skip


def _rows(rules_list, temperature=1.0):
    """Per-row settings arrays (off: top-k 0, top-p 1, min-p 0)."""

    def column(name, off, dtype):
        return jnp.asarray([r.get(name, off) for r in rules_list], dtype)

    t = jnp.asarray([r.get("temperature", temperature) for r in rules_list], jnp.float32)
    return (t, column("top_k", 0, jnp.int32), column("top_p", 1.0, jnp.float32),
            column("min_p", 0.0, jnp.float32))  # fmt: skip


def test_each_row_keeps_what_its_own_rules_keep_in_one_batch():
    rules = [r for r, _ in RULES_TABLE]
    batch = jnp.tile(LOGITS, (len(rules), 1))
    got = np.isfinite(np.asarray(jax.jit(filter_rows)(batch, *_rows(rules))))
    np.testing.assert_array_equal(got, np.array([k for _, k in RULES_TABLE], bool))


def test_per_row_rules_are_filter_logits_and_draw_tokens_bit_for_bit():
    logits = jax.random.normal(jax.random.PRNGKey(3), (8, 300)) * 3
    rules = [{"temperature": 0.0}, {}, {"temperature": 0.7, "top_k": 5},
             {"temperature": 1.3, "top_p": 0.9}, {"temperature": 0.9, "top_k": 10, "top_p": 0.8,
             "min_p": 0.05}, {"temperature": 2.0, "min_p": 0.1}, {"top_k": 1},
             {"temperature": 0.5, "top_k": 400, "top_p": 0.5}]  # fmt: skip
    rows = _rows(rules)
    got = jax.jit(filter_rows)(logits, *rows)
    for b, rule in enumerate(rules):
        want = filter_logits(logits[b : b + 1], **rule)[0]
        np.testing.assert_array_equal(np.asarray(got[b]), np.asarray(want), err_msg=str(rule))
    numbers, positions = jnp.arange(8), jnp.arange(8) * 5 + 3
    keys = jax.vmap(lambda n: jax.random.fold_in(KEY, n))(numbers)
    for rule in rules:  # one rule for all: draw_tokens with the server's key
        same = _rows([rule] * 8)
        want = draw_tokens(logits, KEY, numbers, positions, **{"temperature": 1.0, **rule})
        np.testing.assert_array_equal(draw_rows(logits, keys, positions, *same), want)


def test_temperature_divides_the_logits():
    np.testing.assert_allclose(
        np.asarray(filter_logits(LOGITS, temperature=0.5)), np.log(PROBS) / 0.5, rtol=1e-6
    )


def test_temperature_zero_and_top_k_one_are_greedy():
    logits = jax.random.normal(jax.random.PRNGKey(6), (64, 50))
    want = np.argmax(np.asarray(logits), axis=-1)
    np.testing.assert_array_equal(np.asarray(greedy(logits)), want)
    for i in range(3):
        key = jax.random.PRNGKey(10 + i)
        np.testing.assert_array_equal(np.asarray(sample(logits, key, temperature=0)), want)
        np.testing.assert_array_equal(np.asarray(sample(logits, key, top_k=1)), want)
    assert sample(logits, KEY).shape == (64,) and sample(logits, KEY).dtype == jnp.int32


def test_the_same_key_gives_the_same_tokens_and_another_key_others():
    logits = jnp.zeros((256, 10))
    a, b = sample(logits, KEY), sample(logits, KEY)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert np.any(np.asarray(a) != np.asarray(sample(logits, jax.random.PRNGKey(1))))


# chi-square critical value for 2 degrees of freedom at p = 0.001 (statistical tables): 13.816
CHI2_2_DOF_P001 = 13.816


def test_draws_follow_the_truncated_softmax():
    logits = np.array([2.0, 1.0, 0.5, -1.0, 0.0])
    n = 20000
    draws = jax.jit(
        lambda k: sample(jnp.broadcast_to(jnp.asarray(logits, jnp.float32), (n, 5)), k,
                         temperature=0.7, top_k=3)
    )(jax.random.PRNGKey(42))  # fmt: skip
    counts = np.bincount(np.asarray(draws), minlength=5)
    scaled = np.exp(logits / 0.7)
    top = [0, 1, 2]  # the three largest logits
    expected = n * scaled[top] / scaled[top].sum()
    assert counts[3] == counts[4] == 0
    chi2 = float(((counts[top] - expected) ** 2 / expected).sum())
    assert chi2 < CHI2_2_DOF_P001, (counts, expected, chi2)
