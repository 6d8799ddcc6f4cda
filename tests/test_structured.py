"""Structured output (`serving.grammar`, `Server(structured=True)`): a constrained request's
tokens against a constrained greedy decoding computed here from the model's full logits (each
token's admissibility asked of a fresh grammar state token by token, the argmax taken in NumPy),
its text valid for its schema (the `jsonschema` package), the mask's bits against NumPy's, and
an unconstrained request beside it unchanged."""

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dense_armor.nn.models.generation import generate
from dense_armor.nn.models.language_model import TransformerLM
from dense_armor.nn.penalties import allowed_tokens, history, mask_words, penalised
from dense_armor.serving import Server
from dense_armor.serving.grammar import GrammarError, Grammars

llguidance = pytest.importorskip("llguidance", reason="the test extra installs llguidance")
jsonschema = pytest.importorskip("jsonschema", reason="the test extra installs jsonschema")

TOKENIZER = pathlib.Path(__file__).parent / "data" / "chat" / "tokenizer.json"  # byte tokens
SCHEMA = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}, "sure": {"type": "boolean"}},
    "required": ["answer", "sure"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def model():
    return TransformerLM(256, 32, 4, 64, 2, jax.random.PRNGKey(3), 96, n_kv_heads=2)


def _admissible(tokens, schema, vocab=256):
    """The tokens a fresh grammar of `schema` accepts after `tokens`, each asked on its own."""
    tokenizer = llguidance.LLTokenizer(str(TOKENIZER), n_vocab=vocab)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, {"whitespace_flexible": False})
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    assert matcher.consume_tokens(list(tokens))
    if matcher.is_stopped():
        return []
    return [t for t in range(vocab) if matcher.validate_tokens([t]) == 1]


def constrained_greedy(model, prompt, schema, most):
    """Greedy decoding of `prompt`, each token the argmax of the model's logits over the tokens
    the schema admits there, until the grammar is complete or `most` tokens."""
    out = []
    while len(out) < most:
        allowed = _admissible(out, schema, model.vocab)
        if not allowed:
            break
        ids = prompt + out
        room = -(-len(ids) // 64) * 64  # causal: the padding to a multiple of 64 changes nothing
        padded = jnp.asarray(ids + [0] * (room - len(ids)))
        logits = np.asarray(model(padded))[len(ids) - 1].astype(np.float64)
        out.append(max(allowed, key=lambda t: logits[t]))
    return out


@pytest.mark.parametrize(
    "options", [{}, {"pages": 24, "page_size": 4}, {"decode_steps": 3}], ids=["fixed", "paged", "3"]
)
def test_constrained_tokens_are_the_constrained_greedy_decoding(model, options):
    grammars = Grammars(TOKENIZER, model.vocab)
    server = Server(model, 2, 64, structured=True, **options)
    prompts = [list(b"ok? "), list(b"free "), list(b"no ")]
    free = server.submit(prompts[1], 6)
    ids = [server.submit(p, 40, constraint=grammars.json_schema(SCHEMA)) for p in prompts[::2]]
    done = {c.id: c for c in server.run()}
    for prompt, i in zip(prompts[::2], ids, strict=True):
        tokens = done[i].tokens.tolist()
        assert tokens == constrained_greedy(model, prompt, SCHEMA, 40)
        assert done[i].reason == "stop"  # the grammar is complete
        jsonschema.validate(json.loads(bytes(tokens).decode()), SCHEMA)
    solo = np.asarray(generate(model, [prompts[1]], 6).tokens)[0]
    np.testing.assert_array_equal(done[free].tokens, solo)


def test_the_mask_s_bits_are_numpys_and_only_masked_rows_change():
    rng = np.random.default_rng(0)
    vocab = 70  # not a multiple of 32: the last word's high bits are past the vocabulary
    words = rng.integers(-(2**31), 2**31, (3, mask_words(vocab)), dtype=np.int64).astype(np.int32)
    bits = np.unpackbits(words.view(np.uint8), axis=-1, bitorder="little")[:, :vocab]
    np.testing.assert_array_equal(np.asarray(allowed_tokens(jnp.asarray(words), vocab)), bits)
    past = history(3, vocab)
    past = past._replace(allowed=jnp.asarray(words), masked=jnp.array([True, False, True]))
    logits = jnp.asarray(rng.normal(size=(3, vocab)), jnp.float32)
    out = np.asarray(penalised(logits, past, jnp.arange(3)))
    expected = np.where(bits.astype(bool), np.asarray(logits), -np.inf)
    expected[1] = np.asarray(logits[1])  # its mask is off: bit for bit as it was
    np.testing.assert_array_equal(out, expected)


def test_a_schema_the_engine_cannot_compile_and_a_server_without_grammars_are_refused(model):
    grammars = Grammars(TOKENIZER, model.vocab)
    with pytest.raises(GrammarError, match="cannot be compiled") as caught:
        grammars.json_schema({"type": "frob"})
    assert caught.value.field == "response_format"
    with pytest.raises(GrammarError):
        grammars.json_schema(["not", "an", "object"])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="structured=True"):
        Server(model, 2, 64).submit([1, 2], 4, constraint=grammars.json_object())
    with pytest.raises(TypeError, match="structured"):
        Server(model, 2, 64, structured="yes")


def test_ever_new_schemas_keep_only_the_latest_compiled_and_each_still_works(model, monkeypatch):
    from dense_armor.serving import grammar

    monkeypatch.setattr(grammar, "COMPILED_KEPT", 2)
    grammars = Grammars(TOKENIZER, model.vocab)
    schemas = [{"type": "integer", "maximum": n} for n in (1, 2, 3)]
    for schema in schemas:
        grammars.json_schema(schema)
    assert len(grammars.compiled) == 2  # the first one let go
    words = np.zeros(mask_words(model.vocab), np.int32)
    grammars.json_schema(schemas[0]).fill(words)  # compiled again: a mask of its own
    assert words.any() and len(grammars.compiled) == 2
    with pytest.raises(GrammarError, match="the grammar cannot be compiled"):
        grammars.lark("start: undefined_rule")


def test_nothing_compiles_after_warm_up_with_constrained_requests(model):
    from test_serving import Traces

    grammars = Grammars(TOKENIZER, model.vocab)
    server = Server(model, 2, 64, structured=True, decode_steps=3, pages=24, page_size=4)
    server.warm_up()
    with Traces() as traces:
        server.submit(list(b"a"), 5)
        for prompt in (b"x", b"long prompt "):
            server.submit(list(prompt), 30, constraint=grammars.json_schema(SCHEMA))
        server.submit(list(b"b"), 7, constraint=grammars.json_object())
        done = list(server.run())
    assert len(done) == 4 and traces.count == 0
