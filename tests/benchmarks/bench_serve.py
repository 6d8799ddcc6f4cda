"""Serving under load over HTTP: `dense-armor serve --http` against `transformers serve`
(transformers' OpenAI-compatible server with continuous batching), the same GPT-2-small-shaped
model (random weights, float32) and the same tokenizer, on loopback.

Each server runs alone (one after the other, twice: A B A B, the better run of each kept), with
`CLIENTS` concurrent clients, each sending `REQUESTS` streaming completions in turn (a prompt of
`PROMPT` random tokens, `NEW` new tokens, greedy; every count bounded). Per request: the time to
the first token (from sending to the first chunk with text) and the gaps between later chunks;
over the run: requests and tokens per second (tokens counted in the answers' text: the tokenizer
has one word per id). The servers' functions are warmed before the clock starts.
"""

import concurrent.futures
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

import numpy as np

from .harness import record

VOCAB, D, LAYERS, HEADS, POSITIONS = 50257, 768, 12, 12, 1024
CLIENTS, REQUESTS, PROMPT, NEW, SLOTS = (1, 8), 4, 16, 32, 8
START_TIMEOUT, REQUEST_TIMEOUT = 600, 300


def _model_directory(root: pathlib.Path) -> pathlib.Path | None:
    """A GPT-2-small-shaped model saved by transformers, with a word-per-id tokenizer; None
    where torch and transformers are not installed."""
    try:
        import torch
        import transformers
        from tokenizers import Tokenizer, models, pre_tokenizers
    except ImportError:
        return None
    directory = root / "gpt2-random"
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=POSITIONS, n_embd=D, n_layer=LAYERS, n_head=HEADS,
        bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    transformers.GPT2LMHeadModel(config).eval().save_pretrained(directory)
    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": POSITIONS})
    )
    return directory


def _start(command: list[str], pattern: str, env: dict[str, str]) -> tuple[subprocess.Popen, str]:
    """Start a server; its base URL once a line of its output matches `pattern`."""
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    found: list[str] = []

    def watch() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            if not found and (match := re.search(pattern, line)):
                found.append(match.group(1))

    threading.Thread(target=watch, daemon=True).start()
    deadline = time.monotonic() + START_TIMEOUT
    while not found and time.monotonic() < deadline and process.poll() is None:
        time.sleep(0.2)
    if not found:
        process.kill()
        raise RuntimeError(f"{command[:4]} did not start")
    return process, found[0]


def _stop(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGINT)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=30)


def _stream(url: str, model: str, prompt: str) -> tuple[float, list[float], int]:
    """One streaming completion: (seconds to the first text, gaps between chunks, tokens)."""
    body = {"model": model, "prompt": prompt, "max_tokens": NEW, "temperature": 0,
            "stream": True}  # fmt: skip
    request = urllib.request.Request(
        f"{url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    start, times, text = time.perf_counter(), [], []
    with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT) as answer:
        for raw in answer:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[6:]).get("choices") or [{}]
            piece = choices[0].get("text") or ""
            if piece:
                times.append(time.perf_counter())
                text.append(piece)
    first = times[0] - start if times else float("nan")
    return first, list(np.diff(times)), len("".join(text).split())


def _load(url: str, model: str, clients: int, rng: np.random.Generator) -> dict[str, float]:
    prompts = [
        [" ".join(f"w{i}" for i in rng.integers(0, VOCAB, PROMPT)) for _ in range(REQUESTS)]
        for _ in range(clients)
    ]

    def client(mine: list[str]) -> list[tuple[float, list[float], int]]:
        return [_stream(url, model, p) for p in mine]

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        results = [r for rs in pool.map(client, prompts) for r in rs]
    wall = time.perf_counter() - start
    firsts = np.array([r[0] for r in results])
    gaps = np.array([g for r in results for g in r[1]] or [np.nan])
    return {
        "ttft p50": float(np.median(firsts)), "ttft p99": float(np.percentile(firsts, 99)),
        "itl": float(np.median(gaps)), "requests/s": len(results) / wall,
        "tokens/s": sum(r[2] for r in results) / wall,
    }  # fmt: skip


def _ours(directory: pathlib.Path, root: pathlib.Path, env: dict[str, str]) -> tuple[list, str]:
    checkpoint = root / "ckpt"
    if not checkpoint.exists():
        subprocess.run(
            [sys.executable, "-m", "dense_armor.cli", "import-hf", str(directory), "--out",
             str(checkpoint)], check=True, env=env, capture_output=True,
        )  # fmt: skip
    command = [
        sys.executable, "-m", "dense_armor.cli", "serve", str(checkpoint), "--http", "--port",
        "0", "--slots", str(SLOTS), "--capacity", "256", "--name", "bench", "--max-queue", "256",
    ]  # fmt: skip
    return command, "bench"


def _theirs(directory: pathlib.Path) -> tuple[list, str] | None:
    exe = shutil.which("transformers", path=os.path.dirname(sys.executable))
    if exe is None:
        return None
    command = [
        exe, "serve", str(directory), "--continuous-batching", "--device", "cpu", "--dtype",
        "float32", "--host", "127.0.0.1", "--port", "8391", "--log-level", "info",
    ]  # fmt: skip
    return command, str(directory)


def run() -> str:
    return _structured() + _http()


# Structured output's cost in the engine (in process, no HTTP): a byte-level model (vocabulary
# 256) of this shape, `SLOTS` slots, `STRUCTURED_REQUESTS` requests of a 16-token prompt and up
# to 64 new tokens, greedy; its schema bounds every field, so a constrained answer ends.
STRUCTURED_SHAPE = {"d_model": 256, "n_heads": 4, "d_ff": 1024, "depth": 4}
STRUCTURED_REQUESTS = 64
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24}, "count": {"type": "integer"},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
    },
    "required": ["name", "count", "tags"], "additionalProperties": False,
}  # fmt: skip


