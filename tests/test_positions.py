import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dense_armor.utility.neural import (
    AddPositions,
    LearnedPositions,
    ShapeError,
    sinusoidal_encoding,
    sinusoidal_positions,
)
from reference import sinusoid


def test_sinusoidal_row_one_by_hand():
    p = sinusoidal_positions(4, 4)
    assert p.shape == (4, 4)
    expected = [math.sin(1), math.cos(1), math.sin(0.01), math.cos(0.01)]
    np.testing.assert_allclose(p[1], expected, atol=1e-6)
    np.testing.assert_array_equal(p[0], [0.0, 1.0, 0.0, 1.0])


@pytest.mark.parametrize("length, d_model", [(50, 16), (7, 5), (1, 1)])
def test_sinusoidal_matches_the_paper_formula(length, d_model):
    np.testing.assert_allclose(
        sinusoidal_positions(length, d_model), sinusoid(length, d_model), atol=2e-5
    )


def test_sinusoidal_encoding_of_one_position_is_the_table_row():
    table = sinusoidal_positions(64, 12)
    for pos in (0, 5, 63):
        np.testing.assert_array_equal(sinusoidal_encoding(jnp.asarray(pos), 12), table[pos])


def test_sinusoidal_rejects_bad_sizes():
    with pytest.raises(ValueError, match="length"):
        sinusoidal_positions(-1, 4)
    with pytest.raises(ValueError, match="d_model"):
        sinusoidal_positions(4, 0)


def test_add_positions_adds_the_table(getkey):
    x = jax.random.normal(getkey(), (5, 6))
    np.testing.assert_allclose(AddPositions(8)(x), np.asarray(x) + sinusoid(5, 6), atol=1e-5)
    assert AddPositions(8).params() == []


def test_learned_positions(getkey):
    m = LearnedPositions(4, 3, getkey())
    assert m.P.value.shape == (4, 3)
    assert m.params() == [m.P]
    z = m.forward(jnp.zeros((2, 3)))
    np.testing.assert_array_equal(z, m.P.value[:2])
    big = LearnedPositions(1000, 64, getkey())
    assert 0.018 < float(big.P.value.std()) < 0.022
    with pytest.raises(ShapeError, match=r"x.shape=\(2, 5\).*d_model=3"):
        m.forward(jnp.zeros((2, 5)))


@pytest.mark.parametrize("layer", ["add", "learned"])
def test_sequence_longer_than_max_len_raises(getkey, layer):
    m = AddPositions(4) if layer == "add" else LearnedPositions(4, 3, getkey())
    m.forward(jnp.zeros((4, 3)))
    with pytest.raises(ShapeError, match=r"T=5.*max_len=4"):
        m.forward(jnp.zeros((5, 3)))
