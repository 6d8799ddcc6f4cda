"""Language-model decoding on this CPU: `generate` on a GPT-2-small-shaped model against the
memory-bandwidth limit, and continuous batching (`Server`) against fixed batches.

The model: d_model 768, 12 layers, 12 heads, d_ff 3072, vocabulary 50257, learned positions,
LayerNorm, GPT-2's MLP, a tied head; random weights, float32 (124M parameters, 498 MB). Greedy,
prompts of 32 tokens, 128 new tokens, at batch 1 and 8: tokens per second (new tokens over the
whole call, prefill included) and the time to the first token (a call for one new token). At
batch 1 decoding reads every weight once per token, so the machine's copy bandwidth (measured in
the same run: a 512 MB NumPy copy reads and writes it) bounds the rate: bytes of weights per
token over bandwidth is the least time a token can take.

Continuous batching: 64 requests, prompts of 4 to 32 tokens and 8 to 64 new tokens (a fixed
draw), through 8 slots of a `Server`, against `generate` on fixed batches of 8 in arrival order
(each batch as long as its longest request): new tokens per second over the whole run.

transformers' `generate` (PyTorch, its KV cache on) runs the same shapes on a `GPT2LMHeadModel`
with random weights, its calls interleaved with dense_armor's (the medians of 3 whole generations
and of 9 first tokens each, A B A B ...): the session installs torch and transformers when `lm`
is among the benchmarks; run elsewhere without them, the row says it is missing.
"""

import time
from collections.abc import Callable
from functools import partial

import jax
import numpy as np

from dense_armor.nn.models.generation import generate
from dense_armor.nn.models.language_model import TransformerLM
from dense_armor.serving import Server

from .harness import interleaved, record

GPT2_SMALL = dict(vocab=50257, d_model=768, n_heads=12, d_ff=3072, depth=12, max_len=1024)
GPT2_OPTIONS = dict(
    positions="learned", norm="layer", feed_forward="mlp", activation="gelu_tanh", eps=1e-5,
    use_bias=True,
)  # fmt: skip
PROMPT, NEW, ROUNDS = 32, 128, 3
FIRST_ROUNDS = 9  # the first token's time varies most from call to call


def _gpt2_small() -> TransformerLM:
    a = GPT2_SMALL
    return TransformerLM(
        a["vocab"], a["d_model"], a["n_heads"], a["d_ff"], a["depth"], jax.random.PRNGKey(0),
        a["max_len"], **GPT2_OPTIONS,
    )  # fmt: skip


