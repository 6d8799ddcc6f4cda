"""Text out of token streams (`serving.text.TextStream`) and chat prompts (`serving.chat`), with
the byte-level tokenizer of `tests/data/chat` (an id per UTF-8 byte, so every multi-byte
character is split across tokens) and transformers' renderings of its chat template."""

import json
import pathlib

import pytest

pytest.importorskip("jinja2", reason="the serve extra's jinja2 renders chat templates")

from dense_armor.huggingface import load_tokenizer
from dense_armor.serving.chat import ChatError, ChatTemplate
from dense_armor.serving.protocol import ApiError, Defaults, parse_chat, parse_completion
from dense_armor.serving.text import TextStream

CHAT = pathlib.Path(__file__).parent / "data" / "chat"
TEXT = "naïve café → 日本語 🙂 done.\nend"


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(CHAT)


def _pieces(tokenizer, text, stop=()):
    stream = TextStream(tokenizer, stop)
    pieces = [stream.push(b) for b in text.encode()]
    pieces.append(stream.finish())
    return pieces, stream


def test_only_whole_characters_are_sent_and_they_add_up_to_the_text(tokenizer):
    pieces, stream = _pieces(tokenizer, TEXT)
    assert "".join(pieces) == TEXT == stream.text and not stream.stopped
    assert all("\ufffd" not in p for p in pieces)
    # "🙂" is 4 bytes: nothing is sent for its first 3, all of it with the 4th
    start = len(TEXT[: TEXT.index("🙂")].encode())
    assert pieces[start : start + 3] == ["", "", ""] and pieces[start + 3] == "🙂"


@pytest.mark.parametrize(
    ("stop", "want"),
    [
        (["日本"], "naïve café → "),  # multi-byte, across six tokens
        (["é →", "zzz"], "naïve caf"),  # the earliest of several
        (["done.\ne"], "naïve café → 日本語 🙂 "),  # across a newline
        (["end"], "naïve café → 日本語 🙂 done.\n"),  # at the very end
        (["nope", "café!"], TEXT),  # a prefix that never completes: all sent at the end
    ],
)
def test_a_stop_string_cuts_the_text_before_it_across_tokens(tokenizer, stop, want):
    pieces, stream = _pieces(tokenizer, TEXT, stop)
    assert "".join(pieces) == want == stream.text
    assert stream.stopped == (want != TEXT)


def test_text_that_could_begin_a_stop_string_is_held_until_it_cannot(tokenizer):
    stream = TextStream(tokenizer, ["abc"])
    assert [stream.push(b) for b in b"xab"] == ["x", "", ""]  # "ab" could begin "abc"
    assert stream.push(ord("d")) == "abd"  # it did not
    assert [stream.push(b) for b in b"zabc"] == ["z", "", "", ""] and stream.stopped
    assert stream.text == "xabdz" and stream.push(ord("q")) == "" and stream.finish() == ""


def test_the_chat_template_renders_as_transformers_does():
    template = ChatTemplate.from_directory(CHAT)
    golden = json.loads((CHAT / "golden.json").read_text())
    for case in golden["renders"]:
        assert template.render(case["messages"], case["add_generation_prompt"]) == case["text"]
    with pytest.raises(ChatError, match=golden["bad_role_error"]):
        template.render([{"role": "tool", "content": "x"}])


