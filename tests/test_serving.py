"""Continuous batching (`dense_armor.serving.Server`, `dense-armor serve`) against `generate`: every
request gets its solo tokens, whatever the slots, the order of arrival and the reuse of slots,
with no compilation after `warm_up`."""

import json
import re

import jax
import numpy as np
import pytest
from jax import monitoring

from dense_armor.checkpoints import ModelConfig, save_checkpoint
from dense_armor.cli import main as cli
from dense_armor.huggingface import import_hf
from dense_armor.nn.models.generation import generate
from dense_armor.serving import QueueFull, Sampling, Server
from dense_armor.serving.engine import prefill_pieces
from test_language_models import DATA, word_tokenizer

# Prompts of lengths 1 to 21 (whole chunks of 4, and remainders) and the new tokens each asks.
LENGTHS = [5, 1, 12, 3, 21, 8, 2]
NEW = [6, 3, 9, 4, 2, 7, 5]
KEY = jax.random.PRNGKey(7)


@pytest.fixture(scope="module", params=["gpt2", "llama_gqa"])
def served(request):
    """A model, its requests and `generate`'s tokens for them (one batch, every row as long as
    the longest request asks; row `n` draws as request `n`), greedy and sampled."""
    model, arguments = import_hf(DATA / request.param)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, model.vocab, n).tolist() for n in LENGTHS]
    sampling = {"temperature": 0.9, "top_k": 20}
    greedy = np.asarray(generate(model, prompts, max(NEW)).tokens)
    sampled = np.asarray(generate(model, prompts, max(NEW), KEY, **sampling).tokens)
    return request.param, model, arguments, prompts, greedy, sampled, sampling


class Traces:
    """Counts the functions JAX traces (each compilation starts with one) while it is open."""

    def __enter__(self):
        self.count = 0
        self._on = True

        def listen(event, duration, **kwargs):
            if self._on and event == "/jax/core/compile/jaxpr_trace_duration":
                self.count += 1

        monitoring.register_event_duration_secs_listener(listen)
        return self

    def __exit__(self, *exc):
        self._on = False


def test_every_request_gets_its_solo_greedy_tokens_in_any_order_with_no_new_compilation(served):
    _, model, _, prompts, greedy, _, _ = served
    server = Server(model, slots=3, capacity=32, chunk=4)  # 7 requests: slots are reused
    server.warm_up()
    with Traces() as traces:  # requests of 1 to 3 at once, prefilled together: all compiled
        done = server.serve(zip(prompts, NEW, strict=True))
    assert traces.count == 0
    for n, completion in enumerate(done):
        np.testing.assert_array_equal(completion.tokens, greedy[n, : NEW[n]], err_msg=str(n))
        assert completion.reason == "length" and completion.number == n
        assert completion.submitted <= completion.admitted <= completion.first_token
        assert completion.first_token <= completion.finished
    # Again in another order: the same tokens, and nothing traced anew.
    order = [2, 1, 6, 0, 3, 5, 4]
    with Traces() as traces:
        ids = [server.submit(prompts[n], NEW[n], id=f"r{n}") for n in order]
        finished = list(server.run())
    assert traces.count == 0
    assert sorted(c.id for c in finished) == sorted(ids)
    for completion in finished:
        n = int(completion.id[1:])
        np.testing.assert_array_equal(completion.tokens, greedy[n, : NEW[n]], err_msg=str(n))
    # They leave as they finish: r2 (12 prompt tokens prefilled in pieces of 4, its first new
    # token drawn from the prefill, then 8 ticks for 8 more) after r1, which came next (1 prompt
    # token, its first new token from the prefill, then 2 ticks).
    assert [c.finished for c in finished] == sorted(c.finished for c in finished)
    position = {c.id: i for i, c in enumerate(finished)}
    assert position["r1"] < position["r2"]


