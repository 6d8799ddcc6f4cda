"""The device lane's serving rows: a language model served by `Server` on the machine's
accelerator (fixed and paged slots, several decoding steps per dispatch), and `generate` at batch
1, each against the bandwidth roofline of what its decoding step reads.

The shape is Llama-3.2-1B's (vocabulary 128256, d_model 2048, 16 layers, 32 heads and 8
key/value heads, d_ff 8192; random weights, `scan_layers=True`) cast to bfloat16; every request
a prompt of `PROMPT` random tokens and `NEW` new tokens, greedy, all submitted before the clock
starts. A row's tokens per second count every new token over the whole run (the prefills
included); its decoding tokens per second those after each request's first, from the moment all
requests have one; its roofline is what the chip's memory bandwidth allows a decoding step: the
weights once, and each slot's key/value rows (on average half the new tokens past its prompt),
for `slots` tokens. The suite runs the same code on the CPU with a tiny shape
(tests/test_device_lane.py).
"""

import functools
import json
import pathlib
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

LLAMA_1B = dict(vocab=128256, d_model=2048, n_heads=32, d_ff=8192, depth=16, n_kv_heads=8)
# Llama-3.1-8B's shape, int8 (8.0 GB of projections, 2.1 GB of tables): what fits one v5e chip
LLAMA_8B_INT8 = dict(
    vocab=128256, d_model=4096, n_heads=32, d_ff=14336, depth=32, n_kv_heads=8, quantize="int8"
)
PROMPT, NEW, CAPACITY, PAGE_SIZE = 128, 128, 256, 16
# the memory bandwidth of each device kind's chip, bytes per second (its maker's figure)
BANDWIDTH = {"TPU v5 lite": 819e9, "TPU v5e": 819e9, "TPU v6 lite": 1640e9, "TPU v4": 1200e9}


def model_of(shape: dict[str, int], max_len: int) -> Any:
    """A `TransformerLM` of `shape` (random weights, layers scanned) in bfloat16; with
    `"quantize": "int8"` in `shape`, its projections int8 (per output channel, the embedding
    tables bfloat16 and untied, as Llama-3.1-8B's), made on the device from the model's shapes
    alone (no float copy of the weights: an 8B model's would not fit the chip)."""
    import jax

    from dense_armor.nn import precision
    from dense_armor.nn.models.language_model import TransformerLM

    s = shape
    if s.get("quantize") == "int8":
        return _int8_model(s, max_len)
    model = TransformerLM(
        s["vocab"], s["d_model"], s["n_heads"], s["d_ff"], s["depth"], jax.random.PRNGKey(0),
        max_len, n_kv_heads=s["n_kv_heads"], scan_layers=not s.get("unrolled", False),
    )  # fmt: skip
    return precision.cast(model, "bfloat16")


@functools.cache
def _drawn(shape: tuple[int, ...], dtype: str, kind: str) -> Any:
    """A compiled draw of an array of `shape` and `dtype` for `_int8_model` (one per kind)."""
    import jax
    import jax.numpy as jnp

    def one(key: Any) -> Any:
        if kind == "int8":
            return jax.random.randint(key, shape, -127, 128, jnp.int32).astype(dtype)
        normal = jax.random.normal(key, shape, jnp.float32)
        value = {"norm": 1.0 + 0.02 * normal, "scale": 0.02 / 127 * (1.0 + 0.1 * normal)}
        return value.get(kind, 0.02 * normal).astype(dtype)

    return jax.jit(one)