def copy_bandwidth(megabytes: int = 512) -> float:
    """Bytes per second a NumPy copy moves (read and written: twice its size), the best of 5."""
    a = np.ones(megabytes * 2**20 // 4, np.float32)
    b = np.empty_like(a)
    best = min(_timed(lambda: np.copyto(b, a)) for _ in range(5))
    return 2 * a.nbytes / best


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run() -> str:
    model = _gpt2_small()
    weights = sum(leaf.nbytes for leaf in jax.tree.leaves(model) if hasattr(leaf, "nbytes"))
    rng = np.random.default_rng(0)
    lines = [
        "\nlanguage model decoding: GPT-2-small shape (124M parameters, float32), greedy, "
        f"prompt {PROMPT}, {NEW} new tokens (each system's figures interleaved with the other's)",
        f"{'system':<40}{'tokens/s':>10}{'first token ms':>16}",
    ]
    bandwidth = copy_bandwidth()
    limit = bandwidth / weights  # tokens per second at batch 1 if each token reads every weight
    for batch in (1, 8):
        prompts = rng.integers(0, GPT2_SMALL["vocab"], (batch, PROMPT)).astype(np.int32)
        runs = {
            "dense_armor": lambda new, p=prompts: generate(model, p, new).tokens,
            **_transformers(prompts),
        }
        whole = interleaved({n: partial(f, NEW) for n, f in runs.items()}, ROUNDS, warmup=1)
        first = interleaved({n: partial(f, 1) for n, f in runs.items()}, FIRST_ROUNDS, warmup=1)
        rate = {name: batch * NEW / seconds for name, seconds in whole.items()}
        for name in runs:
            record(f"lm {_figure(name)} B={batch}/per new token", 1 / rate[name])
            record(f"lm {_figure(name)} B={batch}/first token", first[name])
        ours = f"dense_armor generate, B={batch}"
        lines.append(f"{ours:<40}{rate['dense_armor']:>10.1f}{first['dense_armor'] * 1e3:>16.1f}")
        if batch == 1:
            lines.append(
                f"{'bandwidth limit, B=1':<40}{limit:>10.1f}"
                f"   ({weights / 1e6:.0f} MB of weights over {bandwidth / 1e9:.1f} GB/s copied;"
                f" generate at {limit / rate['dense_armor']:.2f}x the limit's time)"
            )
        label = f"transformers generate, B={batch}"
        if "transformers" not in runs:
            lines.append(f"{label:<40}{'missing: torch and transformers not installed':>46}")
            continue
        lines.append(
            f"{label:<40}{rate['transformers']:>10.1f}{first['transformers'] * 1e3:>16.1f}"
            f"   (dense_armor: {rate['dense_armor'] / rate['transformers']:.2f}x the tokens/s; "
            f"first token in {first['dense_armor'] / first['transformers']:.2f}x the time)"
        )
    lines.append(_continuous_batching(model, rng))
    return "\n".join(lines)


def _figure(name: str) -> str:
    """The recorded figures' names: dense_armor's as `lm generate`."""
    return "generate" if name == "dense_armor" else name


def _transformers(prompts: np.ndarray) -> dict[str, Callable[[int], object]]:
    """transformers' `generate` (PyTorch, its KV cache on, greedy, every row the tokens asked
    for) on a `GPT2LMHeadModel` of the same shape and random weights, as `{"transformers": run}`
    (`run(new)`), or nothing where torch and transformers are not installed."""
    try:
        import torch
        import transformers
    except ImportError:
        return {}
    torch.manual_seed(0)
    a = GPT2_SMALL
    config = transformers.GPT2Config(
        vocab_size=a["vocab"], n_positions=a["max_len"], n_embd=a["d_model"], n_layer=a["depth"],
        n_head=a["n_heads"], n_inner=a["d_ff"],
    )  # fmt: skip
    return {"transformers": torch_generate(transformers.GPT2LMHeadModel(config).eval(), prompts)}


def torch_generate(model: object, prompts: np.ndarray) -> Callable[[int], None]:
    """`run(new)`: transformers' `generate` of `model` after `prompts`, greedy, its KV cache on,
    every row exactly `new` tokens."""
    import torch

    ids = torch.tensor(prompts, dtype=torch.long)
    mask = torch.ones_like(ids)

    def run(new: int) -> None:
        with torch.no_grad():
            model.generate(  # type: ignore[attr-defined]
                ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                do_sample=False, use_cache=True, pad_token_id=0,
            )  # fmt: skip

    return run


def _continuous_batching(model: TransformerLM, rng: np.random.Generator) -> str:
    requests = [
        (rng.integers(0, GPT2_SMALL["vocab"], int(n)).tolist(), int(m))
        for n, m in zip(rng.integers(4, 33, 64), rng.integers(8, 65, 64), strict=True)
    ]
    total = sum(m for _, m in requests)
    server = Server(model, slots=8, capacity=128, chunk=16)
    server.warm_up()  # every function it will run, compiled
    start = time.perf_counter()
    server.serve(requests)
    served = time.perf_counter() - start
    batches = [requests[i : i + 8] for i in range(0, len(requests), 8)]
    generate(model, [p for p, _ in batches[0]], max(m for _, m in batches[0]), capacity=128)
    start = time.perf_counter()
    for batch in batches:  # each compiles once per common prompt length and length: warm both
        generate(model, [p for p, _ in batch], max(m for _, m in batch), capacity=128)
    cold = time.perf_counter() - start
    start = time.perf_counter()
    for batch in batches:
        generate(model, [p for p, _ in batch], max(m for _, m in batch), capacity=128)
    fixed = time.perf_counter() - start
    paged = _paged(model, requests, rng)
    record("lm serving/continuous, per new token", served / total)
    record("lm serving/fixed batches, per new token", fixed / total)
    return "\n".join(
        [
            f"\ncontinuous batching: 64 requests ({total} new tokens), 8 slots, same model",
            f"{'system':<40}{'tokens/s':>10}{'seconds':>10}",
            f"{'Server, 8 slots':<40}{total / served:>10.1f}{served:>10.1f}",
            f"{'generate, fixed batches of 8 (warm)':<40}{total / fixed:>10.1f}{fixed:>10.1f}",
            f"{'  first pass (compiles new shapes)':<40}{total / cold:>10.1f}{cold:>10.1f}",
            paged,
        ]
    )


def _served(server: Server, requests: list) -> tuple[float, float]:
    """Tokens per second of a warm server over `requests`, and its mean busy slots."""
    server.serve(requests)  # compile every width and batch
    busy, start = [], time.perf_counter()
    for prompt, new in requests:
        server.submit(prompt, new)
    while not server.idle:
        server.step()
        busy.append(server.busy)
    seconds = time.perf_counter() - start
    return sum(m for _, m in requests) / seconds, float(np.mean(busy))


def _paged(model: TransformerLM, requests: list, rng: np.random.Generator) -> str:
    """The same workload at the cache memory of 8 slots x 1024 positions: fixed slots against
    pages (512 pages of 16, the null page apart), and a shared 512-token system prompt."""
    lines = [
        "\npaged cache: the same 64 requests at the memory of 8 slots x 1024 positions",
        f"{'system':<40}{'tokens/s':>10}{'mean busy':>12}",
    ]
    servers = {
        "Server, 8 fixed slots of 1024": Server(model, 8, 1024),
        "Server, 32 slots, 513 pages of 16": Server(model, 32, 1024, pages=513),
        "Server, 64 slots, 513 pages of 16": Server(model, 64, 1024, pages=513),
    }
    for name, server in servers.items():
        rate, busy = _served(server, requests)
        record(f"lm serving/{name}, per new token", 1 / rate)
        lines.append(f"{name:<40}{rate:>10.1f}{busy:>12.1f}")
    system = rng.integers(0, GPT2_SMALL["vocab"], 512).tolist()
    asks = [system + rng.integers(0, GPT2_SMALL["vocab"], 16).tolist() for _ in range(6)]
    for share in (False, True):
        server = Server(model, 8, 1024, pages=513, share_prefixes=share)
        server.serve([(asks[0], 1)])  # the first request computes (and keys) the prefix
        first = [server.serve([(ask, 1)])[0].time_to_first_token for ask in asks[1:]]
        record(f"lm serving/shared prompt, sharing {share}, first token", float(np.median(first)))
        lines.append(
            f"{'528-token prompts, 512 shared, ' + ('shared' if share else 'not shared'):<40}"
            f"{'first token ' + format(np.median(first) * 1e3, '.0f') + ' ms':>22}"
        )
    return "\n".join(lines)
