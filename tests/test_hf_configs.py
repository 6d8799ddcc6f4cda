"""The hub's config files as the hub has them: older spellings, defaults left out. Every case of
`tests/data/hf_configs.json` (tests/torch_reference/make_hub_golden.py) holds a config written the
way transformers 4 wrote the hub's files and transformers 5's own reading of it; the importer must
read both to the same model, or refuse the older form by name. Gemma 2 and 3 directories in that
form import to transformers' logits. A key the importer does not read is refused, never dropped."""

import json
import pathlib
import shutil
import types

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from dense_armor.huggingface import FAMILIES, HuggingFaceError, export_hf, import_hf
from dense_armor.huggingface._keys import read_arguments
from dense_armor.nn.layers.language import ids_checked

DATA = pathlib.Path(__file__).parent / "data"
CASES = json.loads((DATA / "hf_configs.json").read_text())["cases"]
# hub forms the importer refuses, with the words the refusal must hold
REFUSED = {"llama-dynamic": "dynamic"}
FORWARD = eqx.filter_jit(lambda m, ids: jax.vmap(m)(ids))


def architecture_of(config):
    return config["architectures"][0]


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_hub_form_config_reads_as_transformers_reads_it(name):
    hub, theirs = CASES[name]["hub"], CASES[name]["transformers"]
    family, architecture = FAMILIES[architecture_of(hub)], architecture_of(hub)
    if name in REFUSED:
        with pytest.raises(HuggingFaceError, match=REFUSED[name]):
            read_arguments(family, hub, architecture)
        return
    assert read_arguments(family, hub, architecture) == read_arguments(family, theirs, architecture)


def test_every_architecture_has_hub_form_cases():
    found = {architecture_of(case["hub"]) for case in CASES.values()}
    assert found == set(FAMILIES)


@pytest.mark.parametrize("architecture", sorted(FAMILIES))
def test_a_key_no_family_reads_is_refused_by_name(architecture):
    (minimal,) = [
        case["transformers"]
        for name, case in CASES.items()
        if name.endswith("-minimal") and architecture_of(case["hub"]) == architecture
    ]
    config = {**minimal, "attention_temperature": 0.5}
    with pytest.raises(HuggingFaceError, match="attention_temperature"):
        read_arguments(FAMILIES[architecture], config, architecture)


def test_a_family_that_forgets_a_key_refuses_it():
    gemma2 = CASES["gemma2-hub"]["hub"]
    real = FAMILIES["Gemma2ForCausalLM"]

    def forgetful(config, architecture):  # never looks at the scores' soft-cap
        arguments = real.arguments(config, architecture)
        config.read.discard("attn_logit_softcapping")
        return arguments

    family = types.SimpleNamespace(
        arguments=forgetful, DEFAULTS=real.DEFAULTS, IGNORED=real.IGNORED
    )
    with pytest.raises(HuggingFaceError, match="attn_logit_softcapping"):
        read_arguments(family, gemma2, "Gemma2ForCausalLM")


@pytest.mark.parametrize("name", ["gemma2_hub", "gemma3_hub"])
def test_a_gemma_directory_in_the_hubs_form_imports_to_transformers_logits(tmp_path, name):
    golden = load_file(str(DATA / "hf" / f"{name}.io.safetensors"))
    model, _ = import_hf(DATA / "hf" / name)
    with ids_checked():
        logits = np.asarray(FORWARD(model, jnp.asarray(golden["ids"])))
    np.testing.assert_allclose(logits, golden["logits"], atol=1e-5, rtol=0)
    # read the way a config without `layer_types` was read before: every layer sliding, and
    # (Gemma 3) the global base everywhere; the logits are then far from transformers'
    wrong = tmp_path / name
    shutil.copytree(DATA / "hf" / name, wrong)
    config = json.loads((wrong / "config.json").read_text())
    depth = config["num_hidden_layers"]
    config["layer_types"] = ["sliding_attention"] * depth
    if "rope_local_base_freq" in config:
        config["rope_local_base_freq"] = config["rope_theta"]
    (wrong / "config.json").write_text(json.dumps(config))
    misread, _ = import_hf(wrong)
    with ids_checked():
        far = np.asarray(FORWARD(misread, jnp.asarray(golden["ids"])))
    assert np.abs(far - golden["logits"]).max() > 1e-2


@pytest.mark.parametrize("name", ["gemma2_hub", "gemma3_hub"])
def test_a_hub_form_import_is_written_back_in_transformers_5s_form(tmp_path, name):
    model, arguments = import_hf(DATA / "hf" / name)
    architecture = json.loads((DATA / "hf" / name / "config.json").read_text())["architectures"]
    written = export_hf(model, arguments, tmp_path / name, architecture=architecture[0])
    config = json.loads((written / "config.json").read_text())
    assert len(config["layer_types"]) == config["num_hidden_layers"]
    again, arguments_again = import_hf(written)
    assert arguments_again == arguments
    for a, b in zip(model.params(), again.params(), strict=True):
        np.testing.assert_array_equal(np.asarray(a.value), np.asarray(b.value))
