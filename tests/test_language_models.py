"""`TransformerLM` and `import_hf` against transformers: tiny random GPT-2, Llama (grouped-query
and sharded; multi-head and tied) and Qwen2 models, their logits and greedy generations committed
as data by tests/torch_reference/make_hf_golden.py (neither torch nor transformers runs here)."""

import functools
import json
import pathlib
import re
import shutil

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from safetensors.numpy import load_file, save_file

from dense_armor.checkpoints import ModelConfig, load_checkpoint
from dense_armor.cli import main as cli
from dense_armor.export import export_model
from dense_armor.export.standalone import check_golden, load
from dense_armor.huggingface import HuggingFaceError, import_hf, load_tokenizer
from dense_armor.nn.layers.language import ids_checked
from dense_armor.nn.models import generation
from dense_armor.nn.models.generation import generate, stream_tokens
from dense_armor.nn.models.language_model import TransformerLM
from dense_armor.nn.models.stack import scanned as stacked
from dense_armor.nn.state.streams import reset
from dense_armor.training import evaluate, fit, next_token_loss

DATA = pathlib.Path(__file__).parent / "data" / "hf"
# transformers' tiny random models (tests/torch_reference/make_hf_golden.py): the four lineages
# first imported, then the checkpoints' structural options (rope scaling, head widths, q/k norms,
# windows, Gemma's conventions, fused projections, LayerNorm with biases)
CASES = [
    "gpt2", "llama_gqa", "llama_tied", "qwen2", "llama32", "qwen2_yarn", "qwen3", "mistral",
    "phi3", "phi4_mini", "olmo2", "gemma", "gemma2", "gemma3", "starcoder2", "mixtral",
    "qwen3_moe", "lfm2", "qwen3_5", "qwen3_5_moe",
]  # fmt: skip
# The logits' agreement with the reference (transformers' float32 logits; the hybrids':
# transformers' float64 logits), 1e-5 but for Qwen3.5's mixture of experts, 0.5-1.6e-5 here
# (transformers' own float32 forward 1.4e-5 from its float64 logits). With eight layers the dense
# Qwen3.5's tiny random model amplified float32 round-off past 1e-4 (transformers' own 1.5e-4);
# its four layers now (2.5e-6 here) take the common 1e-5.
TOLERANCE = {"qwen3_5_moe": 2e-5}
CAPACITY = 48


# The comparisons below feed the golden data's ids and argmax tokens, all in the vocabulary, and
# trace the model inside `ids_checked()`: the embedding's id check is a callback to Python, which
# JAX's disk cache never keeps, so every run compiled them again (a minute of the suite's CPU).
# The check itself is tested in test_language_layers.py and by the sweep of bad inputs.
FORWARD = eqx.filter_jit(lambda m, ids: jax.vmap(m)(ids))


def logits_of(model, ids):
    """The batched forward's logits for the ids `(B, T)`."""
    with ids_checked():
        return np.asarray(FORWARD(model, jnp.asarray(ids)))


@pytest.fixture(scope="module", params=CASES)
def case(request):
    model, arguments = import_hf(DATA / request.param)
    return request.param, model, arguments, load_file(str(DATA / f"{request.param}.io.safetensors"))


def test_the_logits_are_transformers_within_1e_5(case):
    name, model, _, golden = case
    np.testing.assert_allclose(
        logits_of(model, golden["ids"]), golden["logits"], atol=TOLERANCE.get(name, 1e-5),
        rtol=0, err_msg=name,
    )  # fmt: skip


def greedy_stream(model, prompt, new_tokens, prefill=True):
    """`prefill` the prompt (or `step` through it, `prefill=False`: one compilation whatever the
    prompt's length), then `step` each argmax: the generated ids."""
    cache = model.init_cache(CAPACITY, on_overflow="nan")  # one capacity: one compilation
    with ids_checked():
        if prefill:
            logits, cache = PREFILL(model, jnp.asarray(prompt), cache)
        else:
            for token in prompt:
                last, cache = STEP(model, jnp.asarray(token, jnp.int32), cache)
            logits = last[None]
        token, out = jnp.argmax(logits[-1]).astype(jnp.int32), []
        for _ in range(new_tokens):
            out.append(int(token))
            logits, cache = STEP(model, token, cache)
            token = jnp.argmax(logits).astype(jnp.int32)
    return np.array(out)


