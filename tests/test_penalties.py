"""Penalties and logit_bias in the one on-device sampler (`nn.sampling.Penalties`), checked
against a NumPy sampler written from vLLM's and OpenAI's formulas: `logit_bias` added, then
`repetition_penalty` over the prompt's and the output's tokens (a positive logit divided, any
other multiplied), then `frequency_penalty * count` and `presence_penalty * (count > 0)` over the
output's subtracted; greedy takes the argmax of what is left."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dense_armor.huggingface import import_hf
from dense_armor.nn.models.generation import generate, stream_tokens
from dense_armor.nn.penalties import (
    MAX_LOGIT_BIAS,
    History,
    Penalties,
    check_penalties,
    penalised,
)
from dense_armor.serving import Sampling, Server
from test_language_models import DATA
from test_serving import Traces

STRONG = Penalties(presence=0.4, frequency=0.6, repetition=1.7, logit_bias=((5, 2.5), (9, -100.0)))


def numpy_penalised(logits, prompt, output, penalties):
    """The formulas, in float64, for one stream."""
    out = np.asarray(logits, np.float64).copy()
    for token, value in penalties.logit_bias:
        out[token] += value
    counts = np.bincount(np.asarray(output, np.int64), minlength=out.shape[0])
    repeated = counts > 0
    repeated[np.asarray(prompt, np.int64)] = True
    r = penalties.repetition
    out[repeated] = np.where(out[repeated] > 0, out[repeated] / r, out[repeated] * r)
    return out - penalties.frequency * counts - penalties.presence * (counts > 0)


def test_the_penalised_logits_are_the_formulas_and_a_row_without_penalties_is_untouched():
    vocab, draw = 40, np.random.default_rng(0)
    logits = draw.normal(0, 3, (3, vocab)).astype(np.float32)
    settings = [STRONG, Penalties(repetition=0.5, presence=-1.0), Penalties()]
    prompts = [draw.integers(0, vocab, 6) for _ in settings]
    outputs = [draw.integers(0, vocab, 9) for _ in settings]
    rows = []
    for p, prompt, output in zip(settings, prompts, outputs, strict=True):
        counts = np.bincount(output, minlength=vocab).astype(np.int32)
        seen = np.zeros(vocab, bool)
        seen[prompt] = True
        bias = np.zeros(vocab, np.float32)
        for token, value in p.logit_bias:
            bias[token] = value
        rows.append((counts, seen, bias, [p.presence, p.frequency, p.repetition], p.on))
    past = History(*(jnp.asarray(np.array(column)) for column in zip(*rows, strict=True)))
    got = np.asarray(penalised(jnp.asarray(logits), past, jnp.arange(3)))
    for b, p in enumerate(settings[:2]):
        expected = numpy_penalised(logits[b], prompts[b], outputs[b], p)
        np.testing.assert_allclose(got[b], expected, rtol=1e-6, atol=1e-5)
    assert np.array_equal(got[2], logits[2])  # no penalties: bit for bit


def _reference_tokens(model, prompt, new, penalties):
    """Greedy decoding by the model's whole forward at every step (no cache) and the NumPy
    penalties; the margin of each choice (its best logit over the second)."""
    forward = jax.jit(lambda ids, last: model(ids)[last])  # causal: the rows after are padding
    ids, output, margins = list(prompt), [], []
    for _ in range(new):
        padded = jnp.asarray(ids + [0] * (len(prompt) + new - len(ids)))
        logits = np.asarray(forward(padded, len(ids) - 1))
        logits = numpy_penalised(logits, prompt, output, penalties)
        top = np.sort(logits)[-2:]
        margins.append(top[1] - top[0])
        output.append(int(np.argmax(logits)))
        ids.append(output[-1])
    return output, margins


@pytest.mark.parametrize("penalties", [STRONG, Penalties(repetition=1.3), Penalties(frequency=2.0)])
def test_generate_with_penalties_equals_a_numpy_sampler(penalties):
    model, _ = import_hf(DATA / "llama_gqa")
    prompts = [[3, 17, 17, 40, 3, 8], [5, 5, 5]]
    got = generate(model, prompts, 10, penalties=penalties).tokens
    for row, prompt in enumerate(prompts):
        expected, margins = _reference_tokens(model, prompt, 10, penalties)
        compared = 0
        for step, (a, b, margin) in enumerate(
            zip(got[row].tolist(), expected, margins, strict=True)
        ):
            if margin < 1e-3:  # a near tie: float32 against float64 may choose either
                break
            assert a == b, (row, step, got[row], expected)
            compared += 1
        assert compared >= 4, (row, margins)  # enough steps to tell the penalties apart
    plain = generate(model, prompts, 10).tokens
    assert not np.array_equal(got, plain)  # the penalties changed what was chosen


@pytest.mark.parametrize("temperature, pages", [(0.0, None), (0.8, 64)])
def test_the_server_applies_penalties_as_generate_does(temperature, pages):
    """Each request's own penalties (beside requests without any) give its tokens of `generate`
    with the same key and settings; a preempted or resumed slot is not needed for this."""
    model, _ = import_hf(DATA / "llama_gqa")
    prompts = [[3, 17, 17, 40, 3, 8], [5, 5, 5], [9, 1, 4, 4, 2, 7, 7]]
    kinds = [STRONG, None, Penalties(repetition=0.7, presence=1.5)]
    key = jax.random.PRNGKey(3)
    server = Server(model, slots=2, capacity=32, pages=pages, page_size=4)
    expected = {}
    for i, (prompt, p) in enumerate(zip(prompts, kinds, strict=True)):
        sub = jax.random.fold_in(key, i)
        sampling = Sampling(temperature, penalties=p)
        server.submit(prompt, 9, id=i, sampling=sampling, key=sub)
        solo = generate(model, [prompt], 9, sub, temperature=temperature, penalties=p)
        expected[i] = solo.tokens[0, : int(solo.lengths[0])].tolist()
    got = {c.id: c.tokens.tolist() for c in server.run()}
    assert got == expected


@pytest.mark.parametrize(
    "penalties, message",
    [
        (Penalties(presence=2.5), r"`presence_penalty` must be a number in \[-2, 2\]"),
        (Penalties(frequency=float("nan")), r"`frequency_penalty` must be"),
        (Penalties(repetition=0.0), r"`repetition_penalty` must be a finite number > 0"),
        (Penalties(logit_bias=((128, 1.0),)), r"token 128 is not an id in \[0, 128\)"),
        (Penalties(logit_bias=((3, 101.0),)), r"101.0 for token 3 is not in \[-100, 100\]"),
        (Penalties(logit_bias=((3, 1.0), (3, 2.0))), r"names a token more than once"),
        (Penalties(logit_bias=tuple((i, 1.0) for i in range(MAX_LOGIT_BIAS + 1))), "at most"),
    ],
)
def test_a_penalty_out_of_its_range_is_refused_by_name(penalties, message):
    with pytest.raises(ValueError, match=message):
        check_penalties(penalties, 128)


def test_requests_with_and_without_penalties_compile_nothing_after_warm_up():
    """Penalties set into a slot, then a request without them in the same slot: no compilation
    after `warm_up` (the rows are set by calls it compiled)."""
    model, _ = import_hf(DATA / "llama_gqa")
    server = Server(model, slots=2, capacity=32, chunk=4)
    server.warm_up()
    kinds = [STRONG, None, Penalties(repetition=0.7), None, None]
    with Traces() as traces:
        for i, p in enumerate(kinds):
            server.submit([3, 1 + i, 4], 5, sampling=Sampling(penalties=p))
        done = list(server.run())
    assert traces.count == 0 and len(done) == len(kinds)


def test_stream_tokens_with_penalties_are_generates():
    model, _ = import_hf(DATA / "llama_gqa")
    prompt, key = [3, 17, 17, 40, 3, 8], jax.random.PRNGKey(2)
    for temperature in (0.0, 0.9):
        streamed = list(
            stream_tokens(model, prompt, 8, key, temperature=temperature, penalties=STRONG)
        )
        want = generate(model, [prompt], 8, key, temperature=temperature, penalties=STRONG)
        assert streamed == want.tokens[0].tolist()
