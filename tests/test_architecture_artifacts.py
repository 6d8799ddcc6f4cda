"""Every imported architecture deployed: each checkpoint of tests/data/hf exported once, and the
artifact's greedy decoding (the token chosen in `sample_step`'s graph and fed back, from an empty
cache) gives transformers' tokens in JAX's loader, in IREE and from C through XLA's PJRT plugin,
each of its functions reproducing the Python model's golden outputs on the way. One artifact per
architecture serves the three runtimes, so each is traced, lowered and compiled once."""

import re
import shutil
import subprocess

import pytest
from safetensors.numpy import load_file

from dense_armor.checkpoint import ModelConfig
from dense_armor.export import export_model, load
from dense_armor.export.iree import compile_artifact
from dense_armor.export.standalone import build_runner, check_iree, default_plugin
from dense_armor.huggingface import import_hf
from test_language_models import CASES, DATA

FUNCTIONS = {"forward", "init_cache", "step", "prefill", "reset", "sample_prefill", "sample_step"}
DECODING = ["init_cache", "sample_prefill", "sample_step"]
# IREE compiles every function of these; of the others, what decoding runs (their forward, prefill
# and step are the same graphs as their sampling functions' without the choice of a token)
ALL_IN_IREE = {"gpt2", "llama_gqa"}
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
    out = tmp_path / "art"
    config = ModelConfig("transformer_lm", arguments)
    export_model(model, config, out, capacity=CAPACITY, platforms=["cpu"], static_shapes=[(1, 5)])

    artifact = load(out)  # JAX's loader: transformers' tokens, each chosen in the graph
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
