"""Which array goes where on a mesh, planned on abstract meshes (no devices needed): tensor
parallelism as Megatron-LM splits a Transformer layer (Shoeybi et al. 2019, section 3: the query,
key and value projections and the feed-forward's first matrix by output columns, so each device
holds whole heads or units; the output projection and the second matrix by rows), FSDP on the data
axis, and what cannot be split. Training on real meshes is in test_distributed.py."""

import warnings

import jax
import pytest
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

from dense_armor.distributed import ShardingWarning, partition_specs
from dense_armor.utility.neural import transformer_decoder, transformer_encoder

KEY = jax.random.PRNGKey(0)
TWO_BY_TWO = AbstractMesh((2, 2), ("data", "model"))


def specs_by_path(model, mesh, shard_params=False):
    specs = partition_specs(model, mesh, shard_params)
    flat = jax.tree_util.tree_flatten_with_path(specs, is_leaf=lambda x: isinstance(x, P))[0]
    return {jax.tree_util.keystr(path): spec for path, spec in flat if spec is not None}


def encoder(**options):
    return transformer_encoder(3, 16, 4, 32, 2, 2, KEY, 8, **options)


COLUMNS, ROWS = P(None, "model"), P("model")


def test_heads_and_units_split_as_megatron_does():
    specs = specs_by_path(encoder(), TWO_BY_TWO)
    for block in (2, 3):
        attention, ff = f".layers[{block}].attention", f".layers[{block}].feed_forward"
        for name in ("W_Q", "W_K", "W_V"):
            assert specs[f"{attention}.{name}.value"] == COLUMNS
        assert specs[f"{attention}.W_O.value"] == ROWS
        assert specs[f"{ff}.hidden.W.value"] == COLUMNS
        assert specs[f"{ff}.hidden.b.value"] == P("model")
        assert specs[f"{ff}.out.W.value"] == ROWS
        assert specs[f"{ff}.out.b.value"] == P()  # added once, after the partial sums
        assert specs[f".layers[{block}].norm1.gain.value"] == P()
    split = {path for path, spec in specs.items() if spec != P()}
    assert len(split) == 2 * 7  # nothing else is split: embedding, norms, head stay whole
    assert specs[".layers[0].W.value"] == P()


def test_a_data_mesh_splits_nothing_without_fsdp():
    mesh = AbstractMesh((4,), ("data",))
    assert set(specs_by_path(encoder(), mesh).values()) == {P()}


def test_a_stacked_model_keeps_its_depth_axis_whole():
    specs = specs_by_path(encoder(scan_layers=True), TWO_BY_TWO)
    assert specs[".layers[2].stacked.attention.W_Q.value"] == P(None, None, "model")
    assert specs[".layers[2].stacked.attention.W_O.value"] == P(None, "model")


def test_biases_of_the_projections_follow_their_columns():
    specs = specs_by_path(encoder(use_bias=True), TWO_BY_TWO)
    assert specs[".layers[2].attention.b_Q.value"] == P("model")
    assert specs[".layers[2].attention.b_V.value"] == P("model")
    assert specs[".layers[2].attention.b_O.value"] == P()


def test_grouped_query_heads_split_by_key_value_group():
    specs = specs_by_path(encoder(n_kv_heads=2), TWO_BY_TWO)
    assert specs[".layers[2].attention.W_K.value"] == COLUMNS  # (16, 8): 2 heads, 1 per device
    with pytest.raises(ValueError, match=r"attention.W_K \(MultiHeadSelfAttention, 2 n_kv_heads\)"):
        partition_specs(encoder(n_kv_heads=2), AbstractMesh((1, 4), ("data", "model")))


def test_a_decoder_splits_its_cross_attention_too():
    model = transformer_decoder(3, 16, 2, 32, 1, 5, KEY, 8, d_context=6)
    specs = specs_by_path(model, TWO_BY_TWO)
    cross = [p for p in specs if ".cross_attention.W_K" in p]
    assert cross and specs[cross[0]] == COLUMNS  # (d_context 6, 16): the heads are the columns


def test_fsdp_takes_the_first_free_axis_and_both_axes_for_split_vectors():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        specs = specs_by_path(encoder(), TWO_BY_TWO, shard_params=True)
    assert specs[".layers[2].attention.W_Q.value"] == P("data", "model")
    assert specs[".layers[2].attention.W_O.value"] == P("model", "data")
    assert specs[".layers[2].feed_forward.hidden.b.value"] == P(("model", "data"))
    assert specs[".layers[0].W.value"] == P(None, "data")  # (3, 16): 3 is not divisible by 2
    assert [w.category for w in caught] == []  # every array here has an axis 2 divides


def test_what_fsdp_cannot_split_is_named_in_a_warning():
    mesh = AbstractMesh((4,), ("data",))
    model = transformer_encoder(3, 16, 2, 32, 1, 3, KEY, 8)  # head (16, 3) and bias (3,)
    with pytest.warns(
        ShardingWarning, match=r"1 arrays .* 4 `\"data\"` devices .*\.b\.value \(3,\)"
    ):
        specs = specs_by_path(model, mesh, shard_params=True)
    assert specs[".layers[4].b.value"] == P()
    assert specs[".layers[4].W.value"] == P("data")  # (16, 3): its first axis


def test_heads_that_the_model_axis_cannot_split_are_an_error():
    with pytest.raises(ValueError, match=r"4 n_heads\) cannot be split over 8 .*divides 4"):
        partition_specs(encoder(), AbstractMesh((1, 8), ("data", "model")))
