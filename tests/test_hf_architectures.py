"""The checkpoints' architectures beyond GPT-2, Llama and Qwen2, and writing models back: that the
golden data exercise each option (without it the logits are not transformers'), and that
`export_hf` writes each architecture's directory as transformers wrote it (the same tensors, bit
for bit, and a config that imports to the same model). transformers' own loading of the written
directories is `tests/torch_reference/check_hf_export.py` (not a test: it needs torch)."""

import glob
import json
import pathlib
import shutil

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from dense_armor.cli import main as cli
from dense_armor.huggingface import (
    ARCHITECTURES,
    WRAPPERS,
    HuggingFaceError,
    export_hf,
    import_hf,
)
from dense_armor.nn.layers.experts import MixtureOfExperts, balance_loss
from dense_armor.nn.layers.language import ids_checked
from dense_armor.nn.models.language_model import TransformerLM
from dense_armor.nn.models.stack import scanned
from dense_armor.training import next_token_loss_balanced
from test_language_models import batch_of_prompts

DATA = pathlib.Path(__file__).parent / "data" / "hf"
EVERY = sorted(p.name for p in DATA.iterdir() if p.is_dir())
# the text models' cases; a multimodal wrapper's (read as its text model) has tests of its own
CASES = [
    name
    for name in EVERY
    if not name.endswith("_hub")  # the hub's older config form: tests/test_hf_configs.py
    and json.loads((DATA / name / "config.json").read_text())["architectures"][0] in ARCHITECTURES
]
FORWARD = eqx.filter_jit(lambda m, ids: jax.vmap(m)(ids))


def config_of(name):
    return json.loads((DATA / name / "config.json").read_text())


def logits_of(model, ids):
    with ids_checked():
        return np.asarray(FORWARD(model, jnp.asarray(ids)))


def test_every_case_is_an_architecture_the_importer_lists():
    found = {config_of(name)["architectures"][0] for name in EVERY}
    assert found == set(ARCHITECTURES) | set(WRAPPERS)


def without(**changes):
    def change(config):
        config.update(changes)

    return change


def drop_rope_scaling(config):
    config["rope_parameters"] = {
        "rope_type": "default",
        "rope_theta": config["rope_parameters"]["rope_theta"],
    }


def swap_rope_bases(config):
    rope = config["rope_parameters"]
    full, sliding = rope["full_attention"]["rope_theta"], rope["sliding_attention"]["rope_theta"]
    rope["full_attention"]["rope_theta"], rope["sliding_attention"]["rope_theta"] = sliding, full


# Each option of a case, undone in its config: the logits move away from transformers' by more
# than 0.01, so the agreement within 1e-5 (test_language_models.py) holds because the option is
# built, not because the data leave it idle.
MATTERS = [
    ("llama3-scaling", "llama32", drop_rope_scaling),
    ("yarn-scaling", "qwen2_yarn", drop_rope_scaling),
    ("window", "mistral", without(sliding_window=None)),
    ("partial-rotary", "phi3", lambda c: c["rope_parameters"].update(partial_rotary_factor=1.0)),
    ("longrope-short-factors", "phi4_mini",
     lambda c: c["rope_parameters"].update(short_factor=[1.0, 1.0, 1.0])),
    ("longrope-attention-factor", "phi4_mini", without(max_position_embeddings=48)),
    ("attention-softcap", "gemma2", without(attn_logit_softcapping=None)),
    ("final-softcap", "gemma2", without(final_logit_softcapping=None)),
    ("query-scale", "gemma2", without(query_pre_attn_scalar=16)),
    ("sliding-layers", "gemma2", without(layer_types=["full_attention"] * 4)),
    ("per-kind-rope", "gemma3", swap_rope_bases),
    ("window-of-two-in-three", "gemma3", without(sliding_window=64)),
    ("starcoder-window", "starcoder2", without(sliding_window=None)),
    ("renormalised-top-k", "qwen3_moe", without(norm_topk_prob=True)),
    ("top-k", "mixtral", without(num_experts_per_tok=1)),
    ("hybrid-top-k", "qwen3_5_moe", without(num_experts_per_tok=1)),
]  # fmt: skip