# prefill and prefill_last as the suite compiles them (tests/environment.py): their caches are
# compared bit for bit, which every case's two programs give at the suite's options as at XLA's
# defaults (checked 2026-12-06, jax 0.10.2; compiling them as a user's JAX does cost 1.7-2.7x the
# compile time)
PREFILL = eqx.filter_jit(lambda m, ids, c: m.prefill(ids, c))
PREFILL_LAST = eqx.filter_jit(lambda m, ids, c: m.prefill_last(ids, c))
STEP = eqx.filter_jit(lambda m, token, c: m.step(token, c))


def test_greedy_generation_through_prefill_and_step_is_transformers_token_for_token(case):
    _, model, _, golden = case
    prompt, want = golden["prompt"][0], golden["generated"][0]
    np.testing.assert_array_equal(greedy_stream(model, prompt, len(want)), want)
    # prefill_last (what generation prefills with): prefill's last row of logits, the same cache
    cache = model.init_cache(CAPACITY, on_overflow="nan")
    with ids_checked():
        every, after = PREFILL(model, jnp.asarray(prompt), cache)
        last, last_after = PREFILL_LAST(model, jnp.asarray(prompt), cache)
    assert last.shape == (every.shape[1],)
    np.testing.assert_allclose(last, every[-1], atol=1e-5, rtol=0)
    for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(last_after), strict=True):
        np.testing.assert_array_equal(a, b)
    # and the uncached forward's argmax after every prefix of the whole sequence
    logits = logits_of(model, np.r_[prompt, want][None])[0]
    following = np.argmax(logits, axis=-1)[len(prompt) - 1 : -1]
    np.testing.assert_array_equal(following, want)


def test_scan_over_layers_gives_the_same_logits(case):
    name, model, _, golden = case
    scanned = eqx.tree_at(lambda m: m.blocks, model, stacked(model.blocks))
    np.testing.assert_allclose(
        logits_of(scanned, golden["ids"]), golden["logits"], atol=TOLERANCE.get(name, 1e-5), rtol=0
    )
    want = golden["generated"][0][:8]
    np.testing.assert_array_equal(greedy_stream(scanned, golden["prompt"][0], len(want)), want)


def test_the_arguments_build_the_same_model_shape(case):
    _, model, arguments, _ = case
    json.dumps(arguments)  # JSON values
    again = TransformerLM(**arguments, key=jax.random.PRNGKey(1))
    shapes = lambda m: [p.value.shape for p in m.params()]  # noqa: E731
    assert shapes(again) == shapes(model)


def test_tied_models_hold_one_table_and_untied_ones_a_head(case):
    name, model, arguments, _ = case
    assert (model.head is None) == arguments["tie_embeddings"]
    config = json.loads((DATA / name / "config.json").read_text())
    assert arguments["tie_embeddings"] == config["tie_word_embeddings"]


# A damaged directory: each is a clear `HuggingFaceError`


def damaged(tmp_path, case, change):
    target = tmp_path / case
    shutil.copytree(DATA / case, target)
    change(target)
    return target


def edit_config(**changes):
    def change(target):
        config = json.loads((target / "config.json").read_text())
        config.update(changes)
        (target / "config.json").write_text(json.dumps(config))

    return change


def edit_tensors(change_tensors):
    def change(target):
        tensors = load_file(str(target / "model.safetensors"))
        change_tensors(tensors)
        save_file(tensors, str(target / "model.safetensors"))

    return change


def truncate(target):
    path = target / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])


def nan_in(name):
    def change(tensors):
        tensors[name] = tensors[name].copy()
        tensors[name][0, 0] = np.nan

    return change