def test_templates_see_special_tokens_and_stay_in_the_sandbox(tmp_path):
    plain = ChatTemplate(
        "{{ bos_token }}{% for m in messages %}[{{ m.content }}]{% endfor %}", {"bos_token": "<s>"}
    )
    assert plain.render([{"role": "user", "content": "hi"}]) == "<s>[hi]"
    escape = ChatTemplate("{{ messages.__class__.__mro__ }}")
    with pytest.raises(ChatError):
        escape.render([{"role": "user", "content": "x"}])
    with pytest.raises(ChatError, match="underscore"):
        ChatTemplate("{% set ns = namespace(_x=1) %}").render([])
    with pytest.raises(ChatError, match="does not compile"):
        ChatTemplate("{% for %}")
    with pytest.raises(ChatError, match="no chat template"):
        ChatTemplate.from_directory(tmp_path)
    (tmp_path / "chat_template.jinja").write_text("{{ messages | length }}")
    assert ChatTemplate.from_directory(tmp_path).render([{"role": "user", "content": ""}]) == "1"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "m", "prompt": "x", "top_p": 0}, "top_p"),
        ({"model": "m", "prompt": "x", "temperature": "1"}, "temperature"),
        ({"model": "m", "prompt": "x", "temperature": float("inf")}, "temperature"),
        ({"model": "m", "prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"model": "m", "prompt": "x", "stop": ["a"] * 17}, "stop"),
        ({"model": "m", "prompt": "x", "stop": [""]}, "stop"),
        ({"model": "m", "prompt": "x", "stop_token_ids": [-1]}, "stop_token_ids"),
        ({"model": "m", "prompt": ["a", 3]}, "prompt"),
        ({"model": "m", "prompt": [[1, 2], []]}, "prompt"),
        ({"model": "m", "prompt": "x", "n": 0}, "n"),
        ({"model": "m", "prompt": "x", "echo": "yes"}, "echo"),
        ({"model": "m", "prompt": "x", "logprobs": 1}, "logprobs"),  # a server scoring none
        ({"model": "m", "prompt": "x", "best_of": 3}, "best_of"),
        ({"model": "m", "prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
        ({"model": "m", "prompt": "x", "frequency_penalty": "1"}, "frequency_penalty"),
        ({"model": "m", "prompt": "x", "repetition_penalty": -1}, "repetition_penalty"),
        ({"model": "m", "prompt": "x", "logit_bias": {"256": 2}}, "logit_bias"),
        ({"model": "m", "prompt": "x", "logit_bias": {"a": 2}}, "logit_bias"),
        ({"model": "m", "prompt": "x", "logit_bias": {"-1": 2}}, "logit_bias"),
        ({"model": "m", "prompt": "x", "logit_bias": {"1": 101}}, "logit_bias"),
        ({"model": "m", "prompt": "x", "logit_bias": {"1": 2, "01": 3}}, "logit_bias"),
        ({"model": "m", "prompt": "x", "logit_bias": [1, 2]}, "logit_bias"),
        (
            {"model": "m", "prompt": "x", "stream_options": {"include_usage": "yes"}},
            "stream_options",
        ),
        ({"model": 3, "prompt": "x"}, "model"),
    ],
)
def test_the_protocol_refuses_each_bad_field_by_name(body, param):
    with pytest.raises(ApiError) as caught:
        parse_completion(body, 256)
    assert caught.value.param == param and caught.value.status == 400


def test_the_protocol_reads_openais_defaults_and_chat_fields():
    ask = parse_completion({"model": "m", "prompt": [[1, 2, 3]], "top_k": -1}, 256)
    # fields left out stay unset: the server's `Defaults` fill them, OpenAI's unless it says
    assert (ask.prompts, ask.temperature, ask.top_k, ask.top_p, ask.max_tokens) == (
        [[1, 2, 3]],
        None,
        None,
        None,
        None,
    )
    assert Defaults().temperature == 1.0 and Defaults().max_tokens is None
    chat = parse_chat(
        {
            "model": "m",
            "max_completion_tokens": 5,
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                }
            ],
            "response_format": {"type": "text"},
            "n": 1,
            "logprobs": False,
            "user": "u",
        },
        256,
    )
    assert chat.messages[0]["content"] == "ab" and chat.max_tokens == 5
    assert chat.response_format is None  # text
    asked = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    json_object = {"type": "json_object"}
    assert parse_chat({**asked, "response_format": json_object}, 256).response_format == (
        "json_object",
    )
    schema = {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "string"}}}
    parsed = parse_chat({**asked, "response_format": schema}, 256).response_format
    assert parsed == ("json_schema", {"type": "string"}, True)
    bad_forms = (
        {"type": "xml"}, "json", {"type": "json_schema", "json_schema": {"schema": 3}},
        {"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}},
    )  # fmt: skip
    for bad in bad_forms:
        with pytest.raises(ApiError, match="response_format") as caught:
            parse_chat({**asked, "response_format": bad}, 256)
        assert caught.value.param == "response_format"
