"""Nothing an exported function computes indexes outside its buffer, in any runtime.

XLA drops an out-of-range scatter update and clamps a gather; IREE may write or read past the
buffer instead. So every index a scatter, gather or dynamic slice of an exported function
computes must lie inside its buffer by construction. Two kinds of test hold that:

- an audit of every such site in every exported function of every family (a new site fails the
  audit until it is read and listed in `AUDITED` with the reason it is safe);
- each family's static modules run past their limit (3 steps past it, a prefill chunk that
  overflows, out-of-vocabulary ids) in IREE on `local-sync` and `local-task` and through the C
  runner, in subprocesses under glibc's `MALLOC_CHECK_=3`, and the overflowing calls under
  valgrind where it is installed, so a write past the end fails the test instead of passing by
  luck. Each checks the overflow contract: the flag set, NaN outputs, the written rows unchanged.
"""

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from dense_armor.checkpoints import ModelConfig
from dense_armor.export import export_model, load
from dense_armor.export.iree import compile_artifact
from dense_armor.export.lowering import Lowering
from dense_armor.export.standalone import (
    _error,
    _past_label,
    _past_the_golden,
    build_runner,
    check_iree,
    default_plugin,
    file_table,
    run_iree,
)
from dense_armor.huggingface import import_hf
from test_language_models import DATA

ENCODER = {"n_in": 3, "d_model": 8, "n_heads": 2, "d_ff": 16, "n_out": 4, "max_len": 6}
# name: (config, the steps a stream holds (a fixed cache's capacity; None: a ring cache, which
# never fills), static shape)
CAPACITY = 4
FAMILIES = {
    "mixed recurrent and attention encoder": (
        ModelConfig(
            "transformer_encoder",
            {**ENCODER, "depth": 3, "causal": True, "mixers": ["mingru", "attention", "lstm"]},
        ),
        CAPACITY,
        (2, 3),
    ),
    "scanned encoder": (
        ModelConfig(
            "transformer_encoder", {**ENCODER, "depth": 2, "causal": True, "scan_layers": True}
        ),
        CAPACITY,
        (2, 3),
    ),
    "windowed decoder with a context (ring cache)": (
        ModelConfig(
            "transformer_decoder",
            {**ENCODER, "depth": 1, "d_context": 5, "window": 3, "norm_first": True},
        ),
        None,
        (2, 3, 2),
    ),
    "language model": (None, CAPACITY, (2, 3)),
}
MALLOC_CHECK = {"MALLOC_CHECK_": "3", "MALLOC_PERTURB_": "165"}
VALGRIND = shutil.which("valgrind")


def _config_and_model(name):
    config, _, _ = FAMILIES[name]
    if config is None:  # a Llama-like checkpoint: rotary positions, grouped-query heads
        model, arguments = import_hf(DATA / "llama_gqa")
        return ModelConfig("transformer_lm", arguments), model
    return config, config.build(jax.random.PRNGKey(7))


@pytest.fixture(scope="module", params=list(FAMILIES))
def artifact(request, tmp_path_factory):
    """Each family exported (static shapes for cpu) and compiled for IREE's llvm-cpu."""
    name = request.param
    config, model = _config_and_model(name)
    out = tmp_path_factory.mktemp("safety") / "art"
    shape = FAMILIES[name][2]
    export_model(model, config, out, capacity=CAPACITY, platforms=["cpu"], static_shapes=[shape])
    compile_artifact(out, ["llvm-cpu"], jobs=2)
    return name, out


@pytest.fixture(scope="module")
def runner(tmp_path_factory, artifact):
    _, art = artifact
    binary = tmp_path_factory.mktemp("runner") / "runner"
    build_runner(art, binary)
    return binary


def _past_line(stdout, kind, function="step"):
    found = re.search(
        rf"{kind} {function} B=2(?: S=\d)?, 3 steps past the golden (\d+) "
        r"\(overflow: (.*?); streams off contract\)\s+max \|error\| = (\S+)",
        stdout,
    )
    assert found, stdout
    return int(found.group(1)), found.group(2), float(found.group(3))


