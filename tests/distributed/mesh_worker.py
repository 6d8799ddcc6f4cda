"""Generation and the server over a mesh of 8 forced host devices, against one device: the runs of
tests/test_mesh_generation.py, as a script (its own JAX process, started with
`--xla_force_host_platform_device_count=8`).

    python mesh_worker.py OUT_JSON

Writes `{check name: result}` as JSON to OUT_JSON: the tokens of each run on one device and on
the mesh, the compilations counted while a warm server serves, where the caches lie, the bytes
one device holds, and the errors of meshes that cannot split a model.
"""

import contextlib
import io
import json
import os
import pathlib
import sys
import time

import jax
import numpy as np
from jax import monitoring

from dense_armor.checkpoints import ModelConfig, save_checkpoint
from dense_armor.cli import main as cli
from dense_armor.distributed import device_mesh
from dense_armor.nn.models.generation import generate, stream_tokens
from dense_armor.nn.models.language_model import TransformerLM
from dense_armor.serving import Server

assert jax.device_count() == 8, "run with --xla_force_host_platform_device_count=8"
out, results = pathlib.Path(sys.argv[1]), {}
work = out.parent
KEY = jax.random.PRNGKey(3)
rng = np.random.default_rng(0)
PROMPTS = [rng.integers(0, 97, n).tolist() for n in (4, 9, 6)]
NEW = [5, 6, 3]
MESH4 = device_mesh(model=4, devices=jax.devices()[:4])
MESH8 = device_mesh(model=8)
compiles = [0]


def listen(event, duration, **kwargs):
    if event == "/jax/core/compile/jaxpr_to_mlir_module_duration":  # any compilation
        compiles[0] += 1


monitoring.register_event_duration_secs_listener(listen)


def tokens(generation):
    return np.asarray(generation.tokens).tolist()


T0 = time.time()


def stamp(name):
    if os.environ.get("MESH_TIMES"):
        print(f"{time.time() - T0:7.1f} s  {name}", flush=True)


def pair(name, model, mesh, **settings):
    """The tokens of `generate` on one device and on `mesh`."""
    one = generate(model, PROMPTS, max(NEW), **settings)
    split = generate(model, PROMPTS, max(NEW), mesh=mesh, **settings)
    results[name] = {"one": tokens(one), "mesh": tokens(split)}
    stamp(name)


def device_bytes(tree):
    """Bytes of `tree`'s arrays: on device 0, and in all (each array's global size)."""
    leaves = [a for a in jax.tree.leaves(tree) if isinstance(a, jax.Array)]
    first = jax.devices()[0]
    held = sum(s.data.nbytes for a in leaves for s in a.addressable_shards if s.device == first)
    return {"device 0": int(held), "whole": int(sum(a.nbytes for a in leaves))}


def served(name, model, mesh, warm, **settings):
    """A server on `mesh` serving the prompts twice: its tokens, the compilations of each pass,
    where its caches lie and what device 0 holds of them and of the weights."""
    server = Server(model, slots=2, capacity=16, chunk=4, mesh=mesh, **settings)
    if warm:
        server.warm_up()
    passes = []
    for _ in range(2):
        before = compiles[0]
        done = server.serve(zip(PROMPTS, NEW, strict=True))
        passes.append({"compiles": compiles[0] - before, "tokens": [c.tokens for c in done]})
    kv = [a for a in jax.tree.leaves(server.caches) if a.ndim >= 3]
    results[name] = {
        "passes": [{**p, "tokens": [list(map(int, t)) for t in p["tokens"]]} for p in passes],
        "cache specs": sorted({str(a.sharding.spec) for a in kv}),
        "cache bytes": device_bytes(kv),
        "weight bytes": device_bytes(server.model),
    }
    stamp(name)


def refusal(name, call):
    try:
        call()
        results[name] = None
    except (TypeError, ValueError) as error:
        results[name] = f"{type(error).__name__}: {error}"


gqa = TransformerLM(97, 64, 8, 128, 2, jax.random.PRNGKey(0), 64, n_kv_heads=4)
pair("greedy", gqa, MESH4)
pair("sampled", gqa, MESH4, key=KEY, temperature=0.9, top_k=20)
pair("int8 cache", gqa, MESH4, kv_dtype="int8")
results["stream"] = {
    "one": tokens(generate(gqa, PROMPTS[2:], 12)),
    "mesh": [list(stream_tokens(gqa, PROMPTS[2], 12, mesh=MESH4))],
}
results["reference"] = tokens(generate(gqa, PROMPTS, max(NEW)))
results["sampled reference"] = tokens(
    generate(gqa, PROMPTS, max(NEW), KEY, temperature=0.9, top_k=20)
)
served("fixed", gqa, MESH4, warm=False)
served("paged", gqa, MESH4, warm=True, pages=10, page_size=4)
served("sampled paged", gqa, MESH4, warm=False, pages=10, page_size=4, key=KEY,
       temperature=0.9, top_k=20)  # fmt: skip
stacked = TransformerLM(97, 64, 8, 128, 2, jax.random.PRNGKey(1), 64, scan_layers=True)
pair("scanned layers over 8", stacked, MESH8)
mixed = TransformerLM(97, 64, 8, 128, 2, jax.random.PRNGKey(2), 64, mixers=["mingru", "attention"])
pair("recurrent mixer", mixed, MESH4)
experts = TransformerLM(
    97, 64, 8, 128, 2, jax.random.PRNGKey(4), 64, feed_forward="moe", n_experts=4, top_k=2
)
pair("experts", experts, MESH8)
refusal("kv heads", lambda: generate(gqa, PROMPTS, 2, mesh=MESH8))
refusal("data axis", lambda: generate(gqa, PROMPTS, 2, mesh=device_mesh(model=4)))
refusal("not a mesh", lambda: Server(gqa, mesh="model=4"))


def command(*args):
    """`dense-armor ARGS` in this process: its exit status, standard output and error."""
    printed, errors = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(errors):
        status = cli([str(a) for a in args])
    return {"status": status, "out": printed.getvalue(), "err": errors.getvalue()}


ARGUMENTS = {"vocab": 97, "d_model": 64, "n_heads": 8, "d_ff": 128, "depth": 2, "max_len": 64}
saved = save_checkpoint(
    work / "ckpt", gqa, ModelConfig("transformer_lm", {**ARGUMENTS, "n_kv_heads": 4})
)
ids = ["--ids", ",".join(map(str, PROMPTS[2])), "--max-new-tokens", "12"]
results["cli generate"] = {
    "one": command("generate", saved, *ids),
    "mesh": command("generate", saved, *ids, "--mesh", "model=4"),
    "too many": command("generate", saved, *ids, "--mesh", "model=16"),
}
lines = [json.dumps({"ids": p, "max_new_tokens": n}) for p, n in zip(PROMPTS, NEW, strict=True)]
(work / "requests.jsonl").write_text("\n".join(lines) + "\n")
results["cli serve"] = command(
    "serve", saved, "--input", work / "requests.jsonl", "--slots", 2, "--chunk", 4,
    "--mesh", "model=4",
)  # fmt: skip
out.write_text(json.dumps(results))