def _int8_model(s: dict[str, Any], max_len: int) -> Any:
    """`model_of`'s int8 model: every array of the model's shapes drawn on the device (int8
    weights uniform in [-127, 127], scales and the rest normal with a small deviation, norms
    near 1)."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    from dense_armor.nn.models.language_model import TransformerLM

    def build() -> Any:
        return TransformerLM(
            s["vocab"], s["d_model"], s["n_heads"], s["d_ff"], s["depth"], jax.random.PRNGKey(0),
            max_len, n_kv_heads=s["n_kv_heads"], scan_layers=True, tie_embeddings=False,
            param_dtype="bfloat16", quantize="int8",
        )  # fmt: skip

    skeleton = eqx.filter_eval_shape(build)
    leaves, treedef = jax.tree.flatten(skeleton)
    keys = jax.random.split(jax.random.PRNGKey(0), len(leaves))

    def draw(key: Any, leaf: Any) -> Any:
        if not isinstance(leaf, jax.ShapeDtypeStruct):
            return leaf
        if jnp.issubdtype(leaf.dtype, jnp.integer):
            kind = "int8"
        elif leaf.ndim == 1 or (leaf.ndim == 2 and leaf.shape[0] == s["depth"]):
            kind = "norm"
        elif leaf.ndim >= 2 and leaf.shape[-2] == 1:
            kind = "scale"  # an int8 matrix's scales: weights of about 0.02
        else:
            kind = "float"
        return _drawn(leaf.shape, jnp.dtype(leaf.dtype).name, kind)(key)

    return jax.tree.unflatten(
        treedef, [draw(k, leaf) for k, leaf in zip(keys, leaves, strict=True)]
    )


def _bytes(tree: Any) -> int:
    import jax

    return sum(a.nbytes for a in jax.tree.leaves(tree) if hasattr(a, "nbytes"))


def roofline(model: Any, slots: int, bandwidth: float, prompt: int, new: int) -> float:
    """Decoding tokens per second if a step read only the weights once and each of `slots`
    slots' key/value rows (its prompt and half its new tokens, on average), at `bandwidth`."""
    per_position = _bytes(model.init_cache(CAPACITY)) / CAPACITY
    step = _bytes(model) + slots * per_position * (prompt + new / 2)
    return slots * bandwidth / step


def _load(server: Any, prompts: np.ndarray, new: int) -> tuple[float, float]:
    """Serve `prompts`, `new` tokens each: the whole run's seconds, and the seconds from the
    moment every request has its first token to the end."""
    for prompt in prompts:
        server.submit(prompt.tolist(), new)
    begin, first, seen = time.perf_counter(), None, set()
    while not server.idle:
        for event in server.step():
            seen.add(event.id)
        if first is None and len(seen) == len(prompts):
            first = time.perf_counter()
    end = time.perf_counter()
    return end - begin, end - (first or begin)


