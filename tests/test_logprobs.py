"""Each new token's log-probability under the model and its most likely alternatives
(`Server.submit(..., logprobs=k)`), against transformers' float64 log-softmax of the same tiny
checkpoints (tests/torch_reference/make_logprob_golden.py): fixed and paged slots, several
decoding steps per dispatch, greedy and sampled."""

import json

import jax
import numpy as np
import pytest

from dense_armor.huggingface import import_hf
from dense_armor.serving import Sampling, Server
from test_language_models import DATA

GOLDEN = json.loads((DATA.parent / "logprobs.json").read_text())
TOP = GOLDEN["top"]


def _check_top(ids, values, want_ids, want_values):
    """The alternatives: the reference's log-probabilities, and its ids wherever its values are
    not within float32 round-off of each other (a near tie may order either way)."""
    want_values = np.reshape(want_values, np.shape(values))  # (0, k) for a prompt of one
    np.testing.assert_allclose(values, want_values, atol=3e-5)
    gaps = np.abs(np.diff(np.asarray(want_values), axis=-1)) > 1e-4
    for row, (got, want, apart) in enumerate(zip(ids, want_ids, gaps, strict=True)):
        for j in range(len(want)):
            if (j == 0 or apart[j - 1]) and (j == len(want) - 1 or apart[j]):
                assert got[j] == want[j], (row, j)


@pytest.mark.parametrize("name", ["gpt2", "llama_gqa"])
@pytest.mark.parametrize("options", [{}, {"pages": 24, "page_size": 4, "decode_steps": 3}])
def test_logprobs_are_transformers_float64_log_softmax(name, options):
    model, _ = import_hf(DATA / name)
    server = Server(model, 2, 32, chunk=4, max_logprobs=TOP, **options)
    cases = GOLDEN[name]
    for i, case in enumerate(cases):
        server.submit(case["prompt"], len(case["tokens"]), id=i, logprobs=TOP)
    server.submit(cases[0]["prompt"], 3, id="plain")  # beside them, one asking for nothing
    done = {c.id: c for c in server.run()}
    assert done["plain"].logprobs is None and done["plain"].top_ids is None
    for i, case in enumerate(cases):
        got, n = done[i], len(case["prompt"])
        np.testing.assert_array_equal(got.tokens, case["tokens"])
        np.testing.assert_allclose(got.logprobs, case["logprobs"], atol=3e-5)
        assert got.top_ids.shape == got.top_logprobs.shape == (len(case["tokens"]), TOP)
        _check_top(got.top_ids, got.top_logprobs, case["top_ids"][n - 1 :],
                   case["top_logprobs"][n - 1 :])  # fmt: skip


def test_a_sampled_token_s_logprob_is_the_model_s_not_the_filtered_one():
    """With temperature and top-k, the score is still the raw model's log-softmax (as OpenAI and
    vLLM report it); each event carries its token's score and `k` alternatives."""
    model, _ = import_hf(DATA / "gpt2")
    server = Server(model, 2, 32, chunk=4, max_logprobs=3)
    prompt = GOLDEN["gpt2"][1]["prompt"]
    rules = Sampling(temperature=1.5, top_k=4)
    server.submit(prompt, 6, id="s", sampling=rules, key=jax.random.PRNGKey(5), logprobs=2)
    events = []
    while not server.idle:
        events += server.step()
    (done,) = [e.completion for e in events if e.completion is not None]
    ids = np.concatenate([done.prompt, done.tokens])
    logits = np.asarray(model(ids[:-1]), np.float64)
    shifted = logits - logits.max(-1, keepdims=True)
    logprobs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    want = logprobs[np.arange(len(prompt) - 1, len(ids) - 1), done.tokens]
    np.testing.assert_allclose(done.logprobs, want, atol=3e-5)
    assert [e.logprob for e in events] == pytest.approx(done.logprobs.tolist())
    assert all(len(e.top) == 2 and e.top[0][1] >= e.top[1][1] for e in events)
    assert [e.top[0][0] for e in events] == done.top_ids[:, 0].tolist()


def test_asking_more_alternatives_than_the_server_scores_is_refused():
    model, _ = import_hf(DATA / "gpt2")
    server = Server(model, 2, 32, max_logprobs=4)
    with pytest.raises(ValueError, match="max_logprobs=None"):
        Server(model, 2, 32).submit([1, 2], 2, logprobs=0)
    with pytest.raises(ValueError, match="max_logprobs=4"):
        server.submit([1, 2], 2, logprobs=5)
    with pytest.raises(ValueError, match="logprobs"):
        server.submit([1, 2], 2, logprobs=-1)
    for bad in (True, "2", 1.5, float("nan")):  # no bool, string or float stands for a count
        with pytest.raises(TypeError, match="logprobs"):
            server.submit([1, 2], 2, logprobs=bad)
    for bad, error in ((-1, ValueError), ("20", TypeError), (True, TypeError)):
        with pytest.raises(error, match="max_logprobs"):
            Server(model, 2, 32, max_logprobs=bad)


@pytest.mark.parametrize("options", [{}, {"pages": 24, "page_size": 4, "share_prefixes": True}])
def test_a_prompt_s_logprobs_are_transformers_and_nothing_compiles_after_warm_up(options):
    """`prompt_logprobs=True` (OpenAI's `echo` with `logprobs`): each prompt token's score after
    those before it (the first has none), computed by the prefill; a prompt whose pages another
    request shares is computed whole for it, its scores all there. One new token (as an
    evaluation harness asks) ends the request at its prefill, its scores kept."""
    from test_serving import Traces

    model, _ = import_hf(DATA / "llama_gqa")
    server = Server(model, 2, 32, chunk=4, max_logprobs=TOP, **options)
    server.warm_up()
    cases = GOLDEN["llama_gqa"]
    with Traces() as traces:
        server.serve([(cases[2]["prompt"], 2)])  # its pages keyed, where pages are shared
        for i, case in enumerate(cases):
            server.submit(case["prompt"], 1, id=i, logprobs=TOP, prompt_logprobs=True)
        done = {c.id: c for c in server.run()}
    assert traces.count == 0
    for i, case in enumerate(cases):
        got, n = done[i], len(case["prompt"])
        assert got.cached_tokens == 0 and got.tokens.tolist() == case["tokens"][:1]
        assert np.isnan(got.prompt_logprobs[0]) and (got.prompt_top_ids[0] == -1).all()
        np.testing.assert_allclose(got.prompt_logprobs[1:], case["prompt_logprobs"][1:], atol=3e-5)
        _check_top(got.prompt_top_ids[1:], got.prompt_top_logprobs[1:], case["top_ids"][: n - 1],
                   case["top_logprobs"][: n - 1])  # fmt: skip
        np.testing.assert_allclose(got.logprobs, case["logprobs"][:1], atol=3e-5)


def test_prompt_logprobs_need_logprobs():
    model, _ = import_hf(DATA / "gpt2")
    server = Server(model, 2, 32, max_logprobs=2)
    with pytest.raises(ValueError, match="needs `logprobs`"):
        server.submit([1, 2], 2, prompt_logprobs=True)
    with pytest.raises(TypeError, match="prompt_logprobs"):
        server.submit([1, 2], 2, logprobs=1, prompt_logprobs=1)
