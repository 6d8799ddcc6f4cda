"""Every imported architecture deployed: each checkpoint of tests/data/hf exported once, and the
artifact's greedy decoding (the token chosen in `sample_step`'s graph and fed back, from an empty
cache) gives transformers' tokens in JAX's loader, in IREE and from C through XLA's PJRT plugin,
each of its functions reproducing the Python model's golden outputs on the way. One artifact per
architecture serves the three runtimes, so each is traced, lowered and compiled once; of three
(GPT-2, Llama, Qwen3.5) it also serves the function-by-function checks in JAX's loader
(`check_in_detail`), which exported each a second time when they lived in
test_language_models.py."""

import re
import shutil
import subprocess

import numpy as np
import pytest
from safetensors.numpy import load_file

from dense_armor.checkpoints import ModelConfig, save_checkpoint
from dense_armor.export import export_checkpoint, load
from dense_armor.export.iree import compile_artifact
from dense_armor.export.standalone import (
    ArtifactError,
    build_runner,
    check_golden,
    check_iree,
    default_plugin,
)
from dense_armor.huggingface import import_hf
from test_language_models import BAD_ARTIFACT_IDS, BAD_ARTIFACT_KEYS, CASES, DATA, TOLERANCE

FUNCTIONS = {"forward", "init_cache", "step", "prefill", "reset", "sample_prefill", "sample_step"}
DECODING = ["init_cache", "sample_prefill", "sample_step"]
# IREE compiles every function of these; of the others, what decoding runs (their forward, prefill
# and step are the same graphs as their sampling functions' without the choice of a token)
ALL_IN_IREE = {"gpt2", "llama_gqa"}
# These also in JAX's loader function by function: the forward's logits against transformers', the
# raw prefill and step, the manifest, and ids and keys of the wrong kind (one export serves both)
IN_DETAIL = {"gpt2", "llama_gqa", "qwen3_5"}
LINE = re.compile(r"^  (pjrt \S.*?)\s+max \|error\| = (\S+)$", re.M)
CAPACITY = 40  # the golden data's prompt and tokens, with room: a window's ring wraps in it


@pytest.fixture(scope="module")
def binaries(tmp_path_factory):
    """The C runner, built once from the first artifact's runner.c (every artifact carries the
    same source and header)."""
    built = {}

    def runner(artifact):
        if "runner" not in built:
            binary = tmp_path_factory.mktemp("runner") / "runner"
            assert build_runner(artifact, binary) == ""  # -Wall -Wextra: clean
            built["runner"] = binary
        return built["runner"]

    return runner


def _tokens_differ_and_worst(errors, functions):
    differ = [v for k, v in errors.items() if "tokens that differ" in k]
    assert {k.split()[1].rstrip(",") for k in errors} == set(functions), sorted(errors)
    return differ, max(errors.values())


@pytest.mark.parametrize("name", CASES)
def test_an_architectures_artifact_decodes_transformers_tokens_in_jax_iree_and_c(
    binaries, tmp_path, name
):
    model, arguments = import_hf(DATA / name)
    golden = load_file(str(DATA / f"{name}.io.safetensors"))
    prompt, want = golden["prompt"], golden["generated"][0].tolist()
    out = tmp_path / "art"  # from a checkpoint, as a user exports one
    save_checkpoint(tmp_path / "ckpt", model, ModelConfig("transformer_lm", arguments))
    export_checkpoint(
        tmp_path / "ckpt", out, capacity=CAPACITY, platforms=["cpu"], static_shapes=[(1, 5)]
    )

    artifact = load(out)
    if name in IN_DETAIL:
        check_in_detail(artifact, model.vocab, golden, TOLERANCE.get(name, 1e-5))
    # JAX's loader: transformers' tokens, each chosen in the graph
    token, cache, overflow = artifact.sample_prefill(prompt, artifact.init_cache(1))
    tokens = [int(token[0])]
    for _ in range(len(want) - 1):
        token, cache, overflow = artifact.sample_step(token, cache)
        tokens.append(int(token[0]))
    assert tokens == want and not overflow.any()

    functions = FUNCTIONS if name in ALL_IN_IREE else DECODING
    compile_artifact(out, ["llvm-cpu"], jobs=2, functions=sorted(functions))  # IREE's runner
    errors = check_iree(out)  # fed back the tokens
    differ, worst = _tokens_differ_and_worst(errors, functions)
    assert differ == [0.0] and worst < 1e-4, errors
    assert errors[f"iree sample_step B=1, {CAPACITY} tokens (tokens that differ)"] == 0.0

    if not any(shutil.which(cc) for cc in ("cc", "gcc", "clang")):  # .ci/run's machine has one
        pytest.skip("no C compiler here: the C runner cannot be built")
    done = subprocess.run(  # from C, through XLA's PJRT plugin, the cache on the device
        [str(binaries(out)), str(out), "--plugin", str(default_plugin())],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    errors = {k: float(v) for k, v in LINE.findall(done.stdout)}
    differ, worst = _tokens_differ_and_worst(errors, FUNCTIONS)
    assert differ == [0.0] and worst < 1e-4, done.stdout


def check_in_detail(artifact, vocab, golden, tolerance):
    """A checkpoint of an imported model exported like any family: its forward gives
    transformers' logits, its prefill and step generate transformers' greedy tokens from the
    artifact alone, its own golden check passes, and an id outside the vocabulary is a NaN row
    (an artifact cannot raise) that the manifest documents."""
    manifest = artifact.manifest
    assert manifest["kind"] == "language_model"
    assert manifest["token_ids"]["vocab"] == vocab
    assert "NaN logits" in manifest["token_ids"]["invalid"]
    assert [i["dtype"] for i in artifact.inputs("step") if i["name"] == "x_t"] == ["int32"]
    assert max(check_golden(artifact).values()) < 1e-4
    np.testing.assert_allclose(
        np.asarray(artifact.forward(golden["ids"])), golden["logits"],
        atol=tolerance, rtol=0,
    )  # fmt: skip
    prompt, want = golden["prompt"], golden["generated"][0]
    logits, cache, overflow = artifact.prefill(prompt, artifact.init_cache(1))
    token, out = np.argmax(np.asarray(logits)[:, -1], axis=-1).astype(np.int32), []
    for _ in range(len(want)):
        out.append(int(token[0]))
        logits, cache, overflow = artifact.step(token, cache)
        token = np.argmax(np.asarray(logits), axis=-1).astype(np.int32)
    np.testing.assert_array_equal(out, want)
    assert not bool(np.any(overflow))
    bad, _, _ = artifact.step(np.array([vocab], np.int32), artifact.init_cache(1))
    assert np.isnan(np.asarray(bad)).all()
    for wrong in BAD_ARTIFACT_IDS:  # ids of another dtype or shape: refused, naming the input
        with pytest.raises(
            ArtifactError, match=r"input 'x_t' must have shape \('B',\) and dtype int32"
        ):
            artifact.step(wrong, artifact.init_cache(1))
    # Decoding in the graph (the caller's loop checks its tokens): greedy, the default.
    token, cache, _ = artifact.sample_prefill(prompt, artifact.init_cache(1))
    assert manifest["sampling"]["temperature"] == 0.0
    for wrong in BAD_ARTIFACT_KEYS:
        with pytest.raises(
            ArtifactError, match=r"input 'key' must have shape \(2,\) and dtype uint32"
        ):
            artifact.sample_step(token, cache, wrong)
