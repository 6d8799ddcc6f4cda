"""The OpenAI-compatible HTTP server, through the official `openai` client against a real uvicorn
process on 127.0.0.1 (`dense-armor serve --http`), serving the trained byte model of
examples/language_model.py with the byte-level tokenizer and chat template of `tests/data/chat`.

References: `generate` of the same checkpoint in this process (greedy and seeded), the decoded
text cut by hand at a stop string, transformers' rendering of the chat template (committed by
tests/torch_reference/make_chat_golden.py), OpenAI's error object. Every loop is bounded in count
and in time; the server listens on loopback only.
"""

import concurrent.futures
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import threading
import time
import typing
import urllib.error
import urllib.request

import jax
import numpy as np
import pytest

openai = pytest.importorskip("openai", reason="the test extra installs the openai client")

from dense_armor.checkpoints import load_checkpoint  # noqa: E402
from dense_armor.huggingface import load_tokenizer  # noqa: E402
from dense_armor.nn.models.generation import generate  # noqa: E402
from dense_armor.nn.penalties import Penalties  # noqa: E402

DATA = pathlib.Path(__file__).parent / "data"
BYTES, CHAT = DATA / "byte_lm", DATA / "chat"
NAME, SLOTS, MAX_QUEUE, CONTEXT, PAGES = "byte-lm", 4, 64, 148, 40
START_TIMEOUT, REQUEST_TIMEOUT = 240, 120
DEFAULT_NEW = 8  # the server's --max-new-tokens
PROMPTS = [
    "def main(",
    "import os\n",
    "class Pa",
    "    return ",
    "for i in ",
    "x = [",
    "# The ",
    "if __name__",
    "    def __",
    "try:\n    ",
    "from . import",
    "while Tr",
]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A `dense-armor serve --http` process: (base URL, its pid); stopped after the module."""
    command = [
        sys.executable,
        "-m",
        "dense_armor.cli",
        "serve",
        str(BYTES),
        "--http",
        "--port",
        "0",
        "--slots",
        str(SLOTS),
        "--max-queue",
        str(MAX_QUEUE),
        "--name",
        NAME,
        "--capacity",
        str(CONTEXT),
        "--tokenizer",
        str(CHAT),
        "--pages",  # the paged cache, prefixes shared: 39 pages of 16, 624 positions
        str(PAGES),
        "--page-size",
        "16",
        "--temperature",  # the defaults of requests that set none
        "0",
        "--max-new-tokens",
        str(DEFAULT_NEW),
    ]
    log = tmp_path_factory.mktemp("http") / "server.log"
    with open(log, "w") as errors:
        process = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=errors,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    try:
        line = _first_line(process, START_TIMEOUT)
        match = re.search(r"on (http://127\.0\.0\.1:\d+)", line or "")
        assert match is not None, f"the server did not start: {line!r} {log.read_text()[-3000:]}"
        yield match.group(1), process.pid
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=30)
        process.stdout.close()


def _first_line(process, timeout):
    box = []
    reader = threading.Thread(target=lambda: box.append(process.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    return box[0] if box else None


@pytest.fixture(scope="module")
def reference():
    """The checkpoint's model and the tokenizer, in this process."""
    return load_checkpoint(BYTES).model, load_tokenizer(CHAT)


_CLIENTS = []  # each test's clients, closed after it (an unclosed socket is an error here)


@pytest.fixture(autouse=True)
def _close_clients():
    yield
    while _CLIENTS:
        _CLIENTS.pop().close()


def _client(url, path="/v1", timeout=REQUEST_TIMEOUT):
    client = openai.OpenAI(base_url=f"{url}{path}", api_key="none", max_retries=0, timeout=timeout)
    _CLIENTS.append(client)
    return client


def _solo(reference, prompts, new, **sampling):
    """`generate`'s decoded text of each prompt (solo rows of one call)."""
    model, tokenizer = reference
    ids = [list(p.encode()) for p in prompts]
    tokens = np.asarray(generate(model, ids, new, **sampling).tokens)
    return [tokenizer.decode(row.tolist()) for row in tokens]