BROKEN = [
    ("unknown-architecture", "gpt2", edit_config(architectures=["BertModel"]), r"`architectures` is \['BertModel'\]; this importer reads one of"),
    ("rope-longrope-wrong-length", "phi4_mini", edit_config(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4, "partial_rotary_factor": 0.75, "short_factor": [1.0] * 4, "long_factor": [1.0] * 3, "original_max_position_embeddings": 48}), r"`rope_scaling\['short_factor'\]` has 4 entries; the layer rotates 3 pairs"),
    ("rope-longrope-no-long-factors", "phi4_mini", edit_config(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 4}), r"missing \['long_factor'\]"),
    ("old-rope-dynamic", "qwen2", edit_config(rope_scaling={"type": "dynamic", "factor": 2.0}), r"'dynamic' \(NTK scaling recomputed from each call's length\) is not built"),
    ("rope-llama3-incomplete", "llama32", edit_config(rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 32.0, "high_freq_factor": 4.0}), r"missing \['low_freq_factor'\]"),
    ("rope-unknown-option", "qwen2", edit_config(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 2]}), r"rope options \['mrope_section'\] beside the default rope type are not implemented"),
    ("attention-by-layer-index", "gpt2", edit_config(scale_attn_by_inverse_layer_idx=True), r"`scale_attn_by_inverse_layer_idx=True` \(attention scaled by 1/layer\) is not implemented"),
    ("layer-type-unknown", "qwen3", edit_config(layer_types=["full_attention", "chunked_attention"]), r"`layer_types` is \['full_attention', 'chunked_attention'\]; expected 2 of"),
    ("sliding-without-window", "gemma2", edit_config(sliding_window=None), r"sliding layers in `layer_types` but no `sliding_window`"),
    ("gemma3-bidirectional", "gemma3", edit_config(use_bidirectional_attention=True), r"`use_bidirectional_attention=True` \(bidirectional attention\) is not implemented"),
    ("gemma-activation", "gemma", edit_config(hidden_activation="relu"), r"`hidden_activation='relu'` \(the GeGLU's activation\)"),
    ("phi3-fused-mis-shaped", "phi3", edit_tensors(lambda t: t.update({"model.layers.0.self_attn.qkv_proj.weight": np.ones((48, 32), np.float32)})), r"'model.layers.0.self_attn.qkv_proj.weight' has shape \(48, 32\); the config asks for \(64, 32\)"),
    ("qk-norm-missing", "qwen3", edit_tensors(lambda t: t.pop("model.layers.0.self_attn.k_norm.weight")), r"has no tensor 'model.layers.0.self_attn.k_norm.weight'"),
    ("another-activation", "qwen2", edit_config(hidden_act="relu"), r"`hidden_act='relu'`"),
    ("missing-tensor", "qwen2", edit_tensors(lambda t: t.pop("model.layers.1.mlp.up_proj.weight")), r"has no tensor 'model.layers.1.mlp.up_proj.weight'"),
    ("extra-tensor", "qwen2", edit_tensors(lambda t: t.update(extra=np.zeros(3, np.float32))), r"1 tensors of the checkpoint have no place in the model \(first: \['extra'\]\)"),
    ("mis-shaped-tensor", "gpt2", edit_tensors(lambda t: t.update({"transformer.ln_f.weight": np.ones(31, np.float32)})), r"tensor 'transformer.ln_f.weight' has shape \(31,\); the config asks for \(32,\)"),
    ("nan-tensor", "gpt2", edit_tensors(nan_in("transformer.wte.weight")), r"tensor 'transformer.wte.weight' holds non-finite values"),
    ("truncated-file", "gpt2", truncate, r"model.safetensors is not a readable safetensors file"),
    ("header-not-json", "gpt2", lambda t: (t / "model.safetensors").write_bytes((5).to_bytes(8, "little") + b"{oops"), r"model.safetensors is not a readable safetensors file"),
    ("header-longer-than-file", "gpt2", lambda t: (t / "model.safetensors").write_bytes((10**9).to_bytes(8, "little") + b"{}"), r"not a readable safetensors file: a header of 1000000000 bytes in a file of 10"),
    ("empty-weights-file", "gpt2", lambda t: (t / "model.safetensors").write_bytes(b""), r"not a readable safetensors file"),
    ("config-not-json", "gpt2", lambda t: (t / "config.json").write_text("{"), r"config.json is not readable JSON"),
    ("config-a-list", "gpt2", lambda t: (t / "config.json").write_text("[]"), r"config.json holds a list, not a JSON object"),
    ("missing-shard", "llama_gqa", lambda t: (t / "model-00003-of-00007.safetensors").unlink(), r"model-00003-of-00007.safetensors is missing"),
    ("vocab-a-string", "gpt2", edit_config(vocab_size="96"), r"`vocab_size` is '96'; expected a"),
]  # fmt: skip


