"""Generation and the server over a device mesh (`generate(mesh=)`, `stream_tokens(mesh=)`,
`Server(mesh=)`; `nn.sharding`), on 8 forced host devices in one worker process
(tests/distributed/mesh_worker.py), against the same model on one device: the same tokens,
greedy and sampled, fixed and paged, the caches split over their key/value heads, nothing
compiled twice, and the meshes that cannot split a model refused by name."""

import json
import pathlib
import subprocess
import sys

import pytest

from environment import child_env

WORKER = pathlib.Path(__file__).resolve().parent / "distributed" / "mesh_worker.py"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("mesh") / "runs.json"
    env = child_env(XLA_FLAGS="--xla_force_host_platform_device_count=8")
    done = subprocess.run(
        [sys.executable, str(WORKER), str(out)], env=env, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize(
    "name",
    ["greedy", "sampled", "int8 cache", "stream", "scanned layers over 8", "recurrent mixer",
     "experts"],
)  # fmt: skip
def test_generation_over_the_mesh_gives_one_devices_tokens(runs, name):
    """Four (or eight) devices, heads split over them: token for token what one device makes
    (a row's tokens are drawn from its own logits; the split only reorders sums)."""
    run = runs[name]
    assert run["one"] == run["mesh"]
    assert any(len(set(row)) > 1 for row in run["one"])  # not one token repeated everywhere


@pytest.mark.parametrize("name", ["fixed", "paged", "sampled paged"])
def test_the_server_over_the_mesh_gives_generates_tokens(runs, name):
    """Each request's tokens, in both passes, those of `generate` on one device, greedy or with
    its sampling rules (row `n` is request `n`: the first pass's numbers; a greedy request's
    tokens do not depend on its number, so both passes)."""
    sampled = name.startswith("sampled")
    reference = runs["sampled reference" if sampled else "reference"]
    for served in runs[name]["passes"][: 1 if sampled else 2]:
        for n, got in enumerate(served["tokens"]):
            assert len(got) == [5, 6, 3][n]
            assert got == reference[n][: len(got)], (name, n)


@pytest.mark.parametrize("name", ["fixed", "paged"])
def test_the_server_over_the_mesh_compiles_nothing_twice(runs, name):
    """Every compiled function lays its outputs out on the mesh (`laid_out`): the same layouts
    come back in, so a second pass (and, paged, a first pass after `warm_up`, whose compiles
    run on threads under the server's mesh) lowers nothing."""
    passes = [p["compiles"] for p in runs[name]["passes"]]
    assert passes[-1] == 0
    if name == "paged":
        assert passes == [0, 0]


@pytest.mark.parametrize("name", ["fixed", "paged"])
def test_the_caches_are_split_over_their_key_value_heads(runs, name):
    """Keys and values split on the heads' axis over "model": device 0 holds a quarter of the
    cache, and less than half of the weights (the embedding table and the norms are whole on
    every device)."""
    run = runs[name]
    assert run["cache specs"] == ["P(None, 'model')"]
    assert run["cache bytes"]["device 0"] * 4 == run["cache bytes"]["whole"]
    assert run["weight bytes"]["device 0"] < run["weight bytes"]["whole"] / 2


def test_meshes_that_cannot_split_the_model_are_refused_by_name(runs):
    assert "W_K" in runs["kv heads"] and "4 n_kv_heads" in runs["kv heads"]
    assert "divides 4" in runs["kv heads"]
    assert runs["data axis"].startswith("ValueError: generate:")
    assert '"data" axis holds 2 devices' in runs["data axis"]
    assert runs["not a mesh"].startswith("TypeError: Server: `mesh` must be a jax.sharding.Mesh")


def test_the_commands_split_the_model_over_the_devices_they_are_given(runs):
    """`dense-armor generate --mesh model=4` prints what one device does; `serve --mesh
    model=4` answers each request with `generate`'s tokens; a mesh larger than the machine is a
    usage error naming the devices there are."""
    made = runs["cli generate"]
    assert made["one"]["status"] == made["mesh"]["status"] == 0
    assert made["mesh"]["out"] == made["one"]["out"]
    assert made["one"]["out"].split() == list(map(str, runs["stream"]["one"][0]))
    assert made["too many"]["status"] != 0
    assert "--mesh model=16: this machine has 8 cpu device(s)" in made["too many"]["err"]
    served = runs["cli serve"]
    assert served["status"] == 0, served["err"]
    answers = sorted((json.loads(line) for line in served["out"].splitlines()), key=_number)
    assert [a["ids"] for a in answers] == [
        row[:n] for row, n in zip(runs["reference"], [5, 6, 3], strict=True)
    ]


def _number(answer):
    return answer["id"]