@pytest.mark.parametrize("name, change", [pytest.param(*r[1:], id=r[0]) for r in MATTERS])
def test_each_option_changes_the_logits_that_match_transformers(tmp_path, name, change):
    target = tmp_path / name
    shutil.copytree(DATA / name, target)
    config = config_of(name)
    change(config)
    (target / "config.json").write_text(json.dumps(config))
    golden = load_file(str(DATA / f"{name}.io.safetensors"))
    model, _ = import_hf(target)
    assert np.abs(logits_of(model, golden["ids"]) - golden["logits"]).max() > 1e-2


def stored_tensors(directory):
    tensors = {}
    for path in glob.glob(str(directory / "*.safetensors")):
        tensors.update(load_file(path))
    return tensors


@pytest.mark.parametrize("name", CASES)
def test_export_hf_writes_the_directory_transformers_wrote(tmp_path, name):
    model, arguments = import_hf(DATA / name)
    source = config_of(name)
    written = export_hf(
        model, arguments, tmp_path / name, architecture=source["architectures"][0], source=source
    )
    want, got = stored_tensors(DATA / name), stored_tensors(written)
    assert sorted(got) == sorted(want)
    for tensor in want:  # bit for bit, in transformers' names and layouts
        np.testing.assert_array_equal(got[tensor], want[tensor], err_msg=tensor)
    _, arguments_again = import_hf(written)
    assert arguments_again == arguments
    config = json.loads((written / "config.json").read_text())
    for key in ("bos_token_id", "eos_token_id", "pad_token_id", "vocab_size", "hidden_size"):
        assert config.get(key) == source.get(key), key
    # keys a config class defaults when absent, written (Phi-3's pretrained length: 4096)
    longrope = (source.get("rope_parameters") or {}).get("rope_type") == "longrope"
    for key in ("sliding_window", "head_dim", *["original_max_position_embeddings"] * longrope):
        if source.get(key) is not None:
            assert config.get(key) == source[key], key


def test_a_scanned_model_writes_the_same_tensors_as_its_unrolled_self(tmp_path):
    model, arguments = import_hf(DATA / "gemma3")  # two sliding layers to one global, 4 in all
    stacked = eqx.tree_at(lambda m: m.blocks, model, scanned(model.blocks))
    assert not isinstance(stacked.blocks[0], type(model.blocks[0]))  # a Stack of groups
    a = export_hf(model, arguments, tmp_path / "a", architecture="Gemma3ForCausalLM")
    b = export_hf(
        stacked,
        {**arguments, "scan_layers": True},
        tmp_path / "b",
        architecture="Gemma3ForCausalLM",
    )
    want, got = stored_tensors(a), stored_tensors(b)
    assert sorted(got) == sorted(want)
    for tensor in want:
        np.testing.assert_array_equal(got[tensor], want[tensor], err_msg=tensor)


def test_a_model_built_here_goes_out_as_llama_and_comes_back_the_same(tmp_path):
    arguments = dict(
        vocab=40,
        d_model=16,
        n_heads=4,
        d_ff=24,
        depth=2,
        max_len=32,
        n_kv_heads=2,
        tie_embeddings=False,
    )
    model = TransformerLM(**arguments, key=jax.random.PRNGKey(4))
    written = export_hf(model, arguments, tmp_path / "llama", architecture="LlamaForCausalLM")
    again, read = import_hf(written)
    for a, b in zip(model.params(), again.params(), strict=True):
        np.testing.assert_array_equal(np.asarray(a.value), np.asarray(b.value))
    ids = np.arange(12)[None] % 40
    np.testing.assert_array_equal(logits_of(model, ids), logits_of(again, ids))
    assert read["rope_base"] == 10000.0 and read["n_kv_heads"] == 2


REFUSED = [
    ("gemma3-as-gpt2", "gemma3", "GPT2LMHeadModel", r"a GPT2LMHeadModel config cannot say this model's arguments: .*embed_scale: True != False"),  # noqa: E501
    ("qwen3-as-llama", "qwen3", "LlamaForCausalLM", r"layers\[0\]\.qk_norm: 'head' != None"),
    ("windowed-as-llama", "mistral", "LlamaForCausalLM", r"layers\[0\]\.window: 4 != None"),
    ("unknown-architecture", "qwen3", "BertModel", r"`architecture` must be one of"),
    ("architecture-not-a-string", "qwen3", ["Qwen3ForCausalLM"], r"`architecture` must be one of"),
]  # fmt: skip