def test_greedy_completions_are_generates_text_streamed_or_not(served, reference):
    url, _ = served
    client = _client(url)
    want = _solo(reference, PROMPTS[:3], 24)
    for prompt, text in zip(PROMPTS[:3], want, strict=True):
        answer = client.completions.create(model=NAME, prompt=prompt, max_tokens=24, temperature=0)
        assert answer.choices[0].text == text and answer.choices[0].finish_reason == "length"
        assert answer.object == "text_completion" and answer.model == NAME
        assert answer.usage.prompt_tokens == len(prompt.encode())
        assert answer.usage.completion_tokens == 24 and answer.usage.total_tokens == 24 + len(
            prompt.encode()
        )
        chunks = list(
            client.completions.create(
                model=NAME,
                prompt=prompt,
                max_tokens=24,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        streamed = "".join(c.choices[0].text for c in chunks if c.choices)
        assert streamed == text
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    ids = list(PROMPTS[0].encode())  # a prompt of token ids
    answer = client.completions.create(model=NAME, prompt=ids, max_tokens=24, temperature=0)
    assert answer.choices[0].text == want[0]


def test_a_repeated_prompt_reports_its_shared_tokens_as_cached(served, reference):
    # pages of 16: a first 40-byte prompt computes all; the same again finds its first 32
    # tokens in shared pages; one that shares the first 20 bytes finds one page, 16 tokens.
    url, _ = served
    client = _client(url)
    prompt = "The cached pages of a prompt that repeats"[:40]
    (want,) = _solo(reference, [prompt], 8)
    cached = []
    for text in (prompt, prompt, prompt[:20] + "X" * 20):
        answer = client.completions.create(model=NAME, prompt=text, max_tokens=8, temperature=0)
        assert answer.usage.prompt_tokens == 40
        cached.append(answer.usage.prompt_tokens_details.cached_tokens)
        if text == prompt:
            assert answer.choices[0].text == want
    assert cached == [0, 32, 16]


def test_stop_strings_end_the_text_across_token_boundaries(served, reference):
    url, _ = served
    client = _client(url)
    (full,) = _solo(reference, [PROMPTS[1]], 40)
    stop = full[10:13]  # three bytes: three tokens of the byte model
    cut = full[: full.index(stop)]
    for stream in (False, True):
        made = client.completions.create(
            model=NAME,
            prompt=PROMPTS[1],
            max_tokens=40,
            temperature=0,
            stop=[stop, "\x00never"],
            stream=stream,
        )
        if stream:
            chunks = list(made)
            text = "".join(c.choices[0].text for c in chunks)
            reason = chunks[-1].choices[0].finish_reason
        else:
            text, reason = made.choices[0].text, made.choices[0].finish_reason
        assert (text, reason) == (cut, "stop")


def test_a_chat_is_rendered_as_transformers_renders_it(served, reference):
    url, _ = served
    client = _client(url)
    golden = json.loads((CHAT / "golden.json").read_text())["renders"]
    for case in golden:
        if not case["add_generation_prompt"] or any("meta" in m for m in case["messages"]):
            continue  # the server renders with the generation prompt; meta is not OpenAI's
        (want,) = _solo(reference, [case["text"]], 12)
        answer = client.chat.completions.create(
            model=NAME, messages=case["messages"], max_tokens=12, temperature=0
        )
        assert answer.choices[0].message.content == want
        assert answer.choices[0].message.role == "assistant"
        assert answer.usage.prompt_tokens == len(case["text"].encode())
        chunks = list(
            client.chat.completions.create(
                model=NAME, messages=case["messages"], max_tokens=12, temperature=0, stream=True
            )
        )
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
        assert chunks[-1].choices[0].finish_reason == "length"


def test_response_format_gives_the_constrained_greedy_text_valid_for_its_schema(served, reference):
    """A chat answer under a JSON schema, streamed or not: the constrained greedy decoding of the
    rendered prompt (tests/test_structured.py's, from the full logits), valid for the schema; the
    client's `parse` with a Pydantic model reads it; `json_object` gives an object."""
    pydantic = pytest.importorskip("pydantic", reason="the openai client installs pydantic")
    jsonschema = pytest.importorskip("jsonschema", reason="the test extra installs jsonschema")
    from test_structured import SCHEMA, constrained_greedy

    url, _ = served
    client = _client(url)
    case = json.loads((CHAT / "golden.json").read_text())["renders"][0]
    model, tokenizer = reference
    want = tokenizer.decode(constrained_greedy(model, list(case["text"].encode()), SCHEMA, 40))
    form = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": SCHEMA}}
    asked = dict(model=NAME, messages=case["messages"], max_tokens=40, temperature=0)
    answer = client.chat.completions.create(**asked, response_format=form)
    assert answer.choices[0].message.content == want
    assert answer.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(want), SCHEMA)
    chunks = list(client.chat.completions.create(**asked, response_format=form, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want

    class Verdict(pydantic.BaseModel):
        answer: typing.Literal["yes", "no"]
        sure: bool

    parsed = client.chat.completions.parse(**asked, response_format=Verdict)
    assert isinstance(parsed.choices[0].message.parsed, Verdict)
    anything = client.chat.completions.create(**asked, response_format={"type": "json_object"})
    text = anything.choices[0].message.content
    assert text.startswith("{") and (anything.choices[0].finish_reason == "length" or
                                      isinstance(json.loads(text), dict))  # fmt: skip


def test_a_demanded_tool_call_comes_back_as_the_clients_tool_calls(served):
    """`tools` with `tool_choice` required or a named function: the call the grammar enforces
    (tests/test_tools.py checks it against the constrained greedy decoding), read by the
    official client's types, streamed or not, its arguments valid for the function; a choice
    that names no tool is refused naming `tool_choice`. (Short names: a byte is a token, and
    the context is 148.)"""
    jsonschema = pytest.importorskip("jsonschema", reason="the test extra installs jsonschema")

    small = {"type": "object", "properties": {"x": {"enum": [1, 2]}}, "required": ["x"],
             "additionalProperties": False}  # fmt: skip
    tools = [{"type": "function", "function": {"name": n, "parameters": small}} for n in "fg"]
    client = _client(served[0])
    messages = [{"role": "user", "content": "Go"}]
    asked = dict(model=NAME, messages=messages, max_tokens=64, temperature=0, tools=tools,
                 parallel_tool_calls=False)  # fmt: skip
    for choice in ("required", {"type": "function", "function": {"name": "g"}}):
        answer = client.chat.completions.create(**asked, tool_choice=choice)
        (call,) = answer.choices[0].message.tool_calls
        assert answer.choices[0].finish_reason == "tool_calls" and call.type == "function"
        assert call.function.name == "g" or choice == "required"
        jsonschema.validate(json.loads(call.function.arguments), small)
        chunks = list(client.chat.completions.create(**asked, tool_choice=choice, stream=True))
        streamed = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
        assert [(d.function.name, d.function.arguments) for d in streamed] == [
            (call.function.name, call.function.arguments)
        ]
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            **asked, tool_choice={"type": "function", "function": {"name": "nope"}}
        )
    assert caught.value.body["param"] == "tool_choice"


def test_lm_evaluation_harness_scores_a_shipped_task_as_the_model_does(
    served, reference, tmp_path, monkeypatch
):
    """lm-evaluation-harness's `local-completions` (tokenizing through the server: `/tokenize`,
    `/detokenize`, `/tokenizer_info`) on tests/data/lm_eval's multiple-choice task: each
    choice's log-likelihood equals the model's own (float64 log-softmax of its logits here),
    and its accuracy that of choosing by them."""
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    lm_eval = pytest.importorskip("lm_eval", reason="the test extra installs lm-eval")
    from lm_eval.tasks import TaskManager

    data = DATA / "lm_eval" / "code_endings.jsonl"
    (tmp_path / "task.yaml").write_text(
        "task: code_endings\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
        "output_type: multiple_choice\ndoc_to_text: '{{question}}'\n"
        "doc_to_choice: '{{choices}}'\ndoc_to_target: '{{answer}}'\ntarget_delimiter: ''\n"
        "metric_list:\n  - metric: acc\n"
    )
    url, _ = served
    arguments = (f"model={NAME},base_url={url}/v1/completions,tokenizer_backend=remote,"
                 "tokenized_requests=True,num_concurrent=1,max_retries=1,timeout=120")  # fmt: skip
    found = lm_eval.simple_evaluate(
        model="local-completions", model_args=arguments, tasks=["code_endings"],
        task_manager=TaskManager(include_path=str(tmp_path)), log_samples=True,
    )  # fmt: skip
    model, _ = reference
    right = []
    for sample in found["samples"]["code_endings"]:
        doc = sample["doc"]
        ours = [_loglikelihood(model, doc["question"], c) for c in doc["choices"]]
        theirs = [float(r[0]) for (r,) in sample["resps"]]
        np.testing.assert_allclose(theirs, ours, atol=1e-4, rtol=1e-5)
        right.append(int(np.argmax(ours)) == doc["answer"])
    assert found["results"]["code_endings"]["acc,none"] == pytest.approx(np.mean(right))


def _loglikelihood(model, context, continuation):
    """The log-probability of `continuation`'s bytes after `context`'s, float64 log-softmax, the
    request split as the harness splits it (a context's trailing whitespace scored with the
    continuation)."""
    kept = context.rstrip()
    ids, first = list((context + continuation).encode()), len(kept.encode())
    logits = np.asarray(model(jax.numpy.asarray(ids)), np.float64)[first - 1 : len(ids) - 1]
    logits -= logits.max(axis=-1, keepdims=True)
    scores = logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))
    return float(sum(scores[k, t] for k, t in enumerate(ids[first:])))