def test_requests_admitted_together_are_prefilled_together(served, monkeypatch):
    """Three requests that find free slots in one round: their common 9 tokens prefilled as one
    batch of 4 rows (3, padded to a power of two) in pieces of 4, 4 and 1, the longest one's
    rest (3 more tokens: pieces of 2 and 1) alone from its row; each draws its first token from
    its prefill, and gets its solo tokens."""
    _, model, _, prompts, greedy, _, _ = served
    from dense_armor.serving import storage

    calls = []

    def counted(name, compiled):
        def call(inputs, cache):
            calls.append((name, inputs[1].shape))  # inputs: the model and the ids
            return compiled(inputs, cache)

        return call

    for name in ("prefill", "prefill_rows"):
        monkeypatch.setattr(storage, name, counted(name, getattr(storage, name)))
    rng = np.random.default_rng(3)
    grown = [prompts[n] + rng.integers(0, model.vocab, k).tolist() for n, k in ((0, 4), (5, 1))]
    requests = [*grown, prompts[2]]  # 9, 9 and 12 tokens
    server = Server(model, slots=4, capacity=32, chunk=4)
    done = server.serve([(p, 3) for p in requests])
    assert calls == [("prefill_rows", (4, 4)), ("prefill_rows", (4, 4)),
                     ("prefill_rows", (4, 1)), ("prefill", (2,)), ("prefill", (1,))]  # fmt: skip
    want = generate(model, requests, 3).tokens  # a ragged batch: each row its solo tokens
    for n, completion in enumerate(done):
        np.testing.assert_array_equal(completion.tokens, want[n], err_msg=str(n))
    np.testing.assert_array_equal(done[2].tokens, greedy[2, :3])
    # A request alone: its tick steps its slot only (a batch of one, not of 4).
    ticks, tick_rows = [], storage.tick_rows

    def counted_tick(model, caches, steps, rows, *arrays):
        ticks.append(rows)
        return tick_rows(model, caches, steps, rows, *arrays)

    monkeypatch.setattr(storage, "tick_rows", counted_tick)
    (alone,) = server.serve([(prompts[3], NEW[3])])
    np.testing.assert_array_equal(alone.tokens, greedy[3, : NEW[3]])
    assert len(ticks) == NEW[3] - 1 and all(len(rows) == 1 for rows in ticks)


@pytest.mark.parametrize(
    ("n", "chunk", "pieces"),
    [(0, 16, []), (15, 16, [8, 4, 2, 1]), (16, 16, [16]), (40, 16, [16, 16, 8]),
     (7, 5, [5, 2]), (13, 4, [4, 4, 4, 1]), (3, 1, [1, 1, 1]), (6, 3, [3, 3])],
)  # fmt: skip
def test_a_prompt_is_prefilled_in_chunks_then_halving_pieces(n, chunk, pieces):
    assert prefill_pieces(n, chunk) == pieces


def test_sampled_tokens_are_generates_rows_whatever_the_slot(served):
    """Request `n` draws with `fold_in(fold_in(key, n), position)`, as row `n` of `generate`,
    whatever the slots and the decoding steps per dispatch."""
    _, model, _, prompts, _, sampled, sampling = served
    for slots, steps in ((1, 1), (4, 1), (4, 3)):
        server = Server(
            model, slots=slots, capacity=32, key=KEY, chunk=4, decode_steps=steps, **sampling
        )
        for n, completion in enumerate(server.serve(zip(prompts, NEW, strict=True))):
            np.testing.assert_array_equal(completion.tokens, sampled[n, : NEW[n]])


@pytest.mark.parametrize("steps", [1, 6])
def test_a_stop_token_ends_its_request_and_frees_the_slot(served, steps):
    """(With 6 decoding steps per dispatch, the stop comes within a dispatch: the steps after
    it are dropped, and the next request takes the slot.)"""
    _, model, _, prompts, greedy, _, _ = served
    stop = int(greedy[2, 3])  # request 2's fourth token
    server = Server(model, slots=2, capacity=32, chunk=4, stop_tokens=[stop], decode_steps=steps)
    done = server.serve([(prompts[2], NEW[2]), (prompts[0], NEW[0]), (prompts[5], NEW[5])])
    first = list(greedy[2, : NEW[2]]).index(stop) + 1
    np.testing.assert_array_equal(done[0].tokens, greedy[2, :first])
    assert done[0].reason == "stop" and done[0].tokens[-1] == stop
    for completion, n in zip(done[1:], (0, 5), strict=True):
        until = list(greedy[n, : NEW[n]]).index(stop) + 1 if stop in greedy[n, : NEW[n]] else None
        np.testing.assert_array_equal(completion.tokens, greedy[n, : NEW[n]][:until])