def _byte_tokenizer() -> object:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _structured_load(
    model: object, structured: bool, grammars: object, lengths: list[int] | None
) -> tuple[float, list[int]]:
    """Decoded tokens per second of one load (the server warmed first), and each request's
    tokens: constrained by `SCHEMA` when `lengths` is None, else unconstrained and that long."""
    from dense_armor.serving import Server

    server = Server(model, SLOTS, 96, structured=structured)
    server.warm_up()
    prompts = np.random.default_rng(0).integers(0, 256, (STRUCTURED_REQUESTS, 16)).tolist()
    for n, prompt in enumerate(prompts):
        if lengths is None:
            grammar = grammars.json_schema(SCHEMA)  # type: ignore[attr-defined]
            server.submit(prompt, 64, constraint=grammar)
        else:
            server.submit(prompt, lengths[n])
    start = time.perf_counter()
    done = sorted(server.run(), key=lambda c: c.number)
    made = [len(c.tokens) for c in done]
    return sum(made) / (time.perf_counter() - start), made


def _structured() -> str:
    """Tokens per second of requests constrained by `SCHEMA`, and of unconstrained requests of
    the same prompts and lengths (as many prefills and tokens) on a server without grammars and
    on one with them (A B C three times, the best run of each kept)."""
    import importlib.util

    if importlib.util.find_spec("llguidance") is None:
        return "\nstructured output: missing: llguidance not installed"
    import jax

    from dense_armor.nn.models.language_model import TransformerLM
    from dense_armor.serving.grammar import Grammars

    sh = STRUCTURED_SHAPE
    model = TransformerLM(256, sh["d_model"], sh["n_heads"], sh["d_ff"], sh["depth"],
                          jax.random.PRNGKey(0), 96)  # fmt: skip
    grammars = Grammars(_byte_tokenizer(), 256)
    best: dict[str, float] = {}
    for _ in range(3):
        rate, lengths = _structured_load(model, True, grammars, None)
        rates = {"constrained by a JSON schema": rate}
        rates["unconstrained"] = _structured_load(model, False, grammars, lengths)[0]
        rates["unconstrained, structured server"] = _structured_load(
            model, True, grammars, lengths
        )[0]
        for name, rate in rates.items():
            best[name] = max(best.get(name, 0.0), rate)
    base = best["unconstrained"]
    lines = [
        f"\nstructured output in the engine: d_model {sh['d_model']}, {sh['depth']} layers, "
        f"vocabulary 256, {SLOTS} slots, {STRUCTURED_REQUESTS} requests of 16 prompt tokens, "
        f"greedy; each constrained answer ends with its JSON ({sum(lengths)} tokens), each "
        "unconstrained one is as long",
        f"{'requests':<36}{'tokens/s':>10}{'vs unconstrained':>18}",
    ]
    for name in (
        "unconstrained",
        "unconstrained, structured server",
        "constrained by a JSON schema",
    ):
        record(f"serve structured {name}/per token", 1 / best[name])
        lines.append(f"{name:<36}{best[name]:>10.1f}{best[name] / base:>17.2f}x")
    return "\n".join(lines)


def _http() -> str:
    with tempfile.TemporaryDirectory() as tmp:
        root = pathlib.Path(tmp)
        directory = _model_directory(root)
        if directory is None:
            return "\nserving: missing: torch and transformers not installed"
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        systems = {"dense_armor": _ours(directory, root, env)}
        theirs = _theirs(directory)
        if theirs is not None:
            systems["transformers serve"] = theirs
        patterns = {"dense_armor": r"on (http://\S+)", "transformers serve": r"(http://\S+:8391)"}
        best: dict[tuple[str, int], dict[str, float]] = {}
        for _ in range(2):  # A B A B
            for name, (command, model) in systems.items():
                process, url = _start(command, patterns[name], env)
                try:
                    _load(url, model, 2, np.random.default_rng(1))  # warm
                    for clients in CLIENTS:
                        got = _load(url, model, clients, np.random.default_rng(clients))
                        kept = best.get((name, clients))
                        if kept is None or got["tokens/s"] > kept["tokens/s"]:
                            best[(name, clients)] = got
                finally:
                    _stop(process)
    return _table(best, list(systems))


def _table(best: dict[tuple[str, int], dict[str, float]], names: list[str]) -> str:
    lines = [
        f"\nserving over HTTP: GPT-2-small shape (random weights, float32), {SLOTS} slots, "
        f"streaming completions of {PROMPT} prompt and {NEW} new tokens, {REQUESTS} per client",
        f"{'server':<22}{'clients':>8}{'tokens/s':>10}{'requests/s':>12}{'ttft p50 ms':>13}"
        f"{'ttft p99 ms':>13}{'itl ms':>9}",
    ]
    for clients in CLIENTS:
        for name in names:
            f = best[(name, clients)]
            record(f"serve {name} clients={clients}/per token", 1 / f["tokens/s"])
            lines.append(
                f"{name:<22}{clients:>8}{f['tokens/s']:>10.1f}{f['requests/s']:>12.2f}"
                f"{f['ttft p50'] * 1e3:>13.1f}{f['ttft p99'] * 1e3:>13.1f}{f['itl'] * 1e3:>9.1f}"
            )
        if len(names) == 2:
            ours, theirs = (best[(n, clients)] for n in names)
            lines.append(
                f"{'':<22}{'':>8}  {ours['tokens/s'] / theirs['tokens/s']:.2f}x its tokens/s, "
                f"p99 first token {ours['ttft p99'] / theirs['ttft p99']:.2f}x its time"
            )
    return "\n".join(lines)