def test_penalties_and_logit_bias_give_generates_text(served, reference):
    """OpenAI's `presence_penalty`, `frequency_penalty` and `logit_bias` and vLLM's
    `repetition_penalty` through the official client: `generate`'s text with the same
    `Penalties`, greedy and seeded; a bias of 100 on one byte makes every token that byte."""
    url, _ = served
    client = _client(url)
    bias = ((ord("x"), 3.0), (ord(" "), -100.0))
    penalties = Penalties(presence=0.5, frequency=0.8, repetition=1.4, logit_bias=bias)
    for seed, temperature in ((None, 0.0), (5, 0.9)):
        key = None if seed is None else jax.random.PRNGKey(seed)
        (want,) = _solo(
            reference, [PROMPTS[1]], 16, key=key, temperature=temperature, penalties=penalties
        )
        answer = client.completions.create(
            model=NAME, prompt=PROMPTS[1], max_tokens=16, temperature=temperature, seed=seed,
            presence_penalty=0.5, frequency_penalty=0.8,
            logit_bias={str(t): v for t, v in bias}, extra_body={"repetition_penalty": 1.4},
        )  # fmt: skip
        assert answer.choices[0].text == want
        assert want != _solo(reference, [PROMPTS[1]], 16, key=key, temperature=temperature)[0]
    chat = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0,
        logit_bias={str(ord("z")): 100},
    )  # fmt: skip
    assert chat.choices[0].message.content == "z" * 6


def test_a_seed_gives_generates_sampled_text_and_the_same_text_again(served, reference):
    url, _ = served
    client = _client(url)
    rules = dict(temperature=0.8, top_k=40, top_p=0.95)
    (want,) = _solo(reference, [PROMPTS[2]], 20, key=jax.random.PRNGKey(7), **rules)
    texts = [
        client.completions.create(
            model=NAME,
            prompt=PROMPTS[2],
            max_tokens=20,
            seed=7,
            temperature=0.8,
            top_p=0.95,
            extra_body={"top_k": 40},
        )
        .choices[0]
        .text
        for _ in range(2)
    ]
    assert texts == [want, want]