@pytest.mark.parametrize(
    "name, architecture, words", [pytest.param(*r[1:], id=r[0]) for r in REFUSED]
)
def test_a_model_an_architecture_cannot_say_is_refused_and_nothing_written(
    tmp_path, name, architecture, words
):
    model, arguments = import_hf(DATA / name)
    with pytest.raises(HuggingFaceError, match=words):
        export_hf(model, arguments, tmp_path / "out", architecture=architecture)
    assert not (tmp_path / "out").exists()


def test_a_qwen2_output_bias_other_than_zeros_is_refused(tmp_path):
    model, arguments = import_hf(DATA / "qwen2")  # Qwen2 stores no output-projection bias
    model = eqx.tree_at(lambda m: m.blocks[1].attention.b_O.value, model, jnp.ones(32))
    with pytest.raises(HuggingFaceError, match=r"hold values other than zeros"):
        export_hf(model, arguments, tmp_path / "out", architecture="Qwen2ForCausalLM")


def test_the_cli_writes_an_imported_checkpoint_back_with_its_tokenizer(tmp_path, capsys):
    source = tmp_path / "source"
    shutil.copytree(DATA / "qwen3", source)
    (source / "tokenizer_config.json").write_text('{"model_max_length": 64}')
    assert cli(["import-hf", str(source), "--out", str(tmp_path / "ckpt")]) == 0
    assert cli(["export-hf", str(tmp_path / "ckpt"), "--out", str(tmp_path / "back")]) == 0
    assert "wrote Qwen3ForCausalLM to" in capsys.readouterr().out
    assert (tmp_path / "back" / "tokenizer_config.json").read_text() == '{"model_max_length": 64}'
    want, got = stored_tensors(DATA / "qwen3"), stored_tensors(tmp_path / "back")
    assert sorted(got) == sorted(want)
    assert (
        cli(
            [
                "export-hf",
                str(tmp_path / "ckpt"),
                "--out",
                str(tmp_path / "b2"),
                "--architecture",
                "GPT2LMHeadModel",
            ]
        )
        == 2
    )
    assert "cannot say this model's arguments" in capsys.readouterr().err


# Mixtures of experts


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe", "qwen3_5_moe"])
def test_the_load_balancing_loss_is_transformers(name):
    model, arguments = import_hf(DATA / name)
    golden = load_file(str(DATA / f"{name}.io.safetensors"))
    with ids_checked():
        _, routers = jax.vmap(model.forward_routed)(jnp.asarray(golden["ids"]))
    loss = balance_loss(routers, arguments["n_experts"], arguments["top_k"])
    np.testing.assert_allclose(float(loss), float(golden["aux_loss"]), rtol=1e-5)


def experts_in_float64(layer, x):
    """The mixture's output by hand in float64: softmax, top k, renormalised or not, SwiGLU; a
    shared expert's SwiGLU times the sigmoid of its gate added."""
    w = {
        n: np.asarray(getattr(layer, n).value, np.float64)
        for n in ("router", "W_gate", "W_up", "W_down")
    }
    x = np.asarray(x, np.float64)
    logits = x @ w["router"]
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        top = np.argsort(-probs[t])[: layer.top_k]
        weights = probs[t, top] / (probs[t, top].sum() if layer.normalize_top_k else 1.0)
        for e, weight in zip(top, weights, strict=True):
            gate = x[t] @ w["W_gate"][e]
            out[t] += (
                weight * ((gate / (1 + np.exp(-gate))) * (x[t] @ w["W_up"][e])) @ w["W_down"][e]
            )
    if layer.shared is not None:
        s = {n: np.asarray(getattr(layer.shared, n).value, np.float64) for n in ("W_gate", "W_up")}
        down = np.asarray(layer.shared.W_down.value, np.float64)
        gate = x @ s["W_gate"]
        shared = ((gate / (1 + np.exp(-gate))) * (x @ s["W_up"])) @ down
        out += shared / (1 + np.exp(-(x @ np.asarray(layer.shared_gate.value, np.float64))))
    return out