def test_decode_steps_are_checked():
    model, _ = import_hf(DATA / "gpt2")
    assert Server(model, 2, 32).decode_steps == 1
    for bad, error in ((0, ValueError), (65, ValueError), (2.5, TypeError), ("8", TypeError)):
        with pytest.raises(error, match="decode_steps"):
            Server(model, 2, 32, decode_steps=bad)


def test_each_request_its_own_rules_and_key_in_one_compilation(served):
    """A mix of greedy and sampled requests, each with its own rules and key, in one batch: each
    equals its own `generate` (greedy: the solo tokens; a key: `generate([prompt], key=key)`,
    row 0; the server's key: row `n`), and a new mix compiles nothing."""
    _, model, _, prompts, greedy, sampled, sampling = served
    own = {1: (Sampling(0.7, None, 0.9, 0.02), jax.random.PRNGKey(11)),
           4: (Sampling(1.3, 5), jax.random.PRNGKey(12))}  # fmt: skip
    server = Server(model, slots=3, capacity=32, key=KEY, chunk=4, **sampling)
    rules = {0: Sampling(), 3: Sampling(), 6: Sampling()}  # greedy beside sampled ones
    for n, prompt in enumerate(prompts):
        rule, key = own.get(n, (rules.get(n), None))
        server.submit(prompt, NEW[n], sampling=rule, key=key)
    done = {c.number: c for c in server.run()}
    for n in range(len(prompts)):
        if n in own:
            rule, key = own[n]
            want = generate(model, [prompts[n]], NEW[n], key, temperature=rule.temperature,
                            top_k=rule.top_k, top_p=rule.top_p, min_p=rule.min_p).tokens[0]  # fmt: skip
        else:
            want = (greedy if n in rules else sampled)[n, : NEW[n]]
        np.testing.assert_array_equal(done[n].tokens, want, err_msg=str(n))
    with Traces() as traces:  # another mix on the warm server
        for n in (5, 2, 1):
            server.submit(prompts[n], NEW[n], sampling=Sampling(0.5, 3, 0.8))
        list(server.run())
    assert traces.count == 0


def test_cancel_drops_a_request_queued_or_in_a_slot_and_the_queue_is_bounded(served):
    _, model, _, prompts, greedy, _, _ = served
    server = Server(model, slots=1, capacity=32, chunk=4, max_queue=2)
    server.submit(prompts[0], NEW[0], id="a")
    server.submit(prompts[1], NEW[1], id="b")
    with pytest.raises(QueueFull, match="max_queue=2"):
        server.submit(prompts[2], NEW[2], id="c")
    events = server.step()  # "a" takes the slot and feeds its prompt
    assert server.busy == 1 and server.pending == 1 and all(e.id == "a" for e in events)
    server.cancel("a")  # in a slot
    server.cancel("b")  # queued
    server.cancel("zzz")  # unknown: nothing
    assert server.step() == [] and server.idle
    done = server.serve([(prompts[2], NEW[2])])  # the slot serves on, exactly
    np.testing.assert_array_equal(done[0].tokens, greedy[2, : NEW[2]])