BAD = [  # (request body, status, the field named)
    ({"model": NAME, "prompt": "x", "temperature": -1}, 400, "temperature"),
    ({"model": NAME, "prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ({"model": NAME, "prompt": "x", "max_tokens": "8"}, 400, "max_tokens"),
    ({"model": NAME, "prompt": "x", "max_tokens": True}, 400, "max_tokens"),
    ({"model": NAME, "prompt": "x" * 100, "max_tokens": 60}, 400, "max_tokens"),
    ({"model": NAME, "prompt": "x" * CONTEXT}, 400, "prompt"),
    ({"model": NAME, "prompt": ""}, 400, "prompt"),
    ({"model": NAME, "prompt": [1, 300]}, 400, "prompt"),
    ({"model": NAME, "prompt": "x", "n": 17}, 400, "n"),
    ({"model": NAME, "prompt": ["x"] * 9, "n": 8}, 400, "n"),  # 72 choices
    ({"model": NAME, "prompt": "x", "logprobs": -1}, 400, "logprobs"),
    ({"model": NAME, "prompt": "x", "stop": 5}, 400, "stop"),
    ({"model": NAME, "prompt": "x", "stream": "yes"}, 400, "stream"),
    ({"model": NAME, "prompt": "x", "min_p": float("nan")}, 400, "min_p"),
    ({"model": NAME, "prompt": "x", "top_k": 2.5}, 400, "top_k"),
    ({"model": NAME, "prompt": "x", "seed": -1}, 400, "seed"),
    ({"model": NAME, "prompt": "x", "seed": 2**70}, 400, "seed"),
    ({"model": NAME, "prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ({"model": NAME, "prompt": "x", "logit_bias": {"300": 5}}, 400, "logit_bias"),
    ({"model": NAME, "prompt": "x", "presence_penalty": -2.5}, 400, "presence_penalty"),
    ({"model": NAME, "prompt": "x", "max_token": 3}, 400, "max_token"),  # a misspelt field
    ({"model": NAME, "prompt": "x", "modalities": ["audio"]}, 400, "modalities"),
    ({"model": NAME, "prompt": "x", "response_format": {"type": "yaml"}}, 400, "response_format"),
    (  # a schema the grammar engine cannot compile
        {
            "model": NAME,
            "prompt": "x",
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "s", "schema": {"type": "frob"}},
            },
        },
        400,
        "response_format",
    ),
    ({"model": "gpt-9", "prompt": "x"}, 404, "model"),
    ({"prompt": "x"}, 400, "model"),
    ([1, 2], 400, None),
]
CHAT_BAD = [
    ({"model": NAME, "messages": []}, 400, "messages"),
    ({"model": NAME, "messages": [{"content": "x"}]}, 400, "messages[0]"),
    ({"model": NAME, "messages": [{"role": "tool", "content": "x"}]}, 400, "messages"),
    ({"model": NAME, "messages": [{"role": "user", "content": 3}]}, 400, "messages[0].content"),
]


def _post(url, path, raw):
    request = urllib.request.Request(f"{url}{path}", raw, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [("/v1/completions", *b) for b in BAD] + [("/v1/chat/completions", *b) for b in CHAT_BAD],
)
def test_a_bad_request_is_refused_naming_its_field_and_the_server_serves_on(
    served, path, body, status, param
):
    url, _ = served
    raw = json.dumps(body).encode()  # Python's json writes NaN bare; the server reads, refuses it
    got, answer = _post(url, path, raw)
    assert got == status, answer
    assert set(answer) == {"error"} and set(answer["error"]) == {"message", "type", "param", "code"}
    assert answer["error"]["param"] == param and answer["error"]["message"]
    assert (
        _post(
            url,
            "/v1/completions",
            json.dumps({"model": NAME, "prompt": "x", "max_tokens": 2}).encode(),
        )[0]
        == 200
    )


def test_fields_that_change_nothing_are_accepted_and_null_fields_are_unset(served):
    """OpenAI's bookkeeping fields (`user`, `metadata`, `store`, ...) are accepted and ignored;
    any field set to null is as if left out, a peer's extension among them."""
    url, _ = served
    body = {"model": NAME, "prompt": "x", "max_tokens": 2, "user": "u1", "metadata": {"a": "b"},
            "store": False, "service_tier": "auto", "repetition_penalty": None,
            "n": None}  # fmt: skip
    status, answer = _post(url, "/v1/completions", json.dumps(body).encode())
    assert status == 200, answer
    assert answer["usage"]["completion_tokens"] == 2


def test_the_serve_flags_are_the_defaults_of_requests_that_set_none(served, reference):
    url, _ = served
    (want,) = _solo(reference, [PROMPTS[5]], DEFAULT_NEW)  # greedy: --temperature 0
    client = _client(url)
    texts = [client.completions.create(model=NAME, prompt=PROMPTS[5]) for _ in range(3)]
    assert [t.choices[0].text for t in texts] == [want] * 3
    assert all(t.usage.completion_tokens == DEFAULT_NEW for t in texts)
    # a field the request sets is its own
    (longer,) = _solo(reference, [PROMPTS[5]], DEFAULT_NEW + 4)
    answer = client.completions.create(model=NAME, prompt=PROMPTS[5], max_tokens=DEFAULT_NEW + 4)
    assert answer.choices[0].text == longer


def test_the_servers_default_length_is_cut_to_the_room_a_prompt_leaves():
    from dense_armor.serving.http import _rules
    from dense_armor.serving.protocol import Defaults, parse_completion

    ask = parse_completion({"model": NAME, "prompt": "x"}, 256)
    _, _, new = _rules(ask, 140, (148, "the context (148 tokens)"), Defaults(max_tokens=32))
    assert new == 8
    asked = parse_completion({"model": NAME, "prompt": "x", "max_tokens": 32}, 256)
    with pytest.raises(Exception, match=r"`max_tokens=32` pass the context \(148 tokens\)"):
        _rules(asked, 140, (148, "the context (148 tokens)"), Defaults(max_tokens=32))


def test_a_paged_servers_refusal_names_the_pool_when_the_pool_is_short():
    import types

    from dense_armor.serving.http import _limit, _rules
    from dense_armor.serving.protocol import ApiError, Defaults, parse_completion

    paged = types.SimpleNamespace(longest_request=625, capacity=1024, pool=(40, 16))
    fixed = types.SimpleNamespace(longest_request=1024, capacity=1024, pool=None)
    ask = parse_completion({"model": NAME, "prompt": "x", "max_tokens": 100}, 256)
    with pytest.raises(ApiError, match=r"pass the page pool \(39 pages of 16 positions: 625"):
        _rules(ask, 600, _limit(paged), Defaults())
    with pytest.raises(ApiError, match=r"leaves no room in the context \(1024 tokens\)"):
        _rules(ask, 1024, _limit(fixed), Defaults())


@pytest.mark.parametrize(
    ("method", "path", "raw", "status"),
    [
        ("POST", "/v1/nothing", b"{}", 404),
        ("GET", "/", None, 404),
        ("GET", "/v1/completions", None, 405),
        ("DELETE", "/v1/models", None, 405),
    ],
)
def test_every_refusal_is_openais_error_object(served, method, path, raw, status):
    url, _ = served
    request = urllib.request.Request(f"{url}{path}", raw, method=method)
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT)
    assert caught.value.code == status
    answer = json.loads(caught.value.read())
    assert set(answer) == {"error"} and set(answer["error"]) == {"message", "type", "param", "code"}
    assert path in answer["error"]["message"]


def test_a_body_past_the_limit_is_refused_before_it_is_read(served):
    import socket

    url, _ = served
    host, port = url.removeprefix("http://").split(":")
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {8 * 2**20 + 1}\r\n\r\n"
    )
    with socket.create_connection((host, int(port)), timeout=REQUEST_TIMEOUT) as sock:
        sock.sendall(head.encode() + b" " * 1024)  # a start of the body, never the rest
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            piece = sock.recv(65536)
            if not piece:
                break
            answer += piece
    status, _, body = answer.partition(b"\r\n\r\n")
    assert status.startswith(b"HTTP/1.1 413")
    error = json.loads(body)["error"]
    assert error["code"] == "request_too_large" and str(8 * 2**20) in error["message"]