@pytest.mark.parametrize("normalize, shared", [(True, None), (False, None), (True, 9)])
def test_routed_and_dense_experts_are_the_float64_mixture(normalize, shared):
    layer = MixtureOfExperts(
        12, 20, jax.random.PRNGKey(2), n_experts=6, top_k=2, normalize_top_k=normalize,
        shared_d_ff=shared,
    )  # fmt: skip
    layer = jax.tree.map(
        lambda a: a * 20 if isinstance(a, jax.Array) else a, layer
    )  # routers apart
    x = jax.random.normal(jax.random.PRNGKey(3), (5, 12))
    want = experts_in_float64(layer, x)
    np.testing.assert_allclose(np.asarray(layer(x)), want, atol=1e-4, rtol=1e-5)  # 5 x 2 > 6: dense
    for t in range(5):  # one position, 2 < 6 experts: routed (gathered)
        np.testing.assert_allclose(
            np.asarray(layer(x[t : t + 1])), want[t : t + 1], atol=1e-4, rtol=1e-5
        )


@pytest.mark.optax
def test_a_mixture_of_experts_model_trains_with_its_balance_term():
    import optax

    from dense_armor.training import evaluate, fit

    model = TransformerLM(
        16, 16, 2, 16, 1, jax.random.PRNGKey(0), 32, feed_forward="moe", n_experts=4, top_k=2
    )
    tokens = np.tile(np.arange(13) % 16, (32, 1))
    xs, labels = tokens[:, :-1], tokens[:, 1:]
    loss = next_token_loss_balanced(0.02)
    before = evaluate(model, xs, labels, loss_fn=loss)
    result = fit(
        model,
        optax.adam(1e-2),
        (xs, labels),
        steps=40,
        batch_size=8,
        loss_fn=loss,
        progress=False,
        eval_every=40,
    )
    after = evaluate(result.model, xs, labels, loss_fn=loss)
    assert after["loss"] < 0.3 * before["loss"], (before, after)

    # the balance term alone moves the router
    def term(m):
        return balance_loss(jax.vmap(m.forward_routed)(jnp.asarray(xs))[1], 4, 2)

    grads = eqx.filter_grad(term)(model)
    assert float(jnp.abs(grads.blocks[0].feed_forward.router.value).max()) > 0


@eqx.filter_jit
def _adam_steps(model, ids, steps=8):
    """`steps` of Adam (learning rate 1e-2) on the next-token cross-entropy of `ids`, written
    here from log-softmax: the losses before each step, the gradients of the first, the model."""
    import optax

    def loss(m):
        logp = jax.nn.log_softmax(jax.vmap(m)(ids[:, :-1]), axis=-1)
        return -jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1).mean()

    optimizer = optax.adam(1e-2)
    params, static = eqx.partition(model, eqx.is_inexact_array)
    state = optimizer.init(params)

    def step(carry, _):
        params, state = carry
        value, grads = eqx.filter_value_and_grad(lambda p: loss(eqx.combine(p, static)))(params)
        updates, state = optimizer.update(grads, state, params)
        return (eqx.apply_updates(params, updates), state), (value, grads)

    # the first step's gradients taken from the loop's own (one gradient graph to compile, not
    # two: Qwen3.5's 7.9 -> 5.5 s)
    _, (losses, grads) = jax.lax.scan(step, (params, state), None, length=steps)
    return losses, jax.tree_util.tree_map(lambda g: g[0], grads)


@pytest.mark.optax  # optax's own updates mix int and float
@pytest.mark.parametrize("name", CASES)
def test_each_architecture_trains_every_weight_it_imports(name):
    """Every architecture's options train: a gradient reaches each imported weight (q/k norms,
    the norms after the sub-layers, the router, partial rotary's projections...), finite, and
    a few steps of Adam on the golden ids lower the loss."""
    model, _ = import_hf(DATA / name)
    ids = jnp.asarray(load_file(str(DATA / f"{name}.io.safetensors"))["ids"])
    with ids_checked():
        losses, grads = _adam_steps(model, ids)
    flat = jax.tree_util.tree_flatten_with_path(grads)[0]
    assert flat and all(bool(jnp.isfinite(g).all()) for _, g in flat)
    zero = [jax.tree_util.keystr(p) for p, g in flat if not bool(jnp.any(g != 0))]
    assert zero == [], zero
    losses = np.asarray(losses)
    assert np.isfinite(losses).all() and losses[-1] < 0.7 * losses[0], losses


