"""Golden data: inputs, and the Python model's outputs for them, stored with every artifact.

The streaming outputs are computed one stream at a time with the model's own `step` from its own
empty cache, never through the batched, prefilled or reset paths they check: the artifact's
checker runs `init_cache`, then `prefill` over the first steps, `step` over the rest, and `reset`
of stream 1 part-way, and must reproduce them.
"""

from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ..nn.sampling import draw_tokens
from .functions import Function
from .lowering import Lowering

__all__ = ["GOLDEN_STEPS", "golden"]

# The golden stream's length: the cache's capacity, up to this many steps. The Python model
# computes it one step at a time, so a capacity of a million slots would cost minutes; the
# streaming path is the same code at step 256 as at step 10**6.
GOLDEN_STEPS = 256


# One jitted step for every golden stream: traced once per model structure and input shape, not
# once per stream (it runs only inside `export_model`'s `exporting()`, which its trace depends on).
_step = eqx.filter_jit(lambda m, x, c: m.step(x, c))


def _run(lowering: Lowering, xs: np.ndarray, context: Sequence[np.ndarray]) -> np.ndarray:
    """One stream, from its empty cache, one `step` at a time: `xs (L, ...) -> (L, ...)`."""
    model = lowering.causal_model
    cache = lowering.start(model, tuple(context))
    ys = []
    for x in xs:
        y, cache = _step(model, x, cache)
        ys.append(np.asarray(y, np.float32))
    return np.stack(ys)