def test_the_openai_client_reads_a_missing_route_as_not_found(served):
    url, _ = served
    client = _client(url, "/v2", 30)
    with pytest.raises(openai.NotFoundError, match="no such route"):
        client.completions.create(model=NAME, prompt="x")


def test_a_top_k_past_any_vocabulary_keeps_every_token(served, reference):
    url, _ = served
    (want,) = _solo(reference, [PROMPTS[3]], 8)
    answer = _client(url).completions.create(
        model=NAME, prompt=PROMPTS[3], max_tokens=8, temperature=0, extra_body={"top_k": 10**30}
    )
    assert answer.choices[0].text == want


def test_malformed_json_and_the_openai_clients_errors(served):
    url, _ = served
    got, answer = _post(url, "/v1/completions", b'{"model": "byte-lm", "prompt": ')
    assert got == 400 and answer["error"]["type"] == "invalid_request_error"
    client = _client(url)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=NAME, prompt="x", temperature=-0.5)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])


def test_models_health_and_metrics(served):
    url, _ = served
    assert [m.id for m in _client(url).models.list()] == [NAME]
    with urllib.request.urlopen(f"{url}/health", timeout=30) as answer:
        assert json.loads(answer.read())["status"] == "ok"
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as answer:
        text = answer.read().decode()
    for name in (
        "dense_armor_queued_requests",
        "dense_armor_busy_slots",
        "dense_armor_generated_tokens_total",
        "dense_armor_time_to_first_token_seconds",
        "dense_armor_request_latency_seconds",
        "dense_armor_held_pages",
    ):
        assert re.search(rf"^{name}", text, re.M), name
    free = float(re.search(r"^dense_armor_free_pages (\S+)", text, re.M).group(1))
    assert free == PAGES - 1  # every page back (nothing in flight), the null page aside
    tokens = float(re.search(r"^dense_armor_generated_tokens_total (\S+)", text, re.M).group(1))
    assert tokens > 0


def test_concurrent_streams_through_the_slots_each_get_their_solo_text(served, reference):
    url, _ = served
    prompts = [p + str(i % 3) for i in range(2) for p in PROMPTS]  # 24 streams, 4 slots
    want = _solo(reference, prompts, 12)

    def stream(prompt):
        chunks = _client(url).completions.create(
            model=NAME, prompt=prompt, max_tokens=12, temperature=0, stream=True
        )
        return "".join(c.choices[0].text for c in chunks)

    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(stream, prompts, timeout=REQUEST_TIMEOUT * 2))
    assert got == want


def _rss(pid):
    status = pathlib.Path(f"/proc/{pid}/status")
    if not status.exists():
        return None
    return int(re.search(r"VmRSS:\s+(\d+)", status.read_text()).group(1)) * 1024