@pytest.mark.parametrize("name", CASES)
def test_the_server_gives_transformers_tokens_beside_other_requests(name):
    from dense_armor.nn.models.generation import generate
    from dense_armor.serving import Server

    model, _ = import_hf(DATA / name)
    golden = load_file(str(DATA / f"{name}.io.safetensors"))
    want = golden["generated"][0]
    batch = batch_of_prompts(golden)  # test_language_models.py generates the same batch
    prompts = [batch[2].tolist(), batch[1].tolist(), batch[0].tolist()]
    new = [len(want), 7, 11]
    server = Server(model, slots=2, capacity=48, chunk=4)  # three requests, two slots
    done = {c.number: c for c in server.serve(zip(prompts, new, strict=True))}
    np.testing.assert_array_equal(done[0].tokens, want)  # transformers' greedy tokens
    solo = np.asarray(generate(model, batch, len(want)).tokens)  # each row as alone
    for n, row in ((1, 1), (2, 0)):
        np.testing.assert_array_equal(done[n].tokens, solo[row, : new[n]], err_msg=str(n))


def write_bfloat16(tensors, path):
    """A safetensors file of bfloat16 tensors written by hand (the format: 8 bytes of header
    length, the JSON header, the data): each float32 cut to its high 16 bits."""
    header, chunks, offset = {}, [], 0
    for name, array in tensors.items():
        data = (
            (np.ascontiguousarray(array, np.float32).view(np.uint32) >> 16).astype("<u2").tobytes()
        )
        header[name] = {
            "dtype": "BF16",
            "shape": list(array.shape),
            "data_offsets": [offset, offset + len(data)],
        }
        chunks.append(data)
        offset += len(data)
    encoded = json.dumps(header).encode()
    path.write_bytes(len(encoded).to_bytes(8, "little") + encoded + b"".join(chunks))


def test_a_bfloat16_checkpoint_imports_to_its_exact_values(tmp_path):
    target = tmp_path / "qwen3"
    shutil.copytree(DATA / "qwen3", target)
    tensors = load_file(str(target / "model.safetensors"))
    write_bfloat16(tensors, target / "model.safetensors")
    model, _ = import_hf(target)
    cut = lambda a: ((a.view(np.uint32) >> 16) << 16).view(np.float32)  # noqa: E731
    np.testing.assert_array_equal(
        np.asarray(model.embed.table.value), cut(tensors["model.embed_tokens.weight"])
    )
    w = tensors["model.layers.1.self_attn.q_proj.weight"]
    np.testing.assert_array_equal(np.asarray(model.blocks[1].attention.W_Q.value), cut(w).T)


def test_a_longrope_model_streams_to_its_pretrained_length_and_no_further(tmp_path):
    """Phi-4-mini's LongRoPE is built within its pretrained length (48 positions here): a stream
    fills it, the step past it is a NaN row with the overflow flag set (or raises), and neither
    a longer forward nor an artifact whose cache passes it is made."""
    from dense_armor.checkpoints import ModelConfig
    from dense_armor.export import ArtifactError, export_model

    model, arguments = import_hf(DATA / "phi4_mini")
    assert model.position_limit == config_of("phi4_mini")["original_max_position_embeddings"]
    ids = jnp.asarray(np.arange(49) % model.vocab, jnp.int32)
    cache = model.init_cache(64, on_overflow="nan")
    with ids_checked():
        logits, cache = eqx.filter_jit(model.prefill)(ids[:48], cache)
        np.testing.assert_allclose(logits, logits_of(model, ids[None, :48])[0], atol=1e-5)
        after, cache = eqx.filter_jit(model.prefill)(ids[48:], cache)
    assert np.isfinite(logits).all() and np.isnan(after).all()
    assert bool(cache[0].counter.overflow)
    with pytest.raises(ValueError, match="49 positions pass this model's LongRoPE"):
        model(ids)
    from dense_armor.nn.models.generation import generate

    with pytest.raises(
        ValueError, match=r"need 49 positions; the model is made for 48 \(its context"
    ):
        generate(model, [[3] * 40], 9)
    with pytest.raises(ArtifactError, match="capacity"):
        export_model(model, ModelConfig("transformer_lm", arguments), tmp_path / "a", capacity=49)