def serve_row(
    model: Any, slots: int, cache: str, steps: int, warm_up: bool,
    profile: pathlib.Path | None = None, **sizes: int,
) -> Any:  # fmt: skip
    """One configuration's row (see the module; `cache`: "fixed", "paged", or "paged-gather", the
    paged cache read by its gather instead of the TPU's kernel): `warm_up` times
    `Server.warm_up()`, else one run of the same load compiles what the measured run needs.
    `profile`: a third run of the load, traced, summed into `profile/SLOTS-CACHE-STEPS.json`
    (`device_profile`)."""
    import jax

    from dense_armor.serving import Server

    prompt, new, capacity = sizes["prompt"], sizes["new"], sizes["capacity"]
    pages = {}
    if cache != "fixed":
        pages = {"pages": slots * -(-capacity // PAGE_SIZE) + 1, "page_size": PAGE_SIZE}
        pages["paged_attention"] = "gather" if cache == "paged-gather" else "auto"
    server = Server(model, slots, capacity, decode_steps=steps, **pages)
    prompts = np.random.default_rng(slots).integers(0, model.vocab, (slots, prompt), np.int32)
    begin = time.perf_counter()
    if warm_up:
        server.warm_up()
    warmed = time.perf_counter() - begin
    _load(server, prompts, new)  # (with warm_up: compiles nothing)
    warm = time.perf_counter() - begin
    whole, decoding = _load(server, (prompts + 1) % model.vocab, new)
    if profile is not None:
        _profiled(server, (prompts + 2) % model.vocab, new, profile / f"{slots}-{cache}-{steps}")
    device = jax.devices()[0]
    bandwidth = BANDWIDTH.get(getattr(device, "device_kind", ""), 0.0)
    ceiling = roofline(model, slots, bandwidth, prompt, new) if bandwidth else None
    decode_rate = slots * (new - 1) / decoding if decoding > 0 else None
    return {
        "kind": "serve", "slots": slots, "cache": cache,
        "decode_steps": steps, "tokens_per_s": round(slots * new / whole, 1),
        "decode_tokens_per_s": None if decode_rate is None else round(decode_rate, 1),
        "roofline_tokens_per_s": None if ceiling is None else round(ceiling, 1),
        "share": None if not (ceiling and decode_rate) else round(decode_rate / ceiling, 3),
        "warm_up_s": round(warmed, 1) if warm_up else None, "first_run_s": round(warm, 1),
    }  # fmt: skip


def _profiled(server: Any, prompts: np.ndarray, new: int, where: pathlib.Path) -> None:
    """The load once more under the profiler, its trace summed into `where.json`."""
    import device_profile

    with device_profile.traced(where):
        seconds, _ = _load(server, prompts, new)
    summary = device_profile.summarize(where, seconds)
    device_profile.write(summary, where.with_suffix(".json"))
    print(device_profile.brief(summary), flush=True)


def generate_row(model: Any, prompt: int, new: int) -> dict[str, Any]:
    """`generate` at batch 1: new tokens per second of its decoding (the second of two runs)."""
    import jax

    from dense_armor.nn.models.generation import generate

    ids = np.random.default_rng(1).integers(0, model.vocab, (1, prompt), np.int32)

    def seconds(count: int) -> float:  # the best of 3, once compiled
        np.asarray(generate(model, ids, count).tokens)
        best = float("inf")
        for _ in range(3):
            begin = time.perf_counter()
            np.asarray(generate(model, ids, count).tokens)
            best = min(best, time.perf_counter() - begin)
        return best

    # the prefill and first token alone, then with the decoding
    rate = (new - 2) / max(seconds(new) - seconds(2), 1e-9)
    device = jax.devices()[0]
    bandwidth = BANDWIDTH.get(getattr(device, "device_kind", ""), 0.0)
    ceiling = roofline(model, 1, bandwidth, prompt, new) if bandwidth else None
    return {
        "kind": "generate", "slots": 1, "cache": "fixed", "decode_steps": None,
        "tokens_per_s": None, "decode_tokens_per_s": round(rate, 1),
        "roofline_tokens_per_s": None if ceiling is None else round(ceiling, 1),
        "share": None if ceiling is None else round(rate / ceiling, 3),
        "warm_up_s": None, "first_run_s": None,
    }  # fmt: skip


CACHES = ("fixed", "paged", "paged-gather")


def parse(configs: str) -> list[tuple[int, str, int, bool]]:
    """`SLOTS:fixed|paged|paged-gather:STEPS[:warm]`, comma separated (e.g.
    "64:paged:8,8:fixed:8:warm")."""
    found = []
    for item in configs.split(","):
        parts = item.split(":")
        if parts[1] not in CACHES:
            raise ValueError(f"{item!r}: the cache is one of {CACHES}")
        found.append((int(parts[0]), parts[1], int(parts[2]), parts[-1] == "warm"))
    return found


def label_of(shape: dict[str, Any]) -> str:
    """A row's model: its shape's name and weights, as the report's table shows it."""
    name = {2048: "Llama-3.2-1B", 4096: "Llama-3.1-8B"}.get(shape["d_model"], "tiny")
    unrolled = ", layers unrolled" if shape.get("unrolled") else ""
    return f"{name} {shape.get('quantize', 'bfloat16')}{unrolled}"


def run(
    rows: pathlib.Path, configs: Sequence[tuple[int, str, int, bool]], shape: dict[str, int],
    sizes: dict[str, int], budget_s: float, with_generate: bool = True,
    profile: pathlib.Path | None = None,
) -> None:  # fmt: skip
    """`generate`'s row (`with_generate`), then each configuration's, appended to `rows` as each
    finishes; none started past `budget_s` seconds."""
    started = time.perf_counter()
    model = model_of(shape, sizes["capacity"])
    label = {"model": label_of(shape)}
    if with_generate:
        with rows.open("a") as out:
            row = {**label, **generate_row(model, sizes["prompt"], sizes["new"])}
            out.write(json.dumps(row) + "\n")
    for slots, cache, steps, warm in configs:
        if time.perf_counter() - started > budget_s:
            print(f"serving: out of time before {slots}:{cache}:{steps}", flush=True)
            break
        row = {**label, **serve_row(model, slots, cache, steps, warm, profile, **sizes)}
        print(json.dumps(row), flush=True)
        with rows.open("a") as out:
            out.write(json.dumps(row) + "\n")