@pytest.mark.parametrize(
    "case_name, change, words", [pytest.param(*r[1:], id=r[0]) for r in BROKEN]
)
def test_a_damaged_directory_is_refused_naming_what(tmp_path, case_name, change, words):
    target = damaged(tmp_path, case_name, change)
    with pytest.raises(HuggingFaceError, match=words):
        import_hf(target)


def test_a_missing_directory_is_refused(tmp_path):
    with pytest.raises(HuggingFaceError, match=r"is not a directory"):
        import_hf(tmp_path / "nowhere")


# generate: one compiled function


def batch_of_prompts(golden):
    """Four prompts of different lengths from a case's golden data, transformers' third. The
    server's test (test_hf_architectures.py) generates the same batch: one compilation of
    `generate` per architecture for both, shared through the compilation cache."""
    ids = golden["ids"]
    return [ids[0, :3], ids[1, :8], golden["prompt"][0], ids[0, :1]]


def test_generate_is_transformers_greedy_generation_and_each_prompt_of_a_batch_its_solo_one(case):
    """One batch of prompts of different lengths (one compilation): transformers' prompt gives
    transformers' tokens, and every row is that prompt's generation alone, streamed step by
    step in Python."""
    _, model, _, golden = case
    want, prompts = golden["generated"][0], batch_of_prompts(golden)
    batch = generate(model, prompts, len(want))
    np.testing.assert_array_equal(np.asarray(batch.tokens[2]), want)
    for i, prompt in enumerate(prompts):
        np.testing.assert_array_equal(
            np.asarray(batch.tokens[i]),
            greedy_stream(model, prompt, len(want), prefill=False),
            err_msg=str(i),
        )
    np.testing.assert_array_equal(np.asarray(batch.lengths), [len(want)] * 4)


def test_top_k_one_samples_the_greedy_tokens_and_a_key_reproduces_a_draw():
    model, _ = import_hf(DATA / "llama_tied")
    prompts = [[5, 9, 13], [7]]
    greedy = generate(model, prompts, 5)
    key = jax.random.PRNGKey(3)
    np.testing.assert_array_equal(
        np.asarray(generate(model, prompts, 5, key, temperature=1.0, top_k=1).tokens),
        np.asarray(greedy.tokens),
    )
    first = generate(model, prompts, 5, key, temperature=1.5)
    again = generate(model, prompts, 5, key, temperature=1.5)
    np.testing.assert_array_equal(np.asarray(first.tokens), np.asarray(again.tokens))
    assert np.all((np.asarray(first.tokens) >= 0) & (np.asarray(first.tokens) < model.vocab))


def test_generate_steps_only_while_a_row_has_tokens_to_come(monkeypatch):
    """The last token drawn is never fed back: one new token costs the prefill alone. Counted
    by a callback in the model's step (hand-derived: prompts of 3 and 5 tokens, 2 new each; the
    loop starts at the common length 3 and feeds positions 3, 4 and 5, the token drawn at 6
    being row 1's last; a lone prompt and 1 new token feeds nothing)."""
    fed = []
    step = TransformerLM.step

    def counted(self, token, cache):
        jax.debug.callback(lambda t: fed.append(np.asarray(t).copy()), token)
        return step(self, token, cache)

    model = TransformerLM(50, 16, 2, 32, 1, jax.random.PRNGKey(0), 32)
    expected = [
        generate(model, p, n).tokens for p, n in (([[1, 2, 3], [4, 5, 6, 7, 8]], 2), ([[9]], 1))
    ]
    monkeypatch.setattr(TransformerLM, "step", counted)
    monkeypatch.setattr(generation, "_compiled", functools.cache(generation._compiled.__wrapped__))
    two = generate(model, [[1, 2, 3], [4, 5, 6, 7, 8]], 2)
    jax.effects_barrier()
    assert len(fed) == 3 * 2, fed  # under `vmap`, the callback runs once per row
    np.testing.assert_array_equal(fed[1:4:2], [7, 8])  # row 1's prompt, fed at positions 3, 4
    one = generate(model, [[9]], 1)
    jax.effects_barrier()
    assert len(fed) == 3 * 2, fed
    np.testing.assert_array_equal(np.asarray(two.tokens), np.asarray(expected[0]))
    np.testing.assert_array_equal(np.asarray(one.tokens), np.asarray(expected[1]))