def _expect_overflow(name, golden, where, broken):
    limit = FAMILIES[name][1]
    assert golden == CAPACITY  # the golden stream, inside the limit
    if limit is None:  # a ring: its stream goes on, every output finite
        assert where == "none"
    else:
        assert where == f"streams 0-1 from step {limit + 1}"
    assert broken == 0.0


@pytest.mark.parametrize("device", ["local-sync", "local-task"])
def test_iree_steps_past_the_limit_under_the_memory_checker(artifact, device):
    name, art = artifact
    done = subprocess.run(
        [sys.executable, str(art / "run.py"), str(art), "--iree", "--device", device,
         "--iree-runner", "iree-run-module", "--steps", str(CAPACITY + 3)],
        capture_output=True, text=True, env={**os.environ, **MALLOC_CHECK}, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"iree-run-module ({device})" in done.stdout
    _expect_overflow(name, *_past_line(done.stdout, "iree"))
    if name == "language model":  # its decoding too, its tokens fed back past the capacity
        _expect_overflow(name, *_past_line(done.stdout, "iree", "sample_step"))


def test_the_c_runner_steps_past_the_limit_under_the_memory_checker(artifact, runner):
    name, art = artifact
    done = subprocess.run(
        [str(runner), str(art), "--plugin", str(default_plugin()), "--steps", str(CAPACITY + 3)],
        capture_output=True, text=True, env={**os.environ, **MALLOC_CHECK}, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    _expect_overflow(name, *_past_line(done.stdout, "pjrt"))
    if name == "language model":
        _expect_overflow(name, *_past_line(done.stdout, "pjrt", "sample_step"))


class _Modules:
    """One family's static `init_cache`, `prefill` and `step` modules called in IREE through
    `run_iree` (`iree-run-module` in a subprocess, under the memory checker, and under valgrind
    where `valgrind` is set), beside the same functions through the JAX loader."""

    def __init__(self, art, work, device):
        self.art, self.work, self.device = art, work, device
        self.manifest = json.loads((art / "manifest.json").read_text())
        stored = load_file(art / self.manifest["weights"]["file"])
        self.weights = [stored[n] for n in self.manifest["weights"]["names"]]
        self.golden = load_file(art / self.manifest["golden"]["file"])
        self.compiled = {c["module"]: c["file"] for c in self.manifest["compiled"]}
        self.jax = load(art)

    def case(self, function):
        return next(c for c in self.manifest["golden"]["static"] if c["function"] == function)

    def call(self, function, plain, cache, valgrind=False):
        entry = next(e for e in self.manifest["static"] if e["function"] == function)
        every = [*self.weights, *plain, *cache]
        runner = shutil.which("iree-run-module") or str(
            pathlib.Path(sys.executable).with_name("iree-run-module")
        )
        wrapper = self.work / ("valgrind" if valgrind else "checked")
        wrapper.write_text(
            "#!/bin/sh\n"
            + "".join(f"export {k}={v}\n" for k, v in MALLOC_CHECK.items())
            + ("exec valgrind -q --error-exitcode=99 " if valgrind else "exec ")
            + f'{runner} "$@"\n'
        )
        wrapper.chmod(0o755)
        return run_iree(
            str(wrapper),
            self.art / self.compiled[entry["bytecode"]],
            [every[i] for i in entry["kept_inputs"]],
            self.manifest["functions"][function]["outputs"],
            entry["shape"],
            self.work,
            self.device,
        )


def _fixed(manifest, function):
    holders = {e["path"]: e["holders"][0] for e in manifest["streaming"]["layout"]}
    names = [i["name"] for i in manifest["functions"][function]["inputs"] if i["role"] == "cache"]
    return [holders[n] == "FixedKVCache" for n in names]


@pytest.mark.parametrize("device", ["local-sync", "local-task"])
def test_a_prefill_chunk_past_the_limit_in_iree(artifact, tmp_path, device):
    """Prefill chunks of 3 from an empty cache until past the limit: the chunk that crosses it
    (its first rows written, the rest not: the writes that share the last slot) and a chunk on a
    full cache. IREE's outputs equal XLA's (the JAX loader), NaN rows and flags included, and
    the rows written before never change."""
    name, art = artifact
    modules = _Modules(art, tmp_path, device)
    limit = FAMILIES[name][1] or CAPACITY + 2 * 3  # a ring: chunks past its window, no limit
    never = FAMILIES[name][1] is None
    inputs = [modules.golden[k] for k in modules.case("prefill")["inputs"]]
    x, cache = inputs[0], inputs[1:]  # the golden chunk, and an empty cache
    fixed = _fixed(modules.manifest, "prefill")
    chunk, filled = x.shape[1], 0
    while filled <= limit:
        crossing = filled < limit < filled + chunk
        valgrind = bool(VALGRIND) and device == "local-sync" and (crossing or filled >= limit)
        y, *new, flags = modules.call("prefill", [x], cache, valgrind=valgrind)
        want_y, want_cache, want_flags = modules.jax.prefill(x, [np.array(c) for c in cache])
        assert _error(y, want_y) < 1e-5, (filled, y, want_y)
        assert max(_error(a, b) for a, b in zip(new, want_cache, strict=True)) < 1e-5
        np.testing.assert_array_equal(flags, want_flags)
        positions = filled + np.arange(chunk)
        np.testing.assert_array_equal(flags, [filled + chunk > limit and not never] * 2)
        assert never or np.isnan(y[:, positions >= limit]).all()
        assert np.isfinite(y[:, (positions < limit) | never]).all()
        for old, now, is_fixed in zip(cache, new, fixed, strict=True):
            if is_fixed and old.ndim == 4:  # keys or values (B, heads, capacity, d_head)
                np.testing.assert_array_equal(old[:, :, :filled], now[:, :, :filled])
            if is_fixed and filled >= limit and not never:  # a full cache: nothing changes
                np.testing.assert_array_equal(old, now)
        cache, filled = new, filled + chunk
    assert filled > limit + 1  # a chunk crossed the limit (or met it), and one came after it


def _rewrite_golden(art, function, edit):
    """The golden case of `function` changed by `edit(golden, case, model)` (`model`: the
    artifact through the JAX loader, which recomputes the outputs), saved, and the manifest's
    sha256 rewritten to match."""
    manifest = json.loads((art / "manifest.json").read_text())
    golden = load_file(art / manifest["golden"]["file"])
    case = next(c for c in manifest["golden"]["static"] if c["function"] == function)
    edit(golden, case, load(art))
    save_file(golden, str(art / manifest["golden"]["file"]))
    manifest["files"] = file_table(art)
    (art / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return golden[case["outputs"][0]]


def _with_ids(art, ids_of):
    """The language model's golden step stream with some ids replaced by `ids_of(ids)`."""

    def edit(golden, case, model):
        xs = golden[case["inputs"][0]] = ids_of(golden[case["inputs"][0]])
        cache, ys = [golden[k] for k in case["inputs"][1:]], []
        for t in range(xs.shape[1]):
            y, cache, flags = model.step(xs[:, t], cache)
            ys.append(np.asarray(y))
        golden[case["outputs"][0]] = np.stack(ys, axis=1)
        for key, array in zip(case["outputs"][1:], [*cache, flags], strict=True):
            golden[key] = np.asarray(array)

    return _rewrite_golden(art, "step", edit)


def test_the_c_runner_and_iree_replay_a_prefill_that_crosses_the_capacity(
    artifact, runner, tmp_path
):
    """The golden prefill chunk (3 steps) moved onto a cache that already holds 3 of its 4 steps,
    its outputs, cache and flags recomputed through the JAX loader: the C runner and `run.py
    --iree` reproduce that overflowing chunk, NaN rows included, under the memory checker."""
    name, art = artifact
    copy = tmp_path / "art"
    shutil.copytree(art, copy)

    def onto_a_fuller_cache(golden, case, model):
        x, *cache = (golden[k] for k in case["inputs"])
        _, cache, _ = model.prefill(x, cache)
        for key, array in zip(case["inputs"][1:], cache, strict=True):
            golden[key] = np.asarray(array)
        y, cache, flags = model.prefill(x, [golden[k] for k in case["inputs"][1:]])
        for key, array in zip(case["outputs"], [y, *cache, flags], strict=True):
            golden[key] = np.asarray(array)

    y = _rewrite_golden(copy, "prefill", onto_a_fuller_cache)
    if FAMILIES[name][1] is None:  # a ring never fills
        assert np.isfinite(y).all()
    else:
        assert np.isfinite(y[:, 0]).all() and np.isnan(y[:, 1:]).all()
    env = {**os.environ, **MALLOC_CHECK}
    done = subprocess.run(
        [str(runner), str(copy), "--plugin", str(default_plugin())],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(r"pjrt prefill B=2 T=3( S=2)?\s+max \|error\| = \S+", done.stdout)
    done = subprocess.run(
        [sys.executable, str(copy / "run.py"), str(copy), "--iree", "--device", "local-sync"],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(r"iree prefill B=2 T=3( S=2)?\s+max \|error\| = \S+", done.stdout)


@pytest.mark.parametrize("artifact", ["language model"], indirect=True)
def test_ids_outside_the_vocabulary_in_iree_and_the_c_runner(artifact, runner, tmp_path):
    """Ids below 0 and past the vocabulary: the gather reads a row inside the table (the id
    clipped) and the exported step gives that stream NaN, as the JAX loader does; IREE and the
    C runner reproduce it under the memory checker."""
    _, art = artifact
    vocab = load(art).manifest["model"]["arguments"]["vocab"]
    copy = tmp_path / "art"
    shutil.copytree(art, copy)
    huge = np.iinfo(np.int32)

    def outside(ids):
        ids = ids.copy()
        ids[0, 1], ids[0, 2], ids[1, 3] = -1, vocab, huge.max
        ids[1, 0] = huge.min
        return ids

    ys = _with_ids(copy, outside)
    assert np.isnan(ys[0, 1:]).all() and np.isnan(ys[1]).all()  # from the bad id on
    assert np.isfinite(ys[0, 0]).all()
    for device in ("local-sync", "local-task"):
        done = subprocess.run(
            [sys.executable, str(copy / "run.py"), str(copy), "--iree", "--device", device],
            capture_output=True, text=True, env={**os.environ, **MALLOC_CHECK}, timeout=300,
        )  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
        error = re.search(r"iree step B=2, 4 steps\s+max \|error\| = (\S+)", done.stdout)
        assert float(error.group(1)) < 1e-4, done.stdout  # NaN against a number: inf
    done = subprocess.run(
        [str(runner), str(copy), "--plugin", str(default_plugin())],
        capture_output=True, text=True, env={**os.environ, **MALLOC_CHECK}, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    error = re.search(r"pjrt step B=2, 4 steps\s+max \|error\| = (\S+)", done.stdout)
    assert float(error.group(1)) < 1e-4, done.stdout
    assert max(check_iree(copy).values()) < 1e-4


def test_the_overflow_contract_check_finds_what_breaks_it():
    """`_past_the_golden`, the check that run.py applies past the golden stream: a flagged
    stream with a finite output, an unflagged one with NaN, and a flagged stream whose fixed
    cache changed each count; a decoding's tokens are not floats and are not checked."""
    nan = np.full(3, np.nan)
    y = np.stack([nan, np.ones(3)])
    cache = [np.zeros((2, 4)), np.zeros((2, 4))]
    changed = [np.array([[1.0, 0, 0, 0], [0, 0, 0, 0]]), np.zeros((2, 4))]
    flags, was = np.array([True, False]), np.array([True, False])
    assert _past_the_golden(y, cache, cache, was, flags, [True, True], tokens=False) == 0
    assert _past_the_golden(y[::-1], cache, cache, was, flags, [True, True], tokens=False) == 2
    assert _past_the_golden(y[::-1], cache, cache, was, flags, [True, True], tokens=True) == 0
    assert _past_the_golden(y, cache, changed, was, flags, [True, True], tokens=False) == 1
    assert _past_the_golden(y, cache, changed, was, flags, [False, True], tokens=False) == 0
    assert _past_the_golden(y, cache, changed, ~was, flags, [True, True], tokens=False) == 0
    # the line names runs of neighbouring streams flagged at the same step
    flagged = {0: 5, 1: 5, 2: 5, 3: 7, 5: 7}
    assert "(overflow: streams 0-2 from step 5, stream 3 from step 7, stream 5 from step 7;" in (
        _past_label("step B=6", 3, 4, flagged)
    )
    assert "(overflow: none;" in _past_label("step B=6", 3, 4, {})


# Every gather, scatter and dynamic slice in an exported function, by the innermost function of
# the package that traced it, and why its indices stay inside the buffer (the audit's list).
AUDITED = {
    ("scatter", "_write_rows"): "slots clipped into [0, N); a repeated slot gets one row",
    ("gather", "_write_rows"): "the chunk's rows and the buffer's own rows, at clipped indices",
    ("gather", "Param.rows"): "ids clipped into [0, vocab) by Embedding.forward before the take",
    ("gather", "QuantizedParam.rows"): "ids clipped into [0, vocab) by Embedding.forward",
    ("gather", "LearnedPositions.rows"): "positions clipped into [0, max_len)",
    # a stack's layer reading and writing its slice of the stacked caches: a dynamic slice by the
    # layer's index (from `arange(depth)`), a gather and a scatter that clamp under `jax.vmap`
    ("gather", "Stack.prefill.<locals>.body.<locals>.<lambda>"): "the layer's index, clamped",
    ("scatter", "Stack.prefill.<locals>.body.<locals>.<lambda>"): "the layer's index, clamped",
}
INDEXING = ("gather", "scatter", "dynamic_slice", "dynamic_update_slice")
QUANTIZED = {
    "vocab": 32, "d_model": 512, "n_heads": 4, "d_ff": 512, "depth": 1, "max_len": 16,
    "positions": "learned", "quantize_embeddings": True,
}  # fmt: skip


def _sites(jaxpr, found, outer=""):
    for eqn in jaxpr.eqns:
        frames = [
            f.function_name
            for f in (eqn.source_info.traceback.frames if eqn.source_info.traceback else [])
            if "dense_armor" in f.file_name and "/export/" not in f.file_name
        ]
        where = frames[0] if frames else outer
        name = eqn.primitive.name
        if name.split("-")[0] in INDEXING:
            found.setdefault((name.split("-")[0], where), set()).add(str(eqn.params.get("mode")))
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            _sites(sub, found, where)


def test_every_index_an_exported_function_computes_is_audited():
    """The jaxprs of every exported function of every family (sampling in the graph included):
    each indexing site is in `AUDITED`, and none asks the runtime to drop or fill an index
    (`FILL_OR_DROP`, which XLA honours and IREE need not)."""
    found = {}
    sizes = {"B": 2, "T": 3, "S": 2}
    models = [_config_and_model(name) for name in FAMILIES]
    gpt2, arguments = import_hf(DATA / "gpt2")  # learned positions, a tied head
    models.append((ModelConfig("transformer_lm", arguments), gpt2))
    # int8 weights read in blocks of rows (d_model 512: two), int8 tables, an int8 cache
    quantized = ModelConfig("transformer_lm", {**QUANTIZED, "quantize": "int8"})
    models.append((quantized, quantized.build()))
    sampling = {"temperature": 0.8, "top_k": 5, "top_p": 0.9, "min_p": 0.05}
    rules = [None] * (len(models) - 2) + [sampling, None]
    for (config, model), rule in zip(models, rules, strict=True):
        kv = "int8" if config.arguments.get("quantize") else None
        lowering = Lowering(model, model, config, CAPACITY, rule, kv_dtype=kv)
        weights = [jax.ShapeDtypeStruct(w.shape, w.dtype) for w in lowering.weights]
        for function, _, _ in lowering.plans().values():
            at = {d: sizes[d] for d in function.symbols}
            jaxpr = jax.make_jaxpr(function.fn)(*function.arguments(weights, at))
            _sites(jaxpr.jaxpr, found)
    assert set(found) <= set(AUDITED), sorted(set(found) - set(AUDITED))
    assert ("scatter", "_write_rows") in found  # the walk sees the cache writes
    modes = set().union(*found.values())
    assert not any("FILL_OR_DROP" in m for m in modes), found