def golden(
    lowering: Lowering,
    seed: int,
    functions: dict[str, Function],
    static_entries: Sequence[dict[str, Any]],
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The golden arrays and their plan for the manifest: three forward shapes, and a stream of
    two, `min(capacity, GOLDEN_STEPS)` steps long: `init_cache`, `prefill` of the first steps,
    `step` over the rest with stream 1 reset part-way (to a new context, for a family with one);
    and a case for every static module's function and shape (`_static_cases`).

    Every output is computed on the host's CPU device (`Lowering.on_host`), whatever JAX's
    default backend: the same golden data from every machine that exports."""
    lowering = lowering.on_host()
    with jax.default_device(jax.devices("cpu")[0]):
        data = _Golden(lowering, seed, functions)
        forward = data.forward_cases()
        stream = data.stream()
        static = _static_cases(lowering, functions, static_entries, seed, data.arrays)
        plan: dict[str, Any] = {"file": "golden.safetensors", "static": static}
        plan.update(forward=forward, stream=stream)
        if "sample_step" in functions:
            plan["generation"] = data.generation()
    return data.arrays, plan


def _rng(seed: int, *path: int) -> np.random.Generator:
    """The generator of one golden array: NumPy's, seeded by the export's seed and the array's
    place (`path`). The inputs are drawn on the host: a draw of JAX's would be a computation to
    trace and compile for every shape, before any of the model's."""
    return np.random.default_rng([seed, *path])


class _Golden:
    """The golden arrays as they are made (`arrays`, by name), from one seed."""

    def __init__(self, lowering: Lowering, seed: int, functions: dict[str, Function]) -> None:
        self.lowering, self.seed, self.functions = lowering, seed, functions
        self.arrays: dict[str, np.ndarray] = {}

    def normal(self, i: int, shape: tuple[int, ...]) -> np.ndarray:
        return _rng(self.seed, i).standard_normal(shape, dtype=np.float32)

    def context(self, name: str, i: int, b: int, s: int, padded: bool) -> list[str]:
        """A context and its mask for a family that takes one (else nothing): their names."""
        if self.lowering.width is None:
            return []
        self.arrays[f"{name}.context"] = self.normal(1000 + i, (b, s, self.lowering.width))
        mask = np.ones((b, s), bool)
        if padded and s > 1:
            mask[0, -1] = False  # one padded context step in the first sequence
        self.arrays[f"{name}.context_mask"] = mask
        return [f"{name}.context", f"{name}.context_mask"]

    def forward_cases(self) -> list[dict[str, Any]]:
        """Three batches of sequences, the longest `max_len` steps, and the outputs for them."""
        lowering, arrays = self.lowering, self.arrays
        forward = self.functions["forward"].jitted(donate=False)
        cases = []
        for i, (b, t, s) in enumerate(
            [(2, lowering.max_len, 5), (3, min(5, lowering.max_len), 3), (1, 1, 1)]
        ):
            arrays[f"forward{i}.x"] = lowering.draw_inputs(_rng(self.seed, i), (b, t))
            inputs = [f"forward{i}.x", *self.context(f"forward{i}", i, b, s, padded=True)]
            arrays[f"forward{i}.y"] = np.asarray(  # outputs are stored as float32
                forward(lowering.weights, *(arrays[k] for k in inputs)), np.float32
            )
            cases.append({"inputs": inputs, "output": f"forward{i}.y", "B": b, "T": t})
        return cases

    def stream(self) -> dict[str, Any]:
        """Two streams from their empty caches (what `init_cache` must return), stepped one at a
        time; stream 1 starts again at `reset_at`, from its new context."""
        lowering, arrays = self.lowering, self.arrays
        b, n = 2, min(lowering.capacity, GOLDEN_STEPS)
        prefilled, reset_at = max(1, n // 3), max(1, n // 3, (2 * n) // 3)
        xs = lowering.draw_inputs(_rng(self.seed, 100), (b, n))
        arrays["stream.x"] = xs
        arrays["stream.streams"] = np.ones(b, bool)
        init = self.context("stream", 9, b, 4, padded=True) or ["stream.streams"]
        arrays["reset.streams"] = np.array([False, True])
        reset = ["reset.streams", *self.context("reset", 10, b, 4, padded=False)]

        def row(keys: Sequence[str], i: int) -> list[np.ndarray]:
            return [arrays[k][i] for k in keys if k != "stream.streams"]

        model = lowering.causal_model
        starts = [lowering.start(model, tuple(row(init, i))) for i in range(b)]
        leaves = [np.stack(a) for a in zip(*map(jax.tree_util.tree_leaves, starts), strict=True)]
        cache_keys = [f"init_cache.{i}" for i in range(len(leaves))]
        arrays.update(zip(cache_keys, leaves, strict=True))
        again = [_run(lowering, xs[1, reset_at:], row(reset[1:], 1))] if reset_at < n else []
        first = _run(lowering, xs[0], row(init, 0))
        arrays["stream.y"] = np.stack(
            [first, np.concatenate([_run(lowering, xs[1, :reset_at], row(init, 1)), *again])]
        )
        return {
            "B": b,
            "steps": n,
            "prefill": prefilled,
            "reset_at": reset_at,
            "init_cache": {"inputs": init, "outputs": cache_keys},
            "reset": {"inputs": reset},
            "x": "stream.x",
            "y": "stream.y",
        }

    def generation(self) -> dict[str, Any]:
        """Two prompts and the tokens decoding gives after them (greedy, or sampled with the
        artifact's rules and a stored key): `sample_prefill`, then `sample_step` on each token."""
        lowering, arrays = self.lowering, self.arrays
        prompt_length = max(1, min(4, lowering.capacity // 2))
        n = max(1, min(GENERATION_TOKENS, lowering.capacity - prompt_length))
        prompts = lowering.draw_inputs(_rng(self.seed, 300), (2, prompt_length))
        key = _rng(self.seed, 301).integers(0, 2**32, 2, dtype=np.uint32)  # a raw key's data
        arrays["generation.prompt"] = prompts
        arrays["generation.key"] = key
        arrays["generation.tokens"] = np.array(
            [_decoded(lowering, prompts[b], key, b, n) for b in range(2)], np.int32
        )
        return {
            "prompt": "generation.prompt",
            "key": "generation.key",
            "tokens": "generation.tokens",
            "B": 2,
            "new_tokens": n,
        }


# The golden generation's length: up to this many new tokens (the cache's capacity allowing).
GENERATION_TOKENS = 32


def _decoded(
    lowering: Lowering, prompt: np.ndarray, key: np.ndarray, row: int, n: int
) -> list[int]:
    """One stream's `n` new tokens after `prompt`, in Python: the model's own `prefill` and
    `step` from its empty cache, each token drawn by `draw_tokens` as stream `row` of a batch."""
    model = lowering.causal_model
    cache = lowering.start(model, ())
    logits, cache = _prefill(model, jnp.asarray(prompt), cache)
    raw_key = jnp.asarray(key)
    tokens: list[int] = []
    position = len(prompt)
    while True:
        token = draw_tokens(
            logits[-1:], raw_key, jnp.array([row], jnp.int32), jnp.array([position], jnp.int32),
            **lowering.sampling,
        )  # fmt: skip
        tokens.append(int(token[0]))
        if len(tokens) == n:
            return tokens
        y, cache = _step(model, token[0], cache)
        logits, position = y[None], position + 1


_prefill = eqx.filter_jit(lambda m, x, c: m.prefill(x, c))


def _static_cases(
    lowering: Lowering,
    functions: dict[str, Function],
    entries: Sequence[dict[str, Any]],
    seed: int,
    arrays: dict[str, np.ndarray],
) -> list[dict[str, Any]]:
    """For each function and static shape: its inputs (all but the weights, in the manifest's
    order) and what the function returns for them in Python, for runtimes other than JAX to
    reproduce with the static module. A step case is a stream of steps from an empty
    cache, the cache fed back (`capacity` steps, at most `GOLDEN_STEPS`); its `x_t` input holds
    every step's, `(B, steps, ...)`; a decoding case (`sample_step`, `"feedback"`) feeds each
    step the token the step before returned: its `x_t` is the first step's `(B,)`, its first
    output every step's token `(B, steps)`."""
    cases = []
    done = set()

    for n, entry in enumerate(entries):
        name, sizes = entry["function"], entry["shape"]
        if (name, tuple(sizes.items())) in done:
            continue
        done.add((name, tuple(sizes.items())))
        function = functions[name]
        prefix = "static." + ".".join([name, *(f"{d}{v}" for d, v in sizes.items())])
        b = sizes["B"]

        def normal(i: int, shape: tuple[int, ...], n: int = n) -> np.ndarray:
            return _rng(seed, 5000 + n, i).standard_normal(shape, dtype=np.float32)

        def draw(i: int, leading: tuple[int, ...], n: int = n) -> np.ndarray:
            return lowering.draw_inputs(_rng(seed, 5000 + n, i), leading)

        context = []
        if lowering.width is not None:
            mask = np.ones((b, sizes["S"]), bool)
            if sizes["S"] > 1:  # one padded context step in the first sequence
                mask[0, -1] = False
            context = [normal(0, (b, sizes["S"], lowering.width)), mask]
        init_inputs = context or [np.ones(b, bool)]
        inputs, outputs, steps = _static_run(
            lowering, functions, name, sizes, draw, init_inputs, context
        )
        names = [f"{prefix}.in{i}" for i in range(len(inputs))]
        out_names = [f"{prefix}.out{i}" for i in range(len(outputs))]
        arrays.update(zip(names, map(_stored, inputs), strict=True))
        arrays.update(zip(out_names, map(_stored, outputs), strict=True))
        assert len(names) == len(function.inputs) and len(out_names) == len(function.outputs)
        case = {"function": name, "shape": sizes, "inputs": names, "outputs": out_names}
        case["steps"] = steps
        if name == "sample_step":  # each step's token is the next step's input
            case["feedback"] = True
        cases.append(case)
    return cases


def _static_run(
    lowering: Lowering,
    functions: dict[str, Function],
    name: str,
    sizes: dict[str, int],
    draw: Any,
    init_inputs: list[Any],
    context: list[Any],
) -> tuple[list[Any], list[Any], int | None]:
    """One static case's inputs and the Python outputs for them (`steps`: a step case's
    length), the cache starting empty. Each function runs through the jitted wrapper its static
    module was exported from (`Function.jitted(donate=False)`), whose trace at this shape it
    reuses."""
    jitted = {n: f.jitted(donate=False) for n, f in functions.items()}
    b = sizes["B"]
    cache = list(jitted["init_cache"](lowering.weights, *init_inputs))
    steps = None
    if name == "forward":
        inputs = [draw(1, (b, sizes["T"])), *context]
        outputs = [jitted["forward"](lowering.weights, *inputs)]
    elif name == "init_cache":
        inputs, outputs = init_inputs, cache
    elif name == "step":
        steps = min(lowering.capacity, GOLDEN_STEPS)
        xs = draw(2, (b, steps))
        step, ys, state = jitted["step"], [], cache
        for t in range(steps):
            y_t, state, overflow = step(lowering.weights, xs[:, t], state)
            ys.append(y_t)
        inputs, outputs = [xs, *cache], [jnp.stack(ys, axis=1), *state, overflow]
    elif name == "sample_prefill":
        inputs = [draw(3, (b, sizes["T"])), _KEY, *cache]
        token, state, overflow = jitted["sample_prefill"](lowering.weights, inputs[0], _KEY, cache)
        outputs = [token, *state, overflow]
    elif name == "sample_step":  # a stream fed its own tokens: decoding
        steps = min(lowering.capacity, GOLDEN_STEPS)
        first = draw(2, (b,))
        decode, tokens, state, token = jitted["sample_step"], [], cache, first
        for _ in range(steps):
            token, state, overflow = decode(lowering.weights, token, _KEY, state)
            tokens.append(token)
        inputs = [first, _KEY, *cache]
        outputs = [jnp.stack(tokens, axis=1), *state, overflow]
    elif name == "prefill":
        inputs = [draw(3, (b, sizes["T"])), *cache]
        y, state, overflow = jitted["prefill"](lowering.weights, *inputs[:1], cache)
        outputs = [y, *state, overflow]
    else:  # reset: a cache part-way through a stream, every other stream reset
        _, state, _ = jitted["prefill"](
            lowering.weights,
            draw(4, (b, max(1, min(lowering.capacity, GOLDEN_STEPS) // 2))),
            cache,
        )
        inputs = [np.arange(b) % 2 == 1, *context, *state]
        outputs = jitted["reset"](lowering.weights, inputs[0], *context, state)
    return inputs, outputs, steps


# The key of the static decoding cases, the modules' `key` input: `jax.random.PRNGKey(42)`'s raw
# data, written out so that importing the export stage runs no JAX computation.
_KEY = np.array([0, 42], np.uint32)


def _stored(a: Any) -> np.ndarray:
    """An array as stored: floating point as float32 (safetensors.numpy has no bfloat16)."""
    a = np.asarray(a)
    return a.astype(np.float32) if np.issubdtype(a.dtype, np.floating) or a.dtype.kind == "V" else a