def test_generation_compiles_without_a_callback_so_jaxs_disk_cache_keeps_it():
    """`generate` checks its prompts before the call, so its compiled loop carries no id check
    (a callback to Python, which JAX's persistent compilation cache never keeps), nor a cache
    that raises; a model's own traced prefill does have the id check."""
    model = TransformerLM(50, 16, 2, 32, 1, jax.random.PRNGKey(0), 32)
    loop = str(jax.make_jaxpr(lambda: generate(model, [[1, 2, 3]], 4).tokens)())
    assert "while" in loop and "callback" not in loop
    cache = model.init_cache(8, on_overflow="nan")
    assert "callback" in str(jax.make_jaxpr(lambda: model.prefill(jnp.array([1, 2]), cache)[0])())
    with ids_checked():  # a growing cache in "raise" mode, no position limit: nothing to raise
        growing = model.init_cache()
        step = str(jax.make_jaxpr(lambda: model.prefill(jnp.array([1, 2]), growing)[0])())
    assert "callback" not in step


@pytest.mark.optax
def test_fit_and_evaluate_trace_a_language_model_without_the_id_callback():
    """`next_token_loss` checks every id before the model sees it (whole arrays, and each batch
    of a source: rows of the sweep of bad inputs), so `fit` and `evaluate` trace it in
    `ids_checked()`: no callback, so their compiled steps stay in JAX's disk cache. The same
    loss traced outside that context keeps the embedding's check."""
    model = TransformerLM(16, 16, 2, 32, 1, jax.random.PRNGKey(0), 8)
    xs, labels = jnp.zeros((2, 5), jnp.int32), jnp.ones((2, 5), jnp.int32)

    def traced() -> str:
        return str(jax.make_jaxpr(lambda: next_token_loss(model, xs, labels))())

    with next_token_loss.checked_inputs():
        assert "callback" not in traced()
    assert "callback" in traced()


def test_a_stop_token_ends_its_row_and_pads_the_rest():
    model, _ = import_hf(DATA / "qwen2")
    golden = load_file(str(DATA / "qwen2.io.safetensors"))
    want = golden["generated"][0]
    stop = int(want[3])
    first = int(np.argmax(want == stop))  # where the stop token first comes
    result = generate(model, [golden["prompt"][0]], len(want), stop_tokens=[stop])
    assert int(result.lengths[0]) == first + 1
    np.testing.assert_array_equal(np.asarray(result.tokens[0, : first + 1]), want[: first + 1])
    assert np.all(np.asarray(result.tokens[0, first + 1 :]) == -1)


BAD_GENERATE = [
    ("float-ids", lambda m: generate(m, [[1.0, 2.0]], 3), r"prompt 0 must be a 1-D sequence of integer token ids"),
    ("id-past-the-vocabulary", lambda m: generate(m, [[1, 96]], 3), r"prompt 0 holds token id 96, outside the vocabulary \[0, 96\)"),
    ("negative-id", lambda m: generate(m, [[3], [-1]], 3), r"prompt 1 holds token id -1"),
    ("empty-prompt", lambda m: generate(m, [[1, 2], []], 3), r"prompt 1 is empty"),
    ("no-prompts", lambda m: generate(m, [], 3), r"`prompts` must be a non-empty list"),
    ("a-string", lambda m: generate(m, "hello", 3), r"`prompts` must be a non-empty list.*received str"),
    ("max-new-tokens-zero", lambda m: generate(m, [[1]], 0), r"`max_new_tokens` must be a positive integer; received `max_new_tokens=0`"),
    ("max-new-tokens-negative", lambda m: generate(m, [[1]], -2), r"`max_new_tokens` must be a positive integer"),
    ("prompt-longer-than-the-capacity", lambda m: generate(m, [list(range(3, 13))], 4, capacity=8), r"the longest prompt \(10 tokens\) and `max_new_tokens=4` need 14 cache slots; `capacity=8`"),
    ("past-the-learned-positions", lambda m: generate(m, [[3] * 60], 8), r"need 68 positions; the model is made for 64 \(its context: `max_len`"),
    ("top-p-zero", lambda m: generate(m, [[1]], 3, jax.random.PRNGKey(0), temperature=1.0, top_p=0.0), r"`top_p` must be a number in \(0, 1\]"),
    ("top-p-above-one", lambda m: generate(m, [[1]], 3, jax.random.PRNGKey(0), temperature=1.0, top_p=1.2), r"`top_p` must be a number in \(0, 1\]"),
    ("temperature-negative", lambda m: generate(m, [[1]], 3, temperature=-0.5), r"`temperature` must be a finite number >= 0"),
    ("temperature-nan", lambda m: generate(m, [[1]], 3, temperature=float("nan")), r"`temperature` must be a finite number >= 0"),
    ("sampling-without-a-key", lambda m: generate(m, [[1]], 3, temperature=0.8), r"key"),
    ("stop-token-outside", lambda m: generate(m, [[1]], 3, stop_tokens=[200]), r"`stop_tokens` \(200,\) must lie in \[0, 96\)"),
]  # fmt: skip


