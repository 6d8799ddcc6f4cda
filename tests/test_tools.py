"""Tool calls (`serving.tools`): each format's parser against calls written as its model family
writes them (the formats' published examples), the request's tools and tool choice checked, and
`tool_choice` "required" or a named function enforced by the grammar on a tiny byte model: its
tokens the constrained greedy decoding computed here from the full logits, parsed into a call
whose arguments are valid for the function's parameters (the `jsonschema` package)."""

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dense_armor.nn.models.language_model import TransformerLM
from dense_armor.serving import Server
from dense_armor.serving.grammar import Grammars
from dense_armor.serving.protocol import ApiError
from dense_armor.serving.tools import FORMATS, call_grammar, check_tools, parse_calls

llguidance = pytest.importorskip("llguidance", reason="the test extra installs llguidance")
jsonschema = pytest.importorskip("jsonschema", reason="the test extra installs jsonschema")

TOKENIZER = pathlib.Path(__file__).parent / "data" / "chat" / "tokenizer.json"  # byte tokens
WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["Oslo", "Paris", "Lima"]}, "days": {"enum": [1, 2, 3]}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}}},
]  # fmt: skip


def _tools(choice="auto", parallel=None):
    body = {"tools": TOOLS, "tool_choice": choice}
    if parallel is not None:
        body["parallel_tool_calls"] = parallel
    return check_tools(body)


@pytest.mark.parametrize(
    "form, text, content",
    [
        ("hermes", 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": '
         '"Oslo", "days": 2}}\n</tool_call>', "Let me look."),
        ("llama3", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo", '
         '"days": 2}}', None),
        ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Oslo", '
         '"days": 2}}]', None),
    ],
)  # fmt: skip
def test_each_format_s_calls_are_parsed_into_openai_s_objects(form, text, content):
    got, calls = parse_calls(text, form, _tools())
    assert got == content
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo", "days": 2}
    assert calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")


def test_several_calls_text_without_calls_and_unknown_tools():
    two = (
        '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>\n'
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Lima", "days": 1}}</tool_call>'
    )
    _, calls = parse_calls(two, "hermes", _tools())
    assert [c["function"]["name"] for c in calls] == ["get_time", "get_weather"]
    _, calls = parse_calls('{"name": "a", "parameters": {}}; {"name": "b"}', "llama3", _tools())
    assert calls == []  # names not among the tools: the text is the content
    for form in FORMATS:
        assert parse_calls("It is sunny.", form, _tools()) == ("It is sunny.", [])
    broken = '<tool_call>{"name": "get_time", "arguments": {"zone": </tool_call>'
    assert parse_calls(broken, "hermes", _tools()) == (broken, [])


@pytest.mark.parametrize(
    "body, field",
    [
        ({"tools": "get_weather"}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0]"),
        ({"tools": [{"type": "code"}]}, "tools[0]"),
        ({"tools": TOOLS + TOOLS[:1]}, "tools[2]"),  # a name given twice
        ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
         "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
    ],
)  # fmt: skip
def test_bad_tools_are_refused_naming_the_field(body, field):
    with pytest.raises(ApiError) as caught:
        check_tools(body)
    assert caught.value.param == field


def _admissible(grammar, tokens, vocab):
    tokenizer = llguidance.LLTokenizer(str(TOKENIZER), n_vocab=vocab)
    matcher = llguidance.LLMatcher(tokenizer, llguidance.LLMatcher.grammar_from_lark(grammar))
    assert matcher.consume_tokens(list(tokens))
    if matcher.is_stopped():
        return []
    return [t for t in range(vocab) if matcher.validate_tokens([t]) == 1]


def _constrained_greedy(model, prompt, grammar, most):
    out = []
    while len(out) < most and (allowed := _admissible(grammar, out, model.vocab)):
        ids = prompt + out
        padded = jnp.asarray(ids + [0] * (-(-len(ids) // 64) * 64 - len(ids)))
        logits = np.asarray(model(padded))[len(ids) - 1].astype(np.float64)
        out.append(max(allowed, key=lambda t: logits[t]))
    return out


@pytest.mark.parametrize("form", FORMATS)
@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_time"}}]
)
def test_a_demanded_call_is_the_constrained_greedy_one_and_valid(form, choice):
    model = TransformerLM(256, 32, 4, 64, 2, jax.random.PRNGKey(5), 192, n_kv_heads=2)
    tools = _tools(choice, parallel=False)
    grammar = call_grammar(tools, form)
    server = Server(model, 2, 192, structured=True)
    prompt = list(b"weather? ")
    server.submit(prompt, 120, constraint=Grammars(TOKENIZER, 256).lark(grammar))
    (done,) = list(server.run())
    assert done.tokens.tolist() == _constrained_greedy(model, prompt, grammar, 120)
    assert done.reason == "stop"
    _, calls = parse_calls(bytes(done.tokens.tolist()).decode(), form, tools)
    assert len(calls) == 1
    name = calls[0]["function"]["name"]
    assert name == "get_time" or choice == "required"
    jsonschema.validate(json.loads(calls[0]["function"]["arguments"]), tools.functions[name])


def test_auto_and_none_demand_nothing():
    assert call_grammar(_tools("auto"), "hermes") is None
    assert call_grammar(_tools("none"), "mistral") is None
    several = call_grammar(_tools("required"), "hermes")
    assert several is not None and "call+" in several  # parallel calls unless refused