# Multimodal checkpoints read as their text model


@pytest.mark.parametrize("name", ["qwen3_5_vl", "qwen3_5_moe_vl"])
def test_a_multimodal_checkpoint_imports_as_its_text_model_and_writes_back_as_it(tmp_path, name):
    """Qwen3.5 as published (`Qwen3_5ForConditionalGeneration`, and its mixture of experts'):
    the text model's logits are transformers' (its float64 ones, within 4e-5: its own float32
    forward lies 1.3e-5 and 0.9e-5 from them; here 1.3e-5 and 2.5e-5 on a Zen 4 whose virtual
    machine hides AVX-512, under 2e-5 on a Xeon with it), the vision tower's tensors are not
    read, and the model writes back as the text architecture, transformers' tensors renamed bit
    for bit."""
    model, arguments = import_hf(DATA / name)
    wrapper = config_of(name)["architectures"][0]
    text = WRAPPERS[wrapper][0]
    golden = load_file(str(DATA / f"{name}.io.safetensors"))
    np.testing.assert_allclose(logits_of(model, golden["ids"]), golden["logits"], atol=4e-5, rtol=0)
    assert arguments["mixers"].count("attention") == 1 and arguments["output_gate"]
    with pytest.raises(HuggingFaceError, match=rf"pass `architecture='{text}'`"):
        export_hf(model, arguments, tmp_path / "no", architecture=wrapper)
    written = export_hf(model, arguments, tmp_path / "text", architecture=text)
    source, got = stored_tensors(DATA / name), stored_tensors(written)
    prefix = "model.language_model."
    want = {
        ("model." + name[len(prefix) :] if name.startswith(prefix) else name): tensor
        for name, tensor in source.items()
        if not name.startswith("model.visual.")
    }
    assert sorted(got) == sorted(want) and any(n.startswith("model.visual.") for n in source)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    assert import_hf(written)[1] == arguments


def test_the_cli_writes_a_multimodal_import_back_as_its_text_model(tmp_path, capsys):
    assert cli(["import-hf", str(DATA / "qwen3_5_vl"), "--out", str(tmp_path / "ckpt")]) == 0
    out = tmp_path / "out"
    assert cli(["export-hf", str(tmp_path / "ckpt"), "--out", str(out)]) == 0
    assert "wrote Qwen3_5ForCausalLM" in capsys.readouterr().out
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen3_5ForCausalLM"] and config["bos_token_id"] == 1


def _with_extra_tensor(tmp_path, name, extra):
    target = tmp_path / name
    shutil.copytree(DATA / name, target)
    tensors = load_file(str(target / "model.safetensors"))
    save_file({**tensors, extra: np.ones((2, 3), np.float32)}, str(target / "model.safetensors"))
    return target


def test_qwen3_5s_multi_token_prediction_layers_are_not_read_and_nothing_else_is_dropped(tmp_path):
    plain, _ = import_hf(DATA / "qwen3_5")
    model, _ = import_hf(_with_extra_tensor(tmp_path, "qwen3_5", "mtp.fc.weight"))
    for a, b in zip(plain.params(), model.params(), strict=True):
        np.testing.assert_array_equal(np.asarray(a.value), np.asarray(b.value))
    for name, extra in (("qwen3_5_vl", "model.language_model.extra.weight"),
                        ("qwen3_5", "model.visual.blocks.0.weight")):  # fmt: skip
        with pytest.raises(HuggingFaceError, match=r"1 tensors of the checkpoint have no place"):
            import_hf(_with_extra_tensor(tmp_path / "refused", name, extra))


def test_a_wrapper_without_its_text_config_is_refused(tmp_path):
    target = tmp_path / "qwen3_5_vl"
    shutil.copytree(DATA / "qwen3_5_vl", target)
    config = config_of("qwen3_5_vl")
    config["text_config"] = "qwen3_5"
    (target / "config.json").write_text(json.dumps(config))
    with pytest.raises(HuggingFaceError, match=r"holds its text model's as `text_config`"):
        import_hf(target)