def _generated(url):
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as answer:
        text = answer.read().decode()
    return float(re.search(r"^dense_armor_generated_tokens_total (\S+)", text, re.M).group(1))


def _settled(url, deadline):
    """The server's /health once nothing is queued or busy (None if not before `deadline`)."""
    while time.monotonic() < deadline:
        with urllib.request.urlopen(f"{url}/health", timeout=30) as answer:
            health = json.loads(answer.read())
        if health["queued"] == 0 and health["busy"] == 0:
            return health
        time.sleep(0.05)
    return None


def _disconnect(url, body, stream):
    """Send a request and leave: after its first event (streaming), or at once."""
    import http.client

    host, port = url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=REQUEST_TIMEOUT)
    connection.request(
        "POST",
        "/v1/completions",
        json.dumps({**body, "stream": stream}),
        {"Content-Type": "application/json"},
    )
    if stream:
        assert connection.getresponse().readline().startswith(b"data: ")
    connection.close()


def test_a_hundred_disconnects_leak_no_slot_queue_entry_or_memory(served):
    url, pid = served
    body = {"model": NAME, "prompt": "def f(", "max_tokens": 140, "temperature": 0}
    _client(url).completions.create(model=NAME, prompt="x", max_tokens=4, stream=True)  # warm
    generated, sizes = _generated(url), []
    for half in range(2):
        for i in range(50):
            _disconnect(url, body, stream=i % 2 == 0)
        assert _settled(url, time.monotonic() + 60) is not None, half
        sizes.append(_rss(pid))
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as answer:
        text = answer.read().decode()
    assert re.search(r"^dense_armor_requests_in_flight 0\.0$", text, re.M)
    # cancelled, not run to the end: 100 requests of 140 tokens would generate 14000
    assert _generated(url) - generated < 100 * 140 / 2
    if sizes[0] is not None:  # the second 50 grew the process by less than 32 MB
        assert sizes[1] - sizes[0] < 32 * 2**20, sizes
    answer = _client(url).completions.create(model=NAME, prompt="x", max_tokens=4, temperature=0)
    assert answer.usage.completion_tokens == 4  # and it serves on


class _Rounds:
    """A stand-in for the `Server` under the HTTP engine's thread: each `step` takes every
    request queued at that moment as one round of admission."""

    def __init__(self):
        self.queued, self.rounds, self.lock = [], [], threading.Lock()

    @property
    def idle(self):
        with self.lock:
            return not self.queued

    def submit(self, prompt, max_new, request_id, **rules):
        with self.lock:
            self.queued.append(request_id)

    def step(self):
        with self.lock:
            self.rounds.append(self.queued)
            self.queued = []
        return []

    def cancel(self, request_id):
        pass