def test_the_cli_serves_json_lines_and_text_as_they_finish(tmp_path, capsys, served):
    _, model, arguments, prompts, greedy, _, _ = served
    checkpoint = save_checkpoint(tmp_path / "ckpt", model, ModelConfig("transformer_lm", arguments))
    requests = tmp_path / "requests.jsonl"
    lines = [
        json.dumps({"ids": prompts[n], "max_new_tokens": NEW[n], "id": f"q{n}"}) for n in (0, 3)
    ]
    requests.write_text("\n".join([*lines, "", json.dumps({"ids": prompts[1]})]) + "\n")
    argv = ["serve", str(checkpoint), "--input", str(requests), "--slots", "2", "--chunk", "4"]
    assert cli([*argv, "--capacity", "40", "--max-new-tokens", "3"]) == 0
    paged = ["--pages", "12", "--page-size", "4", "--share-prefixes"]
    assert cli([*argv, "--capacity", "40", "--max-new-tokens", "3", *paged]) == 0
    twice = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(twice) == 6  # the fixed slots' answers, then the paged ones
    answers = twice[:3]
    by_id = {a["id"]: a for a in answers}
    assert set(by_id) == {"q0", "q3", 2}
    assert {a["id"]: a["ids"] for a in twice[3:]} == {a["id"]: a["ids"] for a in answers}
    assert by_id["q0"]["ids"] == greedy[0, : NEW[0]].tolist()
    assert by_id["q3"]["ids"] == greedy[3, : NEW[3]].tolist()
    assert by_id[2]["ids"] == greedy[1, :3].tolist()  # the default --max-new-tokens
    assert all(
        a["reason"] == "length" and a["latency"] >= a["time_to_first_token"] > 0 for a in answers
    )
    # With a tokenizer beside the checkpoint (a word per id, "t5" for id 5): text in, text out.
    word_tokenizer(checkpoint / "tokenizer.json")
    text = tmp_path / "text.txt"
    text.write_text(" ".join(f"t{i}" for i in prompts[2]) + "\n")
    assert cli(["serve", str(checkpoint), "--input", str(text), "--max-new-tokens", "4"]) == 0
    (answer,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert answer["ids"] == greedy[2, :4].tolist()
    assert answer["text"] == " ".join(f"t{i}" for i in greedy[2, :4])


SERVE_REFUSALS = [
    ("empty-input", "", r"holds no request: nothing to serve"),
    ("text-without-tokenizer", "hello\n", r"line 1: a text prompt needs a tokenizer"),
    ("not-json", "{oops\n", r"line 1: not a JSON object"),
    ("both-prompt-and-ids", '{"ids": [1], "prompt": "a"}\n', r'line 1: a JSON request holds "prompt" \(text\) or "ids"'),
    ("ids-not-integers", '{"ids": [1, "2"]}\n', r'line 1: "ids" must be a list of integers'),
    ("max-new-zero", '{"ids": [1], "max_new_tokens": 0}\n', r'"max_new_tokens" must be an integer >= 1'),
    ("longer-than-capacity", '{"ids": [1, 2, 3], "max_new_tokens": 40}\n', r"request 1 \(0\): Server.submit: the prompt \(3 tokens\) and `max_new_tokens=40` need 43 cache slots; each slot holds capacity=40"),
    ("id-outside-the-vocabulary", '{"ids": [100000]}\n', r"holds token id 100000, outside the vocabulary"),
]  # fmt: skip


@pytest.mark.parametrize("text, words", [pytest.param(*r[1:], id=r[0]) for r in SERVE_REFUSALS])
def test_the_cli_refuses_bad_requests_in_one_line(tmp_path, capsys, text, words):
    model, arguments = import_hf(DATA / "llama_gqa")
    checkpoint = save_checkpoint(tmp_path / "ckpt", model, ModelConfig("transformer_lm", arguments))
    requests = tmp_path / "requests.txt"
    requests.write_text(text)
    assert cli(["serve", str(checkpoint), "--input", str(requests), "--capacity", "40"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dense-armor serve: error: ") and err.count("\n") == 1
    assert re.search(words, err), err


def test_the_default_capacity_is_the_models_context_bounded_by_memory(monkeypatch):
    """A checkpoint's context travels with it: an imported Llama's max_position_embeddings (64)
    is its Server's capacity, a larger one is refused; when the slots' caches of that context
    would pass half of the memory left, the capacity is what fits (a multiple of 16), said in a
    warning; when not even 16 positions fit, a refusal names the remedies."""
    from dense_armor.serving import settings

    model, arguments = import_hf(DATA / "llama_gqa")
    assert arguments["max_len"] == 64 == model.context
    assert Server(model, slots=2).capacity == 64
    with pytest.raises(ValueError, match=r"`capacity=65` passes the model's context of 64"):
        Server(model, slots=2, capacity=65)
    # 2 layers x 2 key/value heads x 8 features x keys and values x 4 bytes = 256 per position
    per_position = 2 * 2 * 8 * 2 * 4
    monkeypatch.setattr(settings, "memory_left", lambda: 2 * 4 * 40 * per_position)
    with pytest.warns(UserWarning, match=r"4 caches of the model's context \(64 positions"):
        assert Server(model, slots=4).capacity == 32  # 40 fit: 32, a multiple of 16
    assert Server(model, slots=4, pages=9).capacity == 64  # a paged cache's memory is its pool
    monkeypatch.setattr(settings, "memory_left", lambda: 2 * 4 * 8 * per_position)
    with pytest.raises(ValueError, match=r"give fewer `slots` or `pages`"):
        Server(model, slots=4)


def test_serves_compilation_cache_defaults_to_the_users_cache_directory(monkeypatch, tmp_path):
    from dense_armor.serving.settings import compile_cache_dir

    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compile_cache_dir(None) == tmp_path / "xdg" / "dense-armor" / "jax"
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "own"))
    assert compile_cache_dir(None) == tmp_path / "own"  # the user's JAX setting wins
    assert compile_cache_dir("none") is None and compile_cache_dir("NONE") is None
    assert compile_cache_dir(str(tmp_path / "given")) == tmp_path / "given"


def test_compile_now_compiles_in_threads_what_the_calls_then_run_as_traced_here():
    """`compile_now` (what a paged `warm_up` compiles with, several at once): each function at
    each shape compiled once, in threads, traced with the caller's context variables (as
    `ids_checked` is); the calls after it compile nothing and compute what they would have."""
    import contextvars

    import equinox as eqx

    from dense_armor.serving.compiled import compile_now

    offset = contextvars.ContextVar("offset", default=0.0)

    @eqx.filter_jit
    def shifted(x, scale):
        return x * scale + offset.get()  # read at trace time: part of the compiled function

    xs = [np.arange(n, dtype=np.float32) for n in (1, 2, 3, 5, 8)]
    token = offset.set(7.0)
    try:
        with Traces() as traces:
            compile_now([(shifted, (x, 2)) for x in xs], threads=3)
        assert traces.count == len(xs)
        with Traces() as traces:
            got = [np.asarray(shifted(x, 2)) for x in xs]
        assert traces.count == 0
    finally:
        offset.reset(token)
    for x, y in zip(xs, got, strict=True):
        np.testing.assert_array_equal(y, x * 2 + 7.0)  # by hand: the caller's offset, not 0


def test_the_fixed_slots_compile_the_warm_up_requests_functions_ahead(monkeypatch, caplog):
    """`FixedSlots.warm` compiles, on threads, every function the warm-up's requests then run
    (the batched prefill of each piece and batch size, a rest's prefill, admission, the first
    draw, the tick): after it, those requests compile only the small calls that set a
    request's key and its slot's history."""
    from dense_armor.nn.models.language_model import TransformerLM
    from dense_armor.serving import storage

    # a shape of its own: nothing compiled by another test
    model = TransformerLM(89, 24, 4, 48, 2, jax.random.PRNGKey(5), 48, n_kv_heads=2)
    planned = storage.FixedSlots.warm

    def then_log(self, *args, **kwargs):
        planned(self, *args, **kwargs)
        caplog.clear()
        jax.config.update("jax_log_compiles", True)

    monkeypatch.setattr(storage.FixedSlots, "warm", then_log)
    try:
        with caplog.at_level("WARNING"):
            Server(model, slots=4, capacity=20, chunk=4).warm_up()
    finally:
        jax.config.update("jax_log_compiles", False)
    compiled = set(re.findall(r"Compiling jit\((\w+)\)", caplog.text))
    assert compiled <= {"request_key", "set_history", "history_off", "set_masks"}, compiled