@pytest.fixture(scope="module")
def gpt2():
    return import_hf(DATA / "gpt2")[0]


@pytest.mark.parametrize("action, words", [pytest.param(*r[1:], id=r[0]) for r in BAD_GENERATE])
def test_generate_refuses_bad_inputs_naming_them(gpt2, action, words):
    with pytest.raises((ValueError, TypeError), match=words):
        action(gpt2)


# checkpoints and the command line


def test_the_cli_imports_a_directory_into_a_checkpoint_that_loads_back_exactly(tmp_path, capsys):
    assert cli(["import-hf", str(DATA / "llama_gqa"), "--out", str(tmp_path / "ckpt")]) == 0
    assert "imported" in capsys.readouterr().out
    checkpoint = load_checkpoint(tmp_path / "ckpt")
    loaded = checkpoint.model
    assert checkpoint.config.factory == "transformer_lm"
    golden = load_file(str(DATA / "llama_gqa.io.safetensors"))
    logits = logits_of(loaded, golden["ids"])
    np.testing.assert_allclose(np.asarray(logits), golden["logits"], atol=1e-5, rtol=0)


def test_the_cli_refuses_a_damaged_directory_in_one_line(tmp_path, capsys):
    target = damaged(tmp_path, "gpt2", edit_config(architectures=["BertModel"]))
    assert cli(["import-hf", str(target), "--out", str(tmp_path / "ckpt")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dense-armor import-hf: error: ") and "BertModel" in err
    assert not (tmp_path / "ckpt").exists()


# What a decoding artifact's key must not be: a new-style typed key, a batch of keys, int32.
BAD_ARTIFACT_KEYS = [np.zeros((2, 2), np.uint32), np.zeros(4, np.uint32), np.zeros(2, np.int32)]


def test_an_artifact_samples_in_the_graph_as_generate_does(tmp_path):
    """Exported with sampling rules (every one at once), `sample_prefill` and `sample_step` draw
    from the key input the tokens `generate` draws with the same key and rules, stream by
    stream; the manifest records the rules and the golden decoding replays."""
    sampling = {"temperature": 1.3, "top_k": 40, "top_p": 0.9, "min_p": 0.02}
    model, arguments = import_hf(DATA / "llama_tied")
    config = ModelConfig("transformer_lm", arguments)
    export_model(
        model,
        config,
        tmp_path / "art",
        capacity=24,
        platforms=["cpu"],
        static_shapes=[],
        sampling=sampling,
    )
    artifact = load(tmp_path / "art")
    assert {k: artifact.manifest["sampling"][k] for k in sampling} == sampling
    errors = check_golden(artifact)
    assert errors["decode B=2, 20 tokens (tokens that differ)"] == 0.0
    prompts = np.array([[5, 9, 13, 2], [7, 1, 1, 4]], np.int32)
    key = jax.random.PRNGKey(3)
    token, cache, _ = artifact.sample_prefill(prompts, artifact.init_cache(2), np.asarray(key))
    tokens = [np.asarray(token)]
    for _ in range(11):
        token, cache, _ = artifact.sample_step(token, cache, np.asarray(key))
        tokens.append(np.asarray(token))
    want = generate(model, prompts, 12, key, **sampling).tokens
    np.testing.assert_array_equal(np.stack(tokens, axis=1), np.asarray(want))
    greedy_tokens = generate(model, prompts, 12).tokens
    assert not np.array_equal(np.asarray(want), np.asarray(greedy_tokens))  # it did sample


# What a language-model artifact's step refuses: float ids, NumPy's default int64, a 2-D batch.
BAD_ARTIFACT_IDS = [np.array([1.0], np.float32), np.array([1]), np.array([[1]], np.int32)]


# training on next tokens


def repeating_text():
    """Windows of a text that repeats 8 tokens: inputs and the tokens that follow them."""
    text = np.tile(np.arange(3, 11), 8)
    windows = np.stack([text[i : i + 13] for i in range(32)])
    return windows[:, :-1], windows[:, 1:]


@pytest.mark.optax  # fit's optax updates mix int and float
def test_fit_trains_a_language_model_on_next_tokens():
    model = TransformerLM(16, 16, 2, 32, 1, jax.random.PRNGKey(0), 32, n_kv_heads=1)
    xs, labels = repeating_text()
    before = evaluate(model, xs, labels, loss_fn=next_token_loss)
    result = fit(
        model, optax.adam(1e-2), (xs, labels), steps=60, batch_size=8,
        loss_fn=next_token_loss, progress=False, eval_every=60,
    )  # fmt: skip
    after = evaluate(result.model, xs, labels, loss_fn=next_token_loss)
    assert after["loss"] < 0.2 * before["loss"], (before, after)
    assert after["accuracy"] > 0.9 and 0.0 <= before["accuracy"] < 0.5


BAD_NEXT_TOKEN = [
    ("float-inputs", lambda m, xs, ys: (xs.astype(float), ys), r"`xs` must be integer token ids; received dtype float64"),
    ("labels-past-the-vocabulary", lambda m, xs, ys: (xs, ys + 10), r"`labels` must lie in \[0, 16\), the model's vocabulary; received ids from 13 to 20"),
    ("negative-inputs", lambda m, xs, ys: (xs - 5, ys), r"`xs` must lie in \[0, 16\).*from -2"),
    ("labels-of-another-shape", lambda m, xs, ys: (xs, ys[:, :-1]), r"`labels` of the same shape; received shapes \(32, 12\) and \(32, 11\)"),
    ("one-sequence", lambda m, xs, ys: (xs[0], ys[0]), r"token ids `xs \(B, T\)`.*received shapes \(12,\)"),
]  # fmt: skip


@pytest.mark.optax
@pytest.mark.parametrize("change, words", [pytest.param(*r[1:], id=r[0]) for r in BAD_NEXT_TOKEN])
def test_next_token_data_are_checked_naming_what(change, words):
    model = TransformerLM(16, 16, 2, 32, 1, jax.random.PRNGKey(0), 32)
    xs, labels = change(model, *repeating_text())
    with pytest.raises(ValueError, match=words):
        fit(
            model,
            optax.adam(1e-2),
            (xs, labels),
            steps=1,
            batch_size=4,
            loss_fn=next_token_loss,
            progress=False,
        )


def test_a_batch_of_streams_steps_under_vmap_and_a_reset_stream_starts_again():
    model, _ = import_hf(DATA / "llama_tied")
    step = eqx.filter_jit(lambda m, ids, c: jax.vmap(m.step)(ids, c))
    caches = model.init_streams(2, 8, on_overflow="nan")  # 4 steps of 8: no overflow to raise
    with ids_checked():
        for ids in ([5, 9], [6, 10], [7, 11]):
            _, caches = step(model, jnp.array(ids), caches)
        caches = reset(caches, jnp.array([False, True]))
        after, _ = step(model, jnp.array([8, 12]), caches)
    alone, _ = model.step(jnp.array(12), model.init_cache(8))  # stream 1, started again
    np.testing.assert_allclose(np.asarray(after[1]), np.asarray(alone), atol=1e-5)
    solo = model(jnp.array([5, 6, 7, 8]))  # stream 0 went on from its three tokens
    np.testing.assert_allclose(np.asarray(after[0]), np.asarray(solo[-1]), atol=1e-5)


def test_streamed_tokens_are_generates_greedy_and_sampled_alike():
    model, _ = import_hf(DATA / "gpt2")
    golden = load_file(str(DATA / "gpt2.io.safetensors"))
    prompt, want = list(golden["prompt"][0]), golden["generated"][0][:10]
    np.testing.assert_array_equal(list(stream_tokens(model, prompt, 10)), want)
    key = jax.random.PRNGKey(5)
    settings = dict(temperature=1.3, top_p=0.95)
    drawn = list(stream_tokens(model, prompt, 10, key, **settings))
    np.testing.assert_array_equal(
        drawn, np.asarray(generate(model, [prompt], 10, key, **settings).tokens[0])
    )
    stop = drawn[2]
    assert (
        list(stream_tokens(model, prompt, 10, key, stop_tokens=[stop], **settings))
        == drawn[: drawn.index(stop) + 1]
    )


# text in and out: a tokenizer.json beside the weights, and `dense-armor generate`


def word_tokenizer(path):
    """A tokenizer.json of 96 words `t0` ... `t95`, the ids of the tiny models."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(96)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(path))
    return path


def test_generate_from_the_command_line_reads_text_and_prints_text(tmp_path, capsys):
    source = damaged(tmp_path, "gpt2", lambda t: word_tokenizer(t / "tokenizer.json"))
    assert cli(["import-hf", str(source), "--out", str(tmp_path / "ckpt")]) == 0
    assert (tmp_path / "ckpt" / "tokenizer.json").is_file()
    capsys.readouterr()
    args = ["generate", str(tmp_path / "ckpt"), "--prompt", "t50 t60 t70", "--max-new-tokens", "5"]
    assert cli(args) == 0
    model, _ = import_hf(DATA / "gpt2")
    want = greedy_stream(model, [50, 60, 70], 5)
    text = " ".join(f"t{i}" for i in want) + "\n"
    assert capsys.readouterr().out == text
    ids = ["--ids", "50,60,70", "--max-new-tokens", "5"]
    assert cli(["generate", str(tmp_path / "ckpt"), *ids]) == 0
    assert capsys.readouterr().out == text  # ids in, text out: the checkpoint has a tokenizer
    assert cli(["import-hf", str(DATA / "gpt2"), "--out", str(tmp_path / "bare")]) == 0
    capsys.readouterr()
    assert cli(["generate", str(tmp_path / "bare"), *ids]) == 0
    assert capsys.readouterr().out == " ".join(map(str, want)) + "\n"  # no tokenizer: ids


@pytest.mark.parametrize(
    "extra, words",
    [
        (["--prompt", "t1 t2", "--tokenizer", "nowhere.json"], r"nowhere.json is missing"),
        (["--ids", "1,2", "--temperature", "-1"], r"`temperature` must be a finite number >= 0"),
        (["--ids", "1,200"], r"token id 200, outside the vocabulary \[0, 96\)"),
        (["--ids", "1,2", "--max-new-tokens", "0"], r"`max_new_tokens` must be a positive integer"),
    ],
)
def test_generate_from_the_command_line_refuses_in_one_line(tmp_path, capsys, extra, words):
    assert cli(["import-hf", str(DATA / "gpt2"), "--out", str(tmp_path / "ckpt")]) == 0
    capsys.readouterr()
    assert cli(["generate", str(tmp_path / "ckpt"), *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dense-armor generate: error: ") and re.search(words, err), err


def test_generate_needs_a_tokenizer_for_text_and_a_language_model(tmp_path, capsys):
    assert cli(["import-hf", str(DATA / "gpt2"), "--out", str(tmp_path / "ckpt")]) == 0
    assert cli(["generate", str(tmp_path / "ckpt"), "--prompt", "hello"]) == 2
    assert "--prompt needs a tokenizer" in capsys.readouterr().err
    tokenizer = word_tokenizer(tmp_path / "tokenizer.json")
    assert load_tokenizer(tokenizer).encode("t5 t7").ids == [5, 7]
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(HuggingFaceError, match=r"bad.json is not a readable tokenizer.json"):
        load_tokenizer(tmp_path / "bad.json")