def test_requests_arriving_together_at_an_idle_server_are_admitted_together(monkeypatch):
    """A burst (each request within the gap of the one before) is one round, where stepping at
    the first arrival admitted it alone and the rest a whole prefill later; a request alone is
    still stepped once the window ends. Gap and window widened here so that a loaded machine's
    late wake-ups cannot split the burst."""
    import asyncio

    from dense_armor.serving import worker

    monkeypatch.setattr(worker, "BURST_GAP", 0.1)
    monkeypatch.setattr(worker, "BURST_WINDOW", 1.0)
    server = _Rounds()
    engine = worker.Engine(server)

    async def arrive(names, spacing):
        for name in names:
            engine.submit(name, [1], 1, None, None, [])
            await asyncio.sleep(spacing)

    def rounds_after(count):
        deadline = time.monotonic() + 10
        while len(server.rounds) < count and time.monotonic() < deadline:
            time.sleep(0.01)
        return server.rounds

    try:
        asyncio.run(arrive(["a", "b", "c", "d"], 0.01))
        assert rounds_after(1) == [["a", "b", "c", "d"]]
        asyncio.run(arrive(["alone"], 0))
        assert rounds_after(2) == [["a", "b", "c", "d"], ["alone"]]
    finally:
        engine.close()


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        ([], r"serve --http needs a tokenizer: pass --tokenizer"),
        (["--tokenizer", str(CHAT), "--slots", "0"], r"`slots` must be a positive integer"),
        (["--tokenizer", str(CHAT), "--max-queue", "-2"], r"`max_queue` must be an integer >= 0"),
        (["--tokenizer", str(CHAT), "--capacity", "0"], r"`capacity` must be a positive integer"),
    ],
)
def test_serve_http_refuses_a_bad_setup_in_one_line(capsys, extra, words):
    from dense_armor.cli import main as cli

    assert cli(["serve", str(BYTES), "--http", "--port", "0", *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dense-armor serve: error: ") and err.count("\n") == 1
    assert re.search(words, err), err


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        (["--temperature", "-1"], r"--temperature: `temperature` must be a number in \[0.0, 2.0\]"),
        (["--max-new-tokens", "0"], r"--max-new-tokens: `max_tokens` must be an integer >= 1"),
        (["--top-p", "0"], r"--top-p: `top_p` must be a number in \(0.0, 1.0\]"),
    ],
)
def test_serve_http_refuses_a_bad_default_before_reading_the_model(
    monkeypatch, capsys, extra, words
):
    from dense_armor.cli import main as cli
    from dense_armor.cli import serve as cli_serve

    def never(args):
        raise AssertionError("the model was read")

    monkeypatch.setattr(cli_serve, "language_model", never)
    assert cli(["serve", str(BYTES), "--http", "--tokenizer", str(CHAT), *extra]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and re.search(words, err), err


@pytest.mark.parametrize("missing", ["uvicorn", "starlette", "prometheus_client"])
def test_serve_http_without_the_extra_says_so_before_reading_the_model(
    monkeypatch, capsys, missing
):
    import importlib.util

    from dense_armor.cli import main as cli
    from dense_armor.cli import serve as cli_serve

    find = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == missing else find(name, *a)
    )

    def never(args):
        raise AssertionError("the model was read")

    monkeypatch.setattr(cli_serve, "language_model", never)
    assert cli(["serve", str(BYTES), "--http", "--tokenizer", str(CHAT)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and missing in err and "pip install 'dense-armor[serve]'" in err


def test_serve_http_refuses_a_taken_port_and_a_corrupted_config(tmp_path, capsys):
    import shutil
    import socket

    from dense_armor.cli import main as cli

    checkpoint = tmp_path / "ckpt"
    shutil.copytree(BYTES, checkpoint)
    (checkpoint / "generation_config.json").write_text('{"eos_token_id": [1, ')  # cut short
    base = ["serve", str(checkpoint), "--http", "--tokenizer", str(CHAT), "--capacity", "40"]
    assert cli([*base, "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert re.search(r"generation_config.json is not a JSON object", err) and err.count("\n") == 1
    (checkpoint / "generation_config.json").unlink()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        assert cli([*base, "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert re.search(rf"cannot listen on 127.0.0.1:{port}: Address already in use", err), err


def test_a_failure_of_the_server_itself_is_openais_error_object():
    """A tokenizer that fails inside a request (what no bad input may cause): a 500 with the
    error object, type `server_error`, and the next request is answered."""
    from starlette.testclient import TestClient

    from dense_armor.nn.models.language_model import TransformerLM
    from dense_armor.serving import Server
    from dense_armor.serving.http import create_app

    class Broken:
        def encode(self, text, add_special_tokens=True):
            raise RuntimeError("the tokenizer's file went away")

    model = TransformerLM(16, 16, 2, 32, 1, jax.random.PRNGKey(0), 8)
    app = create_app(Server(model, slots=1), Broken(), "tiny")
    with TestClient(app, raise_server_exceptions=False) as client:
        for _ in range(2):
            answer = client.post("/v1/completions", json={"model": "tiny", "prompt": "x"})
            assert answer.status_code == 500
            error = answer.json()["error"]
            assert error["type"] == "server_error" and "went away" in error["message"]
        assert client.get("/v1/models").status_code == 200


def _logprobs(model, ids):
    """Float64 log-softmax of the model's logits after each of `ids` (row t scores token t+1)."""
    logits = np.asarray(model(np.asarray(ids, np.int32)), np.float64)
    shifted = logits - logits.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def test_completions_logprobs_and_echo_score_the_prompt_and_the_new_tokens(served, reference):
    """lm-evaluation-harness's request: token ids, `echo`, `logprobs`, one greedy token. The
    text is the prompt's then the new token's; every token's log-probability is the model's
    (the first prompt token's null), with its alternatives, most likely first."""
    url, _ = served
    model, tokenizer = reference
    client = _client(url)
    ids = list(PROMPTS[1].encode())
    answer = client.completions.create(
        model=NAME, prompt=ids, max_tokens=1, temperature=0, echo=True, logprobs=3
    )
    choice = answer.choices[0]
    (new,) = generate(model, [ids], 1).tokens[0].tolist()
    assert choice.text == PROMPTS[1] + tokenizer.decode([new])
    scores, everything = choice.logprobs, [*ids, new]
    want = _logprobs(model, everything)
    assert scores.tokens == [tokenizer.decode([t]) for t in everything]
    assert scores.token_logprobs[0] is None and scores.top_logprobs[0] is None
    np.testing.assert_allclose(
        scores.token_logprobs[1:], want[np.arange(len(ids)), everything[1:]], atol=3e-5
    )
    for t, top in enumerate(scores.top_logprobs[1:]):
        best = np.argsort(-want[t], kind="stable")[:3]
        assert list(top) == [tokenizer.decode([int(b)]) for b in best]
        np.testing.assert_allclose(list(top.values()), want[t, best], atol=3e-5)
    assert scores.text_offset == [sum(map(len, scores.tokens[:i])) for i in range(len(everything))]
    # streamed: the prompt's text first, then each token's chunk with its scores
    chunks = list(
        client.completions.create(
            model=NAME, prompt=ids, max_tokens=3, temperature=0, echo=True, logprobs=1,
            stream=True,
        )
    )  # fmt: skip
    text = "".join(c.choices[0].text for c in chunks)
    streamed = [x for c in chunks if c.choices[0].logprobs for x in c.choices[0].logprobs.tokens]
    whole = client.completions.create(
        model=NAME, prompt=ids, max_tokens=3, temperature=0, echo=True, logprobs=1
    )
    assert text == whole.choices[0].text and streamed == whole.choices[0].logprobs.tokens


def test_chat_logprobs_carry_each_token_s_bytes_and_alternatives(served):
    url, _ = served
    client = _client(url)
    messages = [{"role": "user", "content": "def f("}]
    answer = client.chat.completions.create(
        model=NAME, messages=messages, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2
    )
    choice = answer.choices[0]
    content = choice.logprobs.content
    assert len(content) == answer.usage.completion_tokens == 6
    assert b"".join(bytes(e.bytes) for e in content).decode() == choice.message.content
    assert all(len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob >= e.logprob for e in content)
    assert all(e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob for e in content)
    plain = client.chat.completions.create(
        model=NAME, messages=messages, max_tokens=6, temperature=0
    )
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == (
        choice.message.content
    )
    chunks = list(
        client.chat.completions.create(
            model=NAME, messages=messages, max_tokens=6, temperature=0, logprobs=True,
            top_logprobs=2, stream=True,
        )
    )  # fmt: skip
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]  # fmt: skip
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]


LOGPROB_BAD = [
    ("/v1/completions", {"model": NAME, "prompt": "x", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "logprobs": True}, "logprobs"),
    ("/v1/completions", {"model": NAME, "prompt": "x", "echo": 1}, "echo"),
    (
        "/v1/chat/completions",
        {"model": NAME, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
        "top_logprobs",
    ),
    (
        "/v1/chat/completions",
        {
            "model": NAME,
            "messages": [{"role": "user", "content": "x"}],
            "logprobs": True,
            "top_logprobs": 30,
        },
        "top_logprobs",
    ),
]


@pytest.mark.parametrize(("path", "body", "param"), LOGPROB_BAD)
def test_bad_logprobs_requests_are_refused_naming_the_field(served, path, body, param):
    url, _ = served
    status, answer = _post(url, path, json.dumps(body).encode())
    assert status == 400 and answer["error"]["param"] == param, answer


def test_several_prompts_and_n_choices_each_in_one_request(served, reference):
    """A list of prompts (text or token ids), `n` choices of each: choice `p * n + j` is prompt
    `p`'s; greedy, each its solo text; the usage counts each prompt once and every choice's
    tokens; streamed, each chunk names its choice."""
    url, _ = served
    client = _client(url)
    want = _solo(reference, PROMPTS[:2], 5)
    for prompt in (
        [PROMPTS[0], PROMPTS[1]],
        [list(PROMPTS[0].encode()), list(PROMPTS[1].encode())],
    ):
        answer = client.completions.create(
            model=NAME, prompt=prompt, n=2, max_tokens=5, temperature=0
        )
        assert [c.index for c in answer.choices] == [0, 1, 2, 3]
        assert [c.text for c in answer.choices] == [want[0], want[0], want[1], want[1]]
        assert answer.usage.prompt_tokens == len(PROMPTS[0]) + len(PROMPTS[1])
        assert answer.usage.completion_tokens == 4 * 5
    chunks = list(
        client.completions.create(
            model=NAME, prompt=PROMPTS[:2], n=2, max_tokens=5, temperature=0, stream=True
        )
    )
    texts = [
        "".join(c.choices[0].text for c in chunks if c.choices[0].index == i) for i in range(4)
    ]
    assert texts == [want[0], want[0], want[1], want[1]]
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason]
    assert reasons == ["length"] * 4


def test_n_sampled_choices_differ_and_the_first_is_the_seed_s(served):
    url, _ = served
    client = _client(url)
    asked = dict(model=NAME, prompt=PROMPTS[4], max_tokens=12, temperature=1.0, seed=7)
    several = client.completions.create(n=3, **asked)
    alone = client.completions.create(**asked)
    texts = [c.text for c in several.choices]
    assert texts[0] == alone.choices[0].text and len(set(texts)) > 1
    chat = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "x"}], max_tokens=8, n=2,
        temperature=1.0, seed=3,
    )  # fmt: skip
    assert [c.index for c in chat.choices] == [0, 1] and chat.usage.completion_tokens == 16


def test_tokenize_and_detokenize(served, reference):
    """vLLM's `/tokenize` (a prompt, or a chat's messages through its template) and
    `/detokenize`, as an evaluation harness probes them."""
    url, _ = served
    _, tokenizer = reference
    text = "def main(x):\n    return x"
    status, answer = _post(url, "/tokenize", json.dumps({"model": NAME, "prompt": text}).encode())
    assert status == 200 and answer["tokens"] == tokenizer.encode(text).ids
    assert answer["count"] == len(answer["tokens"]) and answer["max_model_len"] == CONTEXT
    status, back = _post(url, "/detokenize", json.dumps({"tokens": answer["tokens"]}).encode())
    assert status == 200 and back == {"prompt": text}
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    status, rendered = _post(url, "/tokenize", json.dumps(chat).encode())
    plain = _client(url).chat.completions.create(
        model=NAME, messages=chat["messages"], max_tokens=1, temperature=0
    )
    assert status == 200
    assert rendered["count"] == len(rendered["tokens"]) == plain.usage.prompt_tokens
    for path, body, param, code in (
        ("/tokenize", {"prompt": 3}, "prompt", 400),
        ("/tokenize", {"prompt": "x", "model": "other"}, "model", 404),
        ("/detokenize", {"tokens": [1, -1]}, "tokens", 400),
        ("/detokenize", {"tokens": "1 2"}, "tokens", 400),
        ("/detokenize", {"tokens": [True]}, "tokens", 400),
        ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, "add_special_tokens", 400),
        ("/tokenize", b"{not json", None, 400),
        ("/tokenize", [], None, 400),
    ):
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        status, error = _post(url, path, raw)
        assert status == code and error["error"]["param"] == param, error
