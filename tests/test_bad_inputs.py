"""A hostile user's sweep: every bad input gets a clear error (the right type, and a message that
names the argument or file, what was expected and what was received), never a silent result.

`BAD` is the table: one row per input, with the exception it must raise and words of its message.
Grow it with every feature. The silent-result cases that need more than one call (NaN behind a
mask, killed checkpoint writers, 64-bit mode) follow the table as tests of their own.
"""

import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
from unittest import mock

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh

from dense_armor.checkpoints import (
    CheckpointError,
    ModelConfig,
    load_checkpoint,
    save_checkpoint,
    tree_arrays,
)
from dense_armor.checkpoints import single as checkpoint
from dense_armor.checkpoints.atomic import WRITE_STEPS
from dense_armor.checkpoints.sharded import ShardedCheckpoints, to_safetensors
from dense_armor.cli import main as cli
from dense_armor.distributed import data_mesh, device_mesh, initialize, partition_specs
from dense_armor.export import ArtifactError, check_golden, export_model, load
from dense_armor.export.iree import compile_artifact, host_cpu, target_flags
from dense_armor.export.standalone import build_runner, check_iree, run_pjrt
from dense_armor.export.standalone import main as run_py
from dense_armor.huggingface import HuggingFaceError, import_hf
from dense_armor.interop import InteropError, import_torch
from dense_armor.nn import precision
from dense_armor.nn.layers.experts import MixtureOfExperts
from dense_armor.nn.layers.language import (
    Embedding,
    GatedFeedForward,
    LMHead,
    RMSNorm,
    TokenIdError,
)
from dense_armor.nn.mixers.convolution import ShortConv
from dense_armor.nn.mixers.deltanet import GatedDeltaNet
from dense_armor.nn.models.generation import generate, stream_tokens
from dense_armor.nn.models.language_model import TransformerLM
from dense_armor.nn.penalties import Penalties
from dense_armor.nn.sampling import greedy, sample
from dense_armor.serving import QueueFull, Sampling, Server
from dense_armor.training import (
    ArraySource,
    Loss,
    ShardSource,
    evaluate,
    fit,
    make_train_step,
    next_token_loss,
    next_token_loss_balanced,
)
from dense_armor.utility.neural import (
    GRU,
    LSTM,
    CannotStream,
    Dense,
    Dropout,
    HiddenState,
    LayerNorm,
    MinGRU,
    MultiHeadSelfAttention,
    RecurrentBlock,
    ShapeError,
    Stream,
    TransformerBlock,
    TransformerDecoderBlock,
    blocked_attention,
    reset,
    scaled_dot_product_attention,
    transformer_decoder,
    transformer_encoder,
)
from environment import child_env

KEY = jax.random.PRNGKey(0)
HF = pathlib.Path(__file__).parent / "data" / "hf"
ARGUMENTS = {"n_in": 3, "d_model": 8, "n_heads": 2, "d_ff": 16, "depth": 1, "n_out": 2}
CONFIG = ModelConfig("transformer_encoder", {**ARGUMENTS, "max_len": 6, "causal": True})
MODEL = CONFIG.build(KEY)
# a window, but positions from a table of max_len rows: a stream still ends at max_len
WINDOWED_LEARNED = ModelConfig(
    "transformer_encoder", {**CONFIG.arguments, "window": 2, "positions": "learned"}
)
XS = np.asarray(jax.random.normal(KEY, (8, 6, 3)))
LABELS = np.array([0, 1] * 4, np.int32)
ADAM = optax.adam(1e-3)


def attention(**options):
    return MultiHeadSelfAttention(8, 2, KEY, **options)


def fit_with(**options):
    arguments = {"steps": 2, "batch_size": 4, "progress": False, **options}
    data = (arguments.pop("xs", XS), arguments.pop("labels", LABELS))
    return fit(MODEL, ADAM, data, **arguments)


def with_env(**variables):
    """`initialize()` with these DENSE_ARMOR_* variables (it fails before joining anything)."""

    def call():
        saved = {k: os.environ.get(k) for k in variables}
        os.environ.update(variables)
        try:
            initialize()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    return call


def config_json(tmp, data):
    """A checkpoint whose config.json is replaced by `data`, then loaded."""
    directory = save_checkpoint(tmp / "ckpt", MODEL, CONFIG)
    (directory / "config.json").write_text(json.dumps(data))
    return load_checkpoint(directory)


def saved_config(tmp, **changes):
    directory = save_checkpoint(tmp / "ckpt", MODEL, CONFIG)
    data = json.loads((directory / "config.json").read_text())
    data["arguments"].update(changes)
    return config_json(tmp, data)


def int8_stored_as_float(tmp):
    """A quantized checkpoint whose int8 matrix was rewritten as float32 (its config unchanged,
    the file's sha256 updated: the structure check must catch it)."""
    from safetensors.numpy import load_file, save_file

    from dense_armor.checkpoints.atomic import sha256

    config = ModelConfig("transformer_lm", {**LM_CONFIG.arguments, "quantize": "int8"})
    save_checkpoint(tmp / "q", config.build(KEY), config)
    weights = load_file(str(tmp / "q" / "weights.safetensors"))
    name = ".blocks[0].attention.W_Q.value"
    weights[name] = weights[name].astype(np.float32)
    save_file(weights, str(tmp / "q" / "weights.safetensors"))
    config_file = tmp / "q" / "config.json"
    data = json.loads(config_file.read_text())
    data["files"]["weights.safetensors"] = sha256(tmp / "q" / "weights.safetensors")
    config_file.write_text(json.dumps(data))
    return load_checkpoint(tmp / "q")


def corrupt_tensor_bytes(tmp):
    return load_checkpoint(flip_a_weight_byte(save_checkpoint(tmp / "ckpt", MODEL, CONFIG)))


def flip_a_weight_byte(directory):
    """A checkpoint's or an artifact's directory with one byte of a tensor (not the header) in
    its weights.safetensors changed."""
    weights = directory / "weights.safetensors"
    data = bytearray(weights.read_bytes())
    data[-3] ^= 0x40
    weights.write_bytes(bytes(data))
    return directory


def into_a_users_directory(tmp):
    (tmp / "mine").mkdir()
    (tmp / "mine" / "notes.txt").write_text("keep me")
    try:
        save_checkpoint(tmp / "mine", MODEL, CONFIG)
    finally:
        assert (tmp / "mine" / "notes.txt").read_text() == "keep me"


def onto_a_file(tmp):
    (tmp / "file").write_text("x")
    save_checkpoint(tmp / "file", MODEL, CONFIG)


def resume_another_model(tmp, checkpoint_format="safetensors"):
    fit_with(checkpoint_dir=tmp / "run", config=CONFIG, checkpoint_format=checkpoint_format)
    other = ModelConfig("transformer_encoder", {**CONFIG.arguments, "d_ff": 32})
    fit(other.build(KEY), ADAM, (XS, LABELS), steps=4, batch_size=4, progress=False,
        checkpoint_dir=tmp / "run", config=other, checkpoint_format=checkpoint_format)  # fmt: skip


def source_fit(source):
    return fit(MODEL, ADAM, source, steps=2, batch_size=4, progress=False)


def sharded_store(tmp, **options):
    return ShardedCheckpoints(tmp / "sharded", asynchronous=False, **options)


def orbax_not_installed(tmp):
    """`checkpoint_format="orbax"` where orbax-checkpoint cannot be imported."""
    hidden = {name: sys.modules.pop(name) for name in list(sys.modules)
              if name == "dense_armor.checkpoints.sharded" or name.startswith("orbax")}  # fmt: skip
    sys.modules["orbax"] = None  # type: ignore[assignment]
    try:
        fit_with(checkpoint_dir=tmp / "run", config=CONFIG, checkpoint_format="orbax")
    finally:
        del sys.modules["orbax"]
        sys.modules.update(hidden)


def resume_from_a_model_alone(tmp, checkpoint_format):
    """A checkpoint directory whose latest checkpoint holds a model but no training run."""
    if checkpoint_format == "orbax":
        with ShardedCheckpoints(tmp / "run" / "sharded", asynchronous=False) as store:
            store.save(1, MODEL, CONFIG)
    else:
        save_checkpoint(tmp / "run" / "last", MODEL, CONFIG)
    fit_with(checkpoint_dir=tmp / "run", config=CONFIG, checkpoint_format=checkpoint_format)


def sharded_restore_missing_step(tmp):
    with sharded_store(tmp) as store:
        store.save(1, MODEL, CONFIG)
        store.restore(9)


def sharded_with_optimizer_state(tmp):
    """A sharded checkpoint holding an optimizer state, converted without the optimizer."""
    fit_with(checkpoint_dir=tmp / "run", config=CONFIG, checkpoint_format="orbax")
    to_safetensors(tmp / "run" / "sharded", tmp / "single")


def artifact_step_without_cache(tmp):
    export_model(MODEL, CONFIG, tmp / "art", platforms=["cpu"], static_shapes=[])
    load(tmp / "art").step(np.ones((1, 3), np.float32), None)


def cli_out_below_a_file(tmp, capsys):
    save_checkpoint(tmp / "ckpt", MODEL, CONFIG)
    (tmp / "afile").write_text("x")
    code = cli(["export", str(tmp / "ckpt"), "--out", str(tmp / "afile" / "sub")])
    err = capsys.readouterr().err
    if code == 2 and "error" in err and "Traceback" not in err:
        raise SystemExit(err)  # the clean failure this row expects


def full_cache_under_jax_jit():
    m = attention(causal=True)
    step = jax.jit(lambda x, c: m.step(x, c))
    _, cache = step(jnp.ones(8), m.init_cache(1))
    step(jnp.ones(8), cache)[0].block_until_ready()


def nan_loss_at_the_first_step():
    huge = np.full_like(XS, np.nan)
    fit_with(xs=huge, eval_every=100, steps=3)


TORCH_STATE = pathlib.Path(__file__).parent / "data" / "torch" / "encoder_post_ln.safetensors"
TORCH_CONFIG = ModelConfig(
    "transformer_encoder",
    {"n_in": 3, "d_model": 16, "n_heads": 4, "d_ff": 32, "depth": 2, "n_out": 5, "max_len": 7,
     "use_bias": True},
)  # fmt: skip


def torch_state(**changes):
    """The committed PyTorch state dict with some tensors replaced (a function of the old one)."""
    from safetensors.numpy import load_file

    state = load_file(str(TORCH_STATE))
    for name, change in changes.items():
        state[name.replace("__", ".")] = change(state[name.replace("__", ".")])
    return state


def cli_error(tmp, capsys, argv):
    """A CLI call that must fail cleanly: exit 2, an `error:` line, no traceback (argparse's own
    refusals exit by `SystemExit`)."""
    try:
        code = cli([str(a) for a in argv])
    except SystemExit as exit:
        code = exit.code
    err = capsys.readouterr().err
    if code == 2 and "error" in err and "Traceback" not in err:
        raise SystemExit(err)
    raise AssertionError(f"exit {code}: {err}")


def cli_serve(tmp, capsys, *options):
    """`dense-armor serve` of the committed byte model on one request of token ids."""
    (tmp / "requests.jsonl").write_text('{"ids": [1, 2], "max_new_tokens": 2}\n')
    byte_lm = pathlib.Path(__file__).parent / "data" / "byte_lm"
    cli_error(tmp, capsys, ["serve", byte_lm, "--input", tmp / "requests.jsonl", *options])


def cli_import_config(tmp, capsys, data):
    (tmp / "config.json").write_text(json.dumps(data))
    cli_error(tmp, capsys, ["import-torch", TORCH_STATE, "--config", tmp / "config.json", "--out", tmp / "ckpt"])  # fmt: skip


_EXPORTED: dict[str, pathlib.Path] = {}


def exported(tmp):
    """A copy in `tmp` of one small artifact (exported once per process, with a NumPy capacity
    and seed, which are welcome)."""
    if "art" not in _EXPORTED:
        import atexit
        import tempfile

        where = pathlib.Path(tempfile.mkdtemp(prefix="bad-inputs-")) / "art"
        atexit.register(shutil.rmtree, where.parent, ignore_errors=True)  # not left in /tmp
        export_model(MODEL, CONFIG, where, platforms=["cpu"], static_shapes=[(1, 6)],
                     capacity=np.int64(6), seed=np.int32(0))  # fmt: skip
        _EXPORTED["art"] = where
    shutil.copytree(_EXPORTED["art"], tmp / "art")
    return tmp / "art"


def edited_manifest(tmp, edit):
    directory = exported(tmp)
    manifest = json.loads((directory / "manifest.json").read_text())
    edit(manifest)
    (directory / "manifest.json").write_text(json.dumps(manifest))
    return directory


def with_compiled_claim(manifest):
    """The manifest of an artifact as `dense-armor compile` leaves it: its modules compiled for
    llvm-cpu (the claim alone: the signature check comes before any module is run)."""
    manifest["compiled"] = [
        {"module": e["bytecode"], "file": e["bytecode"] + ".vmfb", "target": "llvm-cpu"}
        for e in manifest["static"]
    ]


def pjrt_refused(tmp, capsys, *arguments, edit=None):
    """run.py --pjrt on the small artifact (its manifest edited by `edit`): exit 2 with one
    `error:` line, raised as SystemExit for the sweep."""
    directory = edited_manifest(tmp, edit) if edit else exported(tmp)
    code = run_py([str(directory), "--pjrt", *arguments])
    err = capsys.readouterr().err
    if code == 2 and err.startswith("error:") and err.count("\n") == 1:
        raise SystemExit(err)
    raise AssertionError(f"exit {code}: {err}")


def pjrt_cache_survives(tmp, damage):
    """The C runner with its executable cache in `tmp/cache` (`DENSE_ARMOR_PJRT_CACHE`), the cache
    filled by a first run and then `damage`d: the next run must still pass, and its line about the
    modules (and any warning) is raised as SystemExit for the sweep: never a damaged entry
    loaded."""
    directory, cache = exported(tmp), tmp / "cache"
    with mock.patch.dict(os.environ, DENSE_ARMOR_PJRT_CACHE=str(cache)):
        assert run_pjrt(directory).returncode == 0
        damage(cache)
        done = run_pjrt(directory)
    if done.returncode != 0:
        raise AssertionError(done.stdout + done.stderr)
    raise SystemExit(done.stderr + next(x for x in done.stdout.splitlines() if "modules:" in x))


def flip_every_entry(cache):
    for entry in cache.glob("*.pjrt"):
        data = bytearray(entry.read_bytes())
        data[len(data) // 2] ^= 0x10
        entry.write_bytes(bytes(data))


def a_file_in_its_place(cache):
    shutil.rmtree(cache)
    cache.write_text("not a directory")


def run_py_refused(tmp, capsys, *arguments):
    """run.py on the small artifact: exit 2 with one `error:` line, raised as SystemExit."""
    code = run_py([str(exported(tmp)), *arguments])
    err = capsys.readouterr().err
    if code == 2 and err.startswith("error:") and err.count("\n") == 1:
        raise SystemExit(err)
    raise AssertionError(f"exit {code}: {err}")


def iree_edited(tmp, capsys, edit):
    directory = edited_manifest(tmp, lambda m: (with_compiled_claim(m), edit(m)))
    code = run_py([str(directory), "--iree"])
    err = capsys.readouterr().err
    if code == 2 and err.startswith("error:") and "Traceback" not in err:
        raise SystemExit(err)
    raise AssertionError(f"exit {code}: {err}")


def claim_step_input(manifest, shape):
    inputs = manifest["functions"]["step"]["inputs"]
    next(i for i in inputs if i["name"] == "x_t")["shape"] = shape


def claim_step_output(manifest, shape):
    manifest["functions"]["step"]["outputs"][0]["shape"] = shape


def export_with_a_date_that_is_no_number(tmp, epoch="yesterday"):
    os.environ["SOURCE_DATE_EPOCH"] = epoch
    try:
        export_model(MODEL, CONFIG, tmp / "art", platforms=["cpu"], static_shapes=[])
    finally:
        del os.environ["SOURCE_DATE_EPOCH"]
        assert not (tmp / "art").exists()


def export_over_a_users_directory(tmp):
    (tmp / "mine").mkdir()
    (tmp / "mine" / "notes.txt").write_text("keep me")
    try:
        export_model(
            MODEL, CONFIG, tmp / "mine", platforms=["cpu"], static_shapes=[], force="false"
        )
    finally:
        assert (tmp / "mine" / "notes.txt").read_text() == "keep me"


def labels_at(step, labels):
    """A source whose batch `step` has these labels (the others are right)."""
    return lambda s: (XS[:4], labels if s == step else LABELS[:4])


TINY_LM = TransformerLM(16, 16, 2, 32, 1, KEY, 8)
LM_CONFIG = ModelConfig(
    "transformer_lm",
    {"vocab": 16, "d_model": 16, "n_heads": 2, "d_ff": 32, "depth": 1, "max_len": 8},
)
TINY_GPT = TransformerLM(16, 16, 2, 32, 1, KEY, 8, positions="learned")


def lm_source_fit(step, xs, labels):
    """A language model trained from a source whose batch `step` is `(xs, labels)` (the others
    are right): every batch's ids are checked, its inputs as its labels, since the compiled step
    leaves them unchecked (`NextToken.checked_inputs`)."""
    tokens = np.arange(4 * 7).reshape(4, 7) % 16
    good = (tokens[:, :-1], tokens[:, 1:])
    model = TINY_LM
    source = lambda s: (xs, labels) if s == step else good  # noqa: E731
    return fit(model, ADAM, source, steps=2, batch_size=4, loss_fn=next_token_loss, progress=False)


def resume_with_tuple_mixers(tmp):
    config = ModelConfig("transformer_encoder", {**CONFIG.arguments, "depth": 2, "mixers": ("attention", "gru")})  # fmt: skip
    model = config.build(KEY)
    for steps in (2, 4):
        fit(model, ADAM, (XS, LABELS), steps=steps, batch_size=4, progress=False, eval_every=2,
            checkpoint_dir=tmp / "run", config=config)  # fmt: skip
    raise SystemExit("resumed")  # what the row expects: no "another model" refusal


def hf_edited(tmp, name, **changes):
    """`import_hf` of a copy of the committed checkpoint `name` whose config has `changes` (a
    value None removes the key)."""
    target = tmp / name
    shutil.copytree(HF / name, target)
    config = json.loads((target / "config.json").read_text())
    config.update(changes)
    config = {k: v for k, v in config.items() if v is not None}
    (target / "config.json").write_text(json.dumps(config))
    return import_hf(target)


def _full_server():
    """A server whose one queue place is taken."""
    server = Server(TINY_LM, max_queue=1)
    server.submit([1], 2)
    return server


# (id, action(tmp, capsys) or action(), exception type, regex its message must match)
BAD = [
    # bools must be bools: "false" is a truthy string
    ("causal-string", lambda: attention(causal="false"), ValueError, r"`causal` must be True or False.*'false'.*str"),
    ("causal-int", lambda: attention(causal=1), ValueError, r"`causal`.*received `causal=1`"),
    ("norm_first-string", lambda: TransformerBlock(8, 2, 16, KEY, norm_first="yes"), ValueError, r"`norm_first`"),
    ("gate-string", lambda: TransformerBlock(8, 2, 16, KEY, gate="no"), ValueError, r"`gate`"),
    ("decoder-gate-none", lambda: TransformerDecoderBlock(8, 2, 16, KEY, gate=None), ValueError, r"`gate`"),
    ("encoder-causal-string", lambda: transformer_encoder(3, 8, 2, 16, 1, 2, KEY, 6, causal="false"), ValueError, r"`causal`"),
    ("blocked-causal-string", lambda: blocked_attention(jnp.ones((4, 2)), jnp.ones((4, 2)), jnp.ones((4, 2)), causal="yes"), ValueError, r"`causal`"),
    ("config-causal-string", lambda tmp, _: saved_config(tmp, causal="false"), CheckpointError, r"does not build a model.*`causal`"),
    # keys
    ("key-none", lambda: MultiHeadSelfAttention(8, 2, None), TypeError, r"`key` must be a JAX PRNG key.*received None"),
    ("key-int", lambda: TransformerBlock(8, 2, 16, 0), TypeError, r"`key` must be a JAX PRNG key.*received 0"),
    ("key-float-array", lambda: Dense(3, 4, jnp.ones(2)), TypeError, r"`key`.*float32"),
    # sizes and rates
    ("capacity-string", lambda: attention(causal=True).init_cache("4"), ValueError, r"`capacity` must be a positive integer.*'4'"),
    ("capacity-zero", lambda: attention(causal=True).init_cache(0), ValueError, r"`capacity`.*received `capacity=0`"),
    ("on-overflow-unknown", lambda: attention(causal=True).init_cache(4, on_overflow="wrap"), ValueError, r"`on_overflow` must be one of \('raise', 'nan'\).*'wrap'"),
    ("window-string", lambda: attention(causal=True, window="3"), ValueError, r"`window` must be a positive integer.*'3'"),
    ("window-without-causal", lambda: attention(window=3), ValueError, r"needs `causal=True`"),
    ("layer-norm-eps-string", lambda: LayerNorm(8, eps="1e-5"), ValueError, r"`eps` must be a positive number.*'1e-5'.*str"),
    ("layer-norm-eps-nan", lambda: LayerNorm(8, eps=float("nan")), ValueError, r"`eps` must be a positive number.*nan"),
    ("positions-unknown", lambda: transformer_encoder(3, 8, 2, 16, 1, 2, KEY, 6, positions="alibi"), ValueError, r"`positions` must be one of \('sinusoidal', 'learned', 'rope', 'none'\).*'alibi'"),
    ("rope-base-string", lambda: transformer_encoder(3, 8, 2, 16, 1, 2, KEY, 6, positions="rope", rope_base="1e4"), ValueError, r"`rope_base` must be a finite number above 1.*'1e4'"),
    ("rope-base-one", lambda: MultiHeadSelfAttention(8, 2, KEY, rope_base=1), ValueError, r"`rope_base` must be a finite number above 1"),
    ("rope-scaling-dynamic", lambda: MultiHeadSelfAttention(8, 2, KEY, causal=True, rope_base=1e4, rope_scaling={"rope_type": "dynamic", "factor": 2.0}), ValueError, r"`rope_scaling` of type 'dynamic' \(NTK scaling recomputed from each call's length\) is not built"),
    ("rope-scaling-longrope-string-factor", lambda: MultiHeadSelfAttention(8, 2, KEY, causal=True, rope_base=1e4, rope_scaling={**{"rope_type": "longrope", "factor": 2.0, "original_max_position_embeddings": 16, "short_factor": [1.0, 1.0], "long_factor": [2.0, 2.0]}, "short_factor": ["1", 1.0]}), ValueError, r"`rope_scaling\['short_factor'\]` must be a list of positive numbers"),
    ("rope-scaling-longrope-nan-factor", lambda: MultiHeadSelfAttention(8, 2, KEY, causal=True, rope_base=1e4, rope_scaling={**{"rope_type": "longrope", "factor": 2.0, "original_max_position_embeddings": 16, "short_factor": [1.0, 1.0], "long_factor": [2.0, 2.0]}, "long_factor": [float("nan"), 1.0]}), ValueError, r"`rope_scaling\['long_factor'\]` must be a list of positive numbers"),
    ("rope-scaling-longrope-empty", lambda: MultiHeadSelfAttention(8, 2, KEY, causal=True, rope_base=1e4, rope_scaling={**{"rope_type": "longrope", "factor": 2.0, "original_max_position_embeddings": 16, "short_factor": [1.0, 1.0], "long_factor": [2.0, 2.0]}, "long_factor": []}), ValueError, r"`rope_scaling\['long_factor'\]` must be a list of positive numbers"),
    ("rope-scaling-longrope-window", lambda: MultiHeadSelfAttention(8, 2, KEY, causal=True, window=3, rope_base=1e4, rope_scaling={"rope_type": "longrope", "factor": 2.0, "original_max_position_embeddings": 16, "short_factor": [1.0, 1.0], "long_factor": [2.0, 2.0]}), ValueError, r"'longrope' with a `window` is not built"),
    ("rope-scaling-longrope-past-its-length", lambda: TransformerLM(16, 8, 2, 16, 1, KEY, 32, rope_scaling={"rope_type": "longrope", "factor": 2.0, "original_max_position_embeddings": 16, "short_factor": [1.0, 1.0], "long_factor": [2.0, 2.0]})(jnp.zeros(17, jnp.int32)), ValueError, r"17 positions pass this model's LongRoPE pretrained length \(16\)"),
    ("rope-scaling-string-factor", lambda: MultiHeadSelfAttention(8, 2, KEY, causal=True, rope_base=1e4, rope_scaling={"rope_type": "linear", "factor": "8"}), ValueError, r"`rope_scaling\['factor'\]` must be a number; received '8'"),
    ("rope-scaling-a-list", lambda: MultiHeadSelfAttention(8, 2, KEY, causal=True, rope_base=1e4, rope_scaling=["linear"]), ValueError, r"`rope_scaling` must be a mapping or None"),
    ("rotary-fraction-nan", lambda: MultiHeadSelfAttention(8, 2, KEY, causal=True, rope_base=1e4, rotary_fraction=float("nan")), ValueError, r"`rotary_fraction` must be a number in \(0, 1\]"),
    ("head-dim-zero", lambda: MultiHeadSelfAttention(8, 2, KEY, head_dim=0), ValueError, r"`head_dim` must be a positive"),
    ("qk-norm-unknown", lambda: MultiHeadSelfAttention(8, 2, KEY, qk_norm="layer"), ValueError, r"`qk_norm` must be one of \(None, 'head', 'projection'\); received `qk_norm='layer'`"),
    ("qk-norm-plus-one-string", lambda: MultiHeadSelfAttention(8, 2, KEY, qk_norm="head", qk_norm_plus_one="yes"), ValueError, r"`qk_norm_plus_one` must be True or False"),
    ("query-scale-negative", lambda: MultiHeadSelfAttention(8, 2, KEY, query_scale=-0.5), ValueError, r"`query_scale` must be a positive finite number or None; received -0.5"),
    ("softcap-with-blocked", lambda: MultiHeadSelfAttention(8, 2, KEY, logit_softcap=5.0, implementation="blocked"), ValueError, r"`logit_softcap` caps the materialised scores; `implementation='blocked'` has no cap"),
    ("lm-final-softcap-inf", lambda: TransformerLM(16, 16, 2, 32, 1, KEY, 8, final_logit_softcap=float("inf")), ValueError, r"`final_logit_softcap` must be a positive finite number or None; received inf"),
    ("lm-layer-options-count", lambda: TransformerLM(16, 16, 2, 32, 2, KEY, 8, layer_options=[{}]), ValueError, r"`layer_options` must hold one mapping per block \(2\); received 1"),
    ("lm-layer-options-unknown", lambda: TransformerLM(16, 16, 2, 32, 1, KEY, 8, layer_options=[{"windw": 4}]), TypeError, r"layer_options\[0\] got unexpected keyword arguments \['windw'\]"),
    ("lm-norm-placement-unknown", lambda: TransformerLM(16, 16, 2, 32, 1, KEY, 8, norm_placement="after"), ValueError, r"`norm_placement` must be one of \('input', 'output', 'both'\)"),
    ("lm-param-dtype-int8", lambda: TransformerLM(16, 16, 2, 32, 1, KEY, 8, param_dtype="int8"), ValueError, r"`param_dtype` must be one of \('float32', 'bfloat16', 'float16'\); received `param_dtype='int8'`"),
    ("lm-compute-dtype-float64", lambda: TransformerLM(16, 16, 2, 32, 1, KEY, 8, compute_dtype="float64"), ValueError, r"`compute_dtype` must be one of \('float32', 'bfloat16', 'float16'\)"),
    ("lm-quantize-int4", lambda: TransformerLM(16, 16, 2, 32, 1, KEY, 8, quantize="int4"), ValueError, r"`quantize` must be one of \('int8',\); received `quantize='int4'`"),
    ("lm-quantize-embeddings-string", lambda: TransformerLM(16, 16, 2, 32, 1, KEY, 8, quantize="int8", quantize_embeddings="yes"), ValueError, r"`quantize_embeddings` must be True or False"),
    ("lm-quantize-embeddings-alone", lambda: TransformerLM(16, 16, 2, 32, 1, KEY, 8, quantize_embeddings=True), ValueError, r"`quantize_embeddings=True` quantizes the tables along with the projections: pass `quantize=\"int8\"` too"),
    ("lm-kv-dtype-int4", lambda: TINY_LM.init_cache(4, kv_dtype="int4"), ValueError, r"`kv_dtype` must be one of \('float32', 'bfloat16', 'float16', 'int8'\); received `kv_dtype='int4'`"),
    ("lm-kv-int8-growing-cache", lambda: TINY_LM.init_cache(kv_dtype="int8"), ValueError, r"kv_dtype='int8' needs a fixed-shape cache: pass a `capacity`"),
    ("generate-kv-dtype-bool", lambda: generate(TINY_LM, [[1]], 2, kv_dtype=True), ValueError, r"generate: `kv_dtype` must be one of \('float32', 'bfloat16', 'float16', 'int8'\) or None; received True"),
    ("generate-penalties-a-dict", lambda: generate(TINY_LM, [[1]], 2, penalties={"presence": 1.0}), TypeError, r"`penalties` must be a `Penalties`; received dict"),
    ("generate-presence-nan", lambda: generate(TINY_LM, [[1]], 2, penalties=Penalties(presence=float("nan"))), ValueError, r"`presence_penalty` must be a number in \[-2, 2\]; received nan"),
    ("generate-frequency-string", lambda: generate(TINY_LM, [[1]], 2, penalties=Penalties(frequency="1")), ValueError, r"`frequency_penalty` must be a number in \[-2, 2\]; received '1'"),
    ("generate-repetition-bool", lambda: generate(TINY_LM, [[1]], 2, penalties=Penalties(repetition=True)), ValueError, r"`repetition_penalty` must be a finite number > 0; received True"),
    ("generate-logit-bias-a-string", lambda: generate(TINY_LM, [[1]], 2, penalties=Penalties(logit_bias="5")), ValueError, r"`logit_bias` must be \(token, value\) pairs or a mapping"),
    ("generate-logit-bias-not-pairs", lambda: generate(TINY_LM, [[1]], 2, penalties=Penalties(logit_bias=(5, 2.0))), ValueError, r"`logit_bias` must be \(token, value\) pairs"),
    ("generate-logit-bias-id-outside", lambda: generate(TINY_LM, [[1]], 2, penalties=Penalties(logit_bias={16: 1.0})), ValueError, r"`logit_bias`: token 16 is not an id in \[0, 16\)"),
    ("server-submit-logit-bias-inf", lambda: Server(TINY_LM, capacity=8).submit([1], 2, sampling=Sampling(penalties=Penalties(logit_bias={1: float("inf")}))), ValueError, r"`logit_bias`: inf for token 1 is not in \[-100, 100\]"),
    ("server-kv-dtype-float64", lambda: Server(TINY_LM, kv_dtype="float64"), ValueError, r"Server: `kv_dtype` must be one of .* received 'float64'"),
    ("export-mesh-true", lambda tmp, _: export_model(TINY_LM, LM_CONFIG, tmp / "art", mesh=True), ArtifactError, r"export_model: `mesh` must be a jax.sharding.Mesh or AbstractMesh with a \"model\" axis.*received True"),
    ("export-mesh-a-string", lambda tmp, _: export_model(TINY_LM, LM_CONFIG, tmp / "art", mesh="model=4"), ArtifactError, r"export_model: `mesh` must be a jax.sharding.Mesh or AbstractMesh.*received 'model=4'"),
    ("export-mesh-a-device", lambda tmp, _: export_model(TINY_LM, LM_CONFIG, tmp / "art", mesh=jax.devices()[0]), ArtifactError, r"export_model: `mesh` must be a jax.sharding.Mesh or AbstractMesh.*received CpuDevice"),
    ("export-mesh-data-axis", lambda tmp, _: export_model(TINY_LM, LM_CONFIG, tmp / "art", mesh=jax.sharding.AbstractMesh((2, 2), ("data", "model"))), ArtifactError, r"export_model: an artifact splits a model over the mesh's \"model\" axis only; this mesh's \"data\" axis holds 2 devices"),
    ("export-mesh-other-axes", lambda tmp, _: export_model(TINY_LM, LM_CONFIG, tmp / "art", mesh=jax.sharding.AbstractMesh((2,), ("heads",))), ArtifactError, r"export_model: a mesh's axes are \(\"model\",\) or \(\"data\", \"model\"\); received \('heads',\)"),
    ("export-mesh-heads-not-dividing", lambda tmp, _: export_model(TINY_LM, LM_CONFIG, tmp / "art", mesh=jax.sharding.AbstractMesh((4,), ("model",))), ArtifactError, r"export_model: tensor parallelism: model.blocks\[0\].attention.W_Q .* cannot be split over 4 `\"model\"` devices"),
    ("export-kv-dtype-int4", lambda tmp, _: export_model(TINY_LM, LM_CONFIG, tmp / "art", kv_dtype="int4"), ArtifactError, r"export_model: `kv_dtype` must be one of \('float32', 'bfloat16', 'float16', 'int8'\) or None; received 'int4'"),
    ("export-kv-dtype-encoder", lambda tmp, _: export_model(MODEL, CONFIG, tmp / "art", kv_dtype="int8"), ArtifactError, r"export_model: `kv_dtype` is for a language model's cache; a transformer_encoder keeps float32"),
    ("cast-to-int8", lambda: precision.cast(TINY_LM, "int8"), ValueError, r"`dtype` must be one of \('float32', 'bfloat16', 'float16'\); received `dtype='int8'`"),
    ("quantize-embeddings-string", lambda: precision.quantize(TINY_LM, embeddings="no"), ValueError, r"`embeddings` must be True or False"),
    ("import-hf-unknown-config-key", lambda tmp, capsys: hf_edited(tmp, "llama_gqa", attention_temperature=0.5), HuggingFaceError, r"LlamaForCausalLM keys the importer does not read: \{'attention_temperature': 0.5\}.*refusing rather than ignoring"),
    ("import-hf-quantization-config", lambda tmp, capsys: hf_edited(tmp, "qwen3", quantization_config={"quant_method": "awq", "bits": 4}), HuggingFaceError, r"keys the importer does not read: \{'quantization_config'"),
    ("import-hf-gemma3-patterns-disagree", lambda tmp, capsys: hf_edited(tmp, "gemma3_hub", sliding_window_pattern=3, _sliding_window_pattern=4), HuggingFaceError, r"`sliding_window_pattern` 3 and `_sliding_window_pattern` 4 disagree"),
    ("import-hf-gemma3-pattern-zero", lambda tmp, capsys: hf_edited(tmp, "gemma3_hub", sliding_window_pattern=0), HuggingFaceError, r"`sliding_window_pattern` is 0"),
    ("import-hf-gemma3-flat-rope-parameters", lambda tmp, capsys: hf_edited(tmp, "gemma3_hub", rope_parameters={"rope_type": "default", "rope_theta": 1e4}), HuggingFaceError, r"a Gemma 3 `rope_parameters` holds one mapping per layer kind"),
    ("import-hf-gemma2-layer-types-short", lambda tmp, capsys: hf_edited(tmp, "gemma2_hub", layer_types=["full_attention"]), HuggingFaceError, r"`layer_types` is \['full_attention'\]; expected 3 of"),
    ("import-hf-gemma-activation-exact-gelu", lambda tmp, capsys: hf_edited(tmp, "gemma", hidden_activation="gelu"), HuggingFaceError, r"`hidden_activation='gelu'` \(the GeGLU's activation\) is not implemented"),
    ("import-hf-qwen2-window-a-string", lambda tmp, capsys: hf_edited(tmp, "qwen2", use_sliding_window=True, sliding_window="4", layer_types=None), HuggingFaceError, r"`sliding_window` is '4'; expected"),
    ("import-hf-dtype-int8", lambda: import_hf(HF / "llama_gqa", dtype="int8"), HuggingFaceError, r"config.json describes no model TransformerLM builds: `param_dtype` must be one of"),
    ("import-hf-quantize-int4", lambda: import_hf(HF / "llama_gqa", quantize="int4"), HuggingFaceError, r"config.json describes no model TransformerLM builds: `quantize` must be one of \('int8',\)"),
    ("import-hf-quantize-embeddings-alone", lambda: import_hf(HF / "llama_gqa", quantize_embeddings=True), HuggingFaceError, r"`quantize_embeddings=True` quantizes the tables along with the projections"),
    ("checkpoint-int8-weights-as-float", lambda tmp, _: int8_stored_as_float(tmp), CheckpointError, r"the weights at \.blocks\[0\]\.attention\.W_Q\.value have shape \(16, 16\) and dtype float32; the model expects shape \(16, 16\) and dtype int8"),
    ("lm-embed-scale-string", lambda: TransformerLM(16, 16, 2, 32, 1, KEY, 8, embed_scale="true"), ValueError, r"`embed_scale` must be True or False"),
    ("moe-without-experts", lambda: TransformerLM(16, 16, 2, 32, 1, KEY, 8, feed_forward="moe"), ValueError, r"`feed_forward='moe'` needs `n_experts` and `top_k`"),
    ("experts-with-mlp", lambda: TransformerLM(16, 16, 2, 32, 1, KEY, 8, n_experts=4, top_k=2), ValueError, r"`n_experts`, `top_k` and `shared_d_ff` are the options of `feed_forward='moe'`; received them with `feed_forward='gated'`"),
    ("shared-expert-with-gated", lambda: TransformerLM(16, 16, 2, 32, 1, KEY, 8, shared_d_ff=8), ValueError, r"`n_experts`, `top_k` and `shared_d_ff` are the options of `feed_forward='moe'`"),
    ("shared-expert-width-zero", lambda: MixtureOfExperts(16, 8, KEY, 4, 2, shared_d_ff=0), ValueError, r"`shared_d_ff` must be a positive integer; received `shared_d_ff=0`"),
    ("shared-expert-width-string", lambda: MixtureOfExperts(16, 8, KEY, 4, 2, shared_d_ff="8"), ValueError, r"`shared_d_ff` must be a positive integer; received `shared_d_ff='8'` \(str\)"),
    # the hybrids' options
    ("mixers-too-few", lambda: TransformerLM(16, 16, 2, 32, 2, KEY, 8, mixers=["attention"]), ValueError, r"`mixers` must be a sequence of 2 names \(one per block\); received \['attention'\]"),
    ("mixers-a-string", lambda: TransformerLM(16, 16, 2, 32, 1, KEY, 8, mixers="attention"), ValueError, r"`mixers` must be a sequence of 1 names \(one per block\); received 'attention'"),
    ("mixers-unknown-name", lambda: TransformerLM(16, 16, 2, 32, 1, KEY, 8, mixers=["mamba"]), ValueError, r"`mixers\[0\]` must be one of \('attention', 'gru', 'lstm', 'mingru', 'short_conv', 'gated_deltanet'\); received `mixers\[0\]='mamba'`"),
    ("mixer-options-not-a-mapping", lambda: TransformerLM(16, 16, 2, 32, 1, KEY, 8, mixers=["short_conv"], mixer_options=[("short_conv", {})]), TypeError, r"`mixer_options` must be a mapping by mixer"),
    ("mixer-options-of-an-unused-kind", lambda: TransformerLM(16, 16, 2, 32, 1, KEY, 8, mixer_options={"short_conv": {"kernel": 3}}), ValueError, r"`mixer_options` for mixers no block uses: \['short_conv'\]"),
    ("mixer-options-inner-not-a-mapping", lambda: TransformerLM(16, 16, 2, 32, 1, KEY, 8, mixers=["short_conv"], mixer_options={"short_conv": 3}), TypeError, r"`mixer_options\['short_conv'\]` must be a mapping of the mixer's options"),
    ("mixer-option-misspelt", lambda: TransformerLM(16, 16, 2, 32, 1, KEY, 8, mixers=["short_conv"], mixer_options={"short_conv": {"kernal": 3}}), TypeError, r"unexpected keyword argument 'kernal'"),
    ("layer-options-on-a-recurrent-block", lambda: TransformerLM(16, 16, 2, 32, 1, KEY, 8, mixers=["short_conv"], layer_options=[{"window": 4}]), ValueError, r"`layer_options\[0\]` sets attention options on a short_conv block"),
    ("deltanet-without-heads", lambda: RecurrentBlock(16, 32, KEY, "gated_deltanet"), TypeError, r"the gated_deltanet mixer needs `n_heads`"),
    ("deltanet-heads-zero", lambda: GatedDeltaNet(16, 0, KEY), ValueError, r"`n_heads` must be a positive integer; received `n_heads=0`"),
    ("deltanet-heads-string", lambda: GatedDeltaNet(16, "4", KEY), ValueError, r"`n_heads` must be a positive integer; received `n_heads='4'` \(str\)"),
    ("deltanet-key-heads-not-dividing", lambda: GatedDeltaNet(16, 4, KEY, n_key_heads=3), ValueError, r"`n_heads=4` value heads must be a multiple of `n_key_heads=3`"),
    ("deltanet-chunk-zero", lambda: GatedDeltaNet(16, 4, KEY, chunk=0), ValueError, r"`chunk` must be a positive integer; received `chunk=0`"),
    ("deltanet-eps-negative", lambda: GatedDeltaNet(16, 4, KEY, eps=-1.0), ValueError, r"`eps` must be a positive finite number; received `eps=-1.0`"),
    ("deltanet-eps-nan", lambda: GatedDeltaNet(16, 4, KEY, eps=float("nan")), ValueError, r"`eps` must be a positive finite number; received `eps=nan`"),
    ("deltanet-wrong-width", lambda: GatedDeltaNet(16, 4, KEY)(jnp.zeros((5, 8))), ShapeError, r"GatedDeltaNet.forward: received `x.shape=\(5, 8\)`; expected `\(T, d_model=16\)`"),
    ("deltanet-a-foreign-state", lambda: GatedDeltaNet(16, 4, KEY).prefill(jnp.zeros((2, 16)), ShortConv(16, KEY).init_cache()), ShapeError, r"GatedDeltaNet.prefill: expected the DeltaState of this layer's `init_cache\(\)`; received ConvState"),
    ("short-conv-kernel-zero", lambda: ShortConv(16, KEY, kernel=0), ValueError, r"`kernel` must be a positive integer; received `kernel=0`"),
    ("short-conv-kernel-float", lambda: ShortConv(16, KEY, kernel=2.5), ValueError, r"`kernel` must be a positive integer; received `kernel=2.5` \(float\)"),
    ("short-conv-bias-string", lambda: ShortConv(16, KEY, use_bias="no"), ValueError, r"`use_bias` must be True or False; received `use_bias='no'`"),
    ("output-gate-string", lambda: MultiHeadSelfAttention(16, 2, KEY, output_gate="yes"), ValueError, r"`output_gate` must be True or False; received `output_gate='yes'`"),
    ("top-k-past-experts", lambda: TransformerLM(16, 16, 2, 32, 1, KEY, 8, feed_forward="moe", n_experts=2, top_k=3), ValueError, r"`top_k` must be at most `n_experts`; received `top_k=3`, `n_experts=2`"),
    ("balance-coefficient-negative", lambda: next_token_loss_balanced(-0.1), ValueError, r"`coefficient` must be a finite number >= 0; received -0.1"),
    ("rope-odd-head", lambda: MultiHeadSelfAttention(6, 2, KEY, rope_base=10000), ValueError, r"`d_model / n_heads` \(or `head_dim`\) times `rotary_fraction` must be even and positive; it is 3"),
    ("scan-layers-string", lambda: transformer_encoder(3, 8, 2, 16, 1, 2, KEY, 6, scan_layers="true"), ValueError, r"`scan_layers` must be True or False"),
    ("remat-unknown", lambda: transformer_encoder(3, 8, 2, 16, 1, 2, KEY, 6, remat="all"), ValueError, r"`remat` must be one of \(None, 'block', 'attention'\).*'all'"),
    ("remat-decoder-unknown", lambda: transformer_decoder(3, 8, 2, 16, 1, 2, KEY, 6, remat=True), ValueError, r"`remat` must be one of.*True"),
    ("iree-target-unknown", lambda: target_flags("rocm"), ValueError, r"unknown IREE target 'rocm'; known: llvm-cpu, cuda, vulkan-spirv"),
    ("iree-cpu-not-a-string", lambda: target_flags("llvm-cpu", cpu=3), ArtifactError, r"`cpu` must be a CPU name such as 'host', 'generic' or 'znver4'; received 3"),
    ("iree-cpu-empty", lambda: target_flags("llvm-cpu", cpu=""), ArtifactError, r"`cpu` must be a CPU name .*; received ''"),
    ("iree-cpu-smuggles-a-flag", lambda: target_flags("llvm-cpu", cpu="host --iree-opt-level=O0"), ArtifactError, r"`cpu` must be a CPU name .*; received 'host --iree-opt-level=O0'"),
    ("iree-cpu-a-flag", lambda: target_flags("llvm-cpu", cpu="--iree-opt-level=O0"), ArtifactError, r"`cpu` must be a CPU name"),
    ("iree-cpuinfo-bytes", lambda: host_cpu(b"flags : avx2"), TypeError, r"`cpuinfo` must be the text of /proc/cpuinfo; received b'flags : avx2'"),
    ("implementation-unknown", lambda: attention(implementation="flash"), ValueError, r"`implementation` must be one of \('auto', 'materialised', 'blocked', 'xla', 'cudnn'\).*'flash'"),
    ("implementation-and-memory-efficient", lambda: transformer_encoder(3, 8, 2, 16, 1, 2, KEY, 6, memory_efficient=False, implementation="blocked"), ValueError, r"`memory_efficient=False` means `implementation='materialised'`"),
    ("kv-heads-not-dividing", lambda: MultiHeadSelfAttention(8, 4, KEY, n_kv_heads=3), ValueError, r"`n_heads` must be a multiple of `n_kv_heads`.*`n_heads=4`, `n_kv_heads=3`"),
    ("kv-heads-zero", lambda: transformer_encoder(3, 8, 2, 16, 1, 2, KEY, 6, n_kv_heads=0), ValueError, r"`n_kv_heads` must be a positive integer; received `n_kv_heads=0`"),
    ("kv-heads-string", lambda: transformer_decoder(3, 8, 2, 16, 1, 2, KEY, 6, n_kv_heads="1"), ValueError, r"`n_kv_heads` must be a positive integer.*'1'"),
    ("attention-dropout-above-one", lambda: transformer_encoder(3, 8, 2, 16, 1, 2, KEY, 6, attention_dropout=1.5), ValueError, r"`attention_dropout` must be a number in \[0, 1\].*1\.5"),
    ("attention-dropout-string", lambda: transformer_decoder(3, 8, 2, 16, 1, 2, KEY, 6, attention_dropout="0.1"), ValueError, r"`attention_dropout` must be a number in \[0, 1\].*'0\.1'"),
    ("activation-unknown", lambda: transformer_encoder(3, 8, 2, 16, 1, 2, KEY, 6, activation="tanh"), ValueError, r"`activation` must be one of \('relu', 'gelu', 'gelu_tanh', 'silu'\).*'tanh'"),
    ("layer-norm-eps-zero", lambda: transformer_decoder(3, 8, 2, 16, 1, 2, KEY, 6, layer_norm_eps=0), ValueError, r"`eps` must be a positive number; received `eps=0`"),
    ("use-bias-string", lambda: MultiHeadSelfAttention(8, 2, KEY, use_bias="yes"), ValueError, r"`use_bias` must be True or False.*'yes'"),
    ("export-capacity-string", lambda: export_model(MODEL, CONFIG, "never-written", capacity="4"), ArtifactError, r"export_model: `capacity` must be a positive integer; received `capacity='4'` \(str\)"),
    ("compile-not-an-artifact", lambda: compile_artifact(pathlib.Path(__file__).parent, ["llvm-cpu"]), ArtifactError, r"has no manifest.json: not a dense_armor artifact"),
    ("import-torch-missing-file", lambda: import_torch(pathlib.Path(__file__).parent / "none.safetensors", CONFIG), InteropError, r"cannot read the state dict .*none.safetensors"),
    ("import-torch-not-a-state-dict", lambda: import_torch(CONFIG, CONFIG), InteropError, r"cannot read the state dict ModelConfig"),
    ("compute-dtype-unknown", lambda: transformer_encoder(3, 8, 2, 16, 1, 2, KEY, 6, compute_dtype="int8"), ValueError, r"`dtype` must be one of"),
    ("size-float", lambda: MultiHeadSelfAttention(8.0, 2, KEY), ValueError, r"`d_model` must be a positive integer.*8\.0.*float"),
    ("size-string", lambda: TransformerBlock(8, 2, "16", KEY), ValueError, r"`d_ff`.*'16'.*str"),
    ("size-bool", lambda: MultiHeadSelfAttention(8, True, KEY), ValueError, r"`n_heads`"),
    ("dropout-string", lambda: Dropout("0.1"), ValueError, r"`rate` must be a number in \[0, 1\].*'0.1'.*str"),
    ("dropout-above-one", lambda: Dropout(1.5), ValueError, r"`rate`.*1\.5"),
    ("dropout-nan", lambda: Dropout(float("nan")), ValueError, r"`rate`.*nan"),
    ("dropout-bool", lambda: Dropout(True), ValueError, r"`rate`.*bool"),
    # shapes: one error type, ShapeError, naming expected and received
    ("scalar-input", lambda: attention()(jnp.array(1.0)), ShapeError, r"x\.shape=\(\)`; expected `\(T, d_model=8\)"),
    ("scalar-input-encoder", lambda: MODEL(jnp.array(1.0)), ShapeError, r"x\.shape=\(\)"),
    ("mask-length", lambda: attention()(jnp.ones((5, 8)), mask=jnp.ones(4, bool)), ShapeError, r"`x`: expected Float\['T d_model'\], received shape \(5, 8\).*`mask`: expected Bool\['T'\] \| None, received shape \(4,\) dtype bool"),
    ("mask-dtype", lambda: attention()(jnp.ones((5, 8)), mask=jnp.ones(5)), ShapeError, r"`mask`.*float32"),
    ("sdpa-d_k", lambda: scaled_dot_product_attention(jnp.ones((3, 4)), jnp.ones((5, 3)), jnp.ones((5, 2))), ShapeError, r"`q`: expected Float\['\*#batch T d_k'\], received shape \(3, 4\).*`k`.*\(5, 3\)"),
    ("sdpa-integers", lambda: scaled_dot_product_attention(jnp.ones((3, 4), int), jnp.ones((5, 4), int), jnp.ones((5, 2), int)), ShapeError, r"int32"),
    ("blocked-integers", lambda: blocked_attention(jnp.ones((3, 4), int), jnp.ones((3, 4), int), jnp.ones((3, 2), int)), ShapeError, r"floating point.*int32"),
    ("list-input", lambda: attention()([[1.0] * 8] * 3), ShapeError, r"`x`: expected Float\['T d_model'\], received list"),
    ("step-cache-none", lambda: attention(causal=True).step(jnp.ones(8), None), ShapeError, r"`cache`: expected .*KVCache.*received NoneType"),
    ("step-cache-tuple", lambda: attention(causal=True).step(jnp.ones(8), (1, 2)), ShapeError, r"`cache`: expected .*received tuple"),
    # a cache of another layer: the error names the method that was called
    ("step-fixed-cache-of-another-width", lambda: attention(causal=True).step(jnp.ones(8), MultiHeadSelfAttention(16, 2, KEY, causal=True).init_cache(4)), ShapeError, r"^MultiHeadSelfAttention\.step: received `cache\.keys\.shape=\(2, 4, 8\)`; expected `\(n_heads=2, capacity, d_head=4\)`"),
    ("prefill-fixed-cache-of-another-width", lambda: attention(causal=True).prefill(jnp.ones((2, 8)), MultiHeadSelfAttention(16, 2, KEY, causal=True).init_cache(4)), ShapeError, r"^MultiHeadSelfAttention\.prefill: received `cache\.keys\.shape"),
    ("step-growing-cache-of-another-width", lambda: attention(causal=True).step(jnp.ones(8), MultiHeadSelfAttention(16, 2, KEY, causal=True).init_cache()), ShapeError, r"^MultiHeadSelfAttention\.step: .*expected `\(t, 8\)`"),
    ("step-ring-cache-without-window", lambda: attention(causal=True).step(jnp.ones(8), attention(causal=True, window=3).init_cache()), ValueError, r"^MultiHeadSelfAttention\.step: a windowed layer steps with the ring cache"),
    ("prefill-fixed-cache-with-window", lambda: attention(causal=True, window=3).prefill(jnp.ones((2, 8)), attention(causal=True).init_cache(4)), ValueError, r"^MultiHeadSelfAttention\.prefill: a windowed layer steps with the ring cache"),
    ("step-ring-of-another-window", lambda: attention(causal=True, window=5).step(jnp.ones(8), attention(causal=True, window=3).init_cache()), ShapeError, r"the ring cache holds 3 steps; this layer's window is 5"),
    ("encoder-step-cache-none", lambda: MODEL.step(jnp.ones(3), None), ValueError, r"tuple of \d+ layer caches from `init_cache`.*NoneType"),
    ("sequence-longer-than-max-len", lambda: MODEL(jnp.ones((7, 3))), ShapeError, r"`T=7` steps.*at most `max_len=6`"),
    ("sdpa-mask-integers", lambda: scaled_dot_product_attention(jnp.ones((3, 4)), jnp.ones((3, 4)), jnp.ones((3, 4)), jnp.ones((3, 3), int)), ShapeError, r"`mask`: expected Bool\['\.\.\.'\] \| None, received shape \(3, 3\) dtype int32"),
    ("prefill-width", lambda: attention(causal=True).prefill(jnp.ones((3, 7)), attention(causal=True).init_cache(4)), ShapeError, r"x\.shape=\(3, 7\)`; expected `\(K, d_model=8\)"),
    ("prefill-one-step-without-its-axis", lambda: attention(causal=True).prefill(jnp.ones(8), attention(causal=True).init_cache(4)), ShapeError, r"x\.shape=\(8,\)"),
    ("prefill-non-causal", lambda: attention().prefill(jnp.ones((2, 8)), attention(causal=True).init_cache(4)), CannotStream, r"causal=False.*cannot stream"),
    ("reset-growing-cache", lambda: reset(MODEL.init_cache(), jnp.array([True])), ValueError, r"a growing cache .* holds one stream"),
    ("reset-integer-streams", lambda: reset(MODEL.init_streams(2, 6), jnp.array([1, 0])), ShapeError, r"`streams` must be a boolean vector.*int32"),
    ("reset-wrong-batch", lambda: reset(MODEL.init_streams(2, 6), jnp.array([True])), ShapeError, r"leading axis of 1 streams"),
    ("reset-fresh-of-another-model", lambda: reset(MODEL.init_streams(2, 6), jnp.array([True, False]), fresh=attention(causal=True).init_cache(6)), ShapeError, r"`fresh` must be a cache of the same model"),
    ("reset-fresh-of-another-capacity", lambda: reset(MODEL.init_streams(2, 6), jnp.array([True, False]), fresh=MODEL.init_cache(5)), ShapeError, r"`fresh` holds an array of shape \(2, 5, 4\) where the cache holds \(2, 2, 6, 4\)"),
    ("init-streams-zero", lambda: MODEL.init_streams(0, 6), ValueError, r"`batch` must be a positive integer"),
    ("step-scalar", lambda: attention(causal=True).step(jnp.array(1.0), attention(causal=True).init_cache(2)), ShapeError, r"x_t\.shape=\(\)"),
    # recurrent layers and mixed stacks
    ("gru-size-zero", lambda: GRU(0, 4, KEY), ValueError, r"`n_in` must be a positive integer; received `n_in=0`"),
    ("lstm-key-int", lambda: LSTM(3, 4, 0), TypeError, r"`key` must be a JAX PRNG key"),
    ("mingru-hidden-string", lambda: MinGRU(3, "4", KEY), ValueError, r"`d_hidden` must be a positive integer.*'4'"),
    ("recurrent-block-mixer-unknown", lambda: RecurrentBlock(8, 16, KEY, mixer="rnn"), ValueError, r"`mixer` of a RecurrentBlock must be one of \('gru', 'lstm', 'mingru', 'short_conv', 'gated_deltanet'\).*'rnn'"),
    ("mixers-unknown", lambda: transformer_encoder(3, 8, 2, 16, 1, 2, KEY, 6, mixers="rnn"), ValueError, r"`mixers` must be one of \('attention', 'gru', 'lstm', 'mingru'\).*'rnn'"),
    ("mixers-wrong-length", lambda: transformer_encoder(3, 8, 2, 16, 1, 2, KEY, 6, mixers=("gru", "attention")), ValueError, r"a sequence of 1 of them.*`depth=1`"),
    ("mixers-mixed-and-scanned", lambda: transformer_encoder(3, 8, 2, 16, 2, 2, KEY, 6, mixers=("gru", "attention"), scan_layers=True), ValueError, r"`scan_layers=True` stacks copies of one block"),
    ("recurrent-state-of-another-layer", lambda: GRU(3, 4, KEY).step(jnp.ones(3), LSTM(3, 4, KEY).init_cache()), ShapeError, r"GRU.prefill: expected the HiddenState of this layer's `init_cache\(\)`; received LSTMState"),
    ("recurrent-state-batched", lambda: GRU(3, 4, KEY).step(jnp.ones(3), HiddenState(jnp.zeros((2, 4)))), ShapeError, r"`state.h.shape=\(2, 4\)`; expected `\(d_hidden=4,\)`.*jax.vmap"),
    ("recurrent-state-none", lambda: MinGRU(3, 4, KEY).step(jnp.ones(3), None), ShapeError, r"`cache`: expected HiddenState \| LSTMState, received NoneType"),
    ("recurrent-input-width", lambda: LSTM(3, 4, KEY)(jnp.ones((5, 2))), ShapeError, r"x\.shape=\(5, 2\)`; expected `\(T, n_in=3\)"),
    ("recurrent-mask-length", lambda: GRU(3, 4, KEY).prefill(jnp.ones((3, 3)), GRU(3, 4, KEY).init_cache(), mask=jnp.ones(2, bool)), ShapeError, r"`mask`: expected Bool\['K'\] \| None, received shape \(2,\)"),
    ("mixers-none", lambda: transformer_encoder(3, 8, 2, 16, 1, 2, KEY, 6, mixers=None), ValueError, r"`mixers` must be one of.*received `mixers=None`"),
    ("recurrent-capacity-string", lambda: GRU(3, 4, KEY).init_cache("4"), ValueError, r"`capacity` must be a positive integer.*'4'"),
    ("recurrent-model-capacity-zero", lambda: transformer_encoder(3, 8, 2, 16, 1, 2, KEY, 6, mixers="mingru", positions="none").init_cache(0), ValueError, r"`capacity`.*received `capacity=0`"),
    ("recurrent-on-overflow-unknown", lambda: GRU(3, 4, KEY).init_cache(on_overflow="wrap"), ValueError, r"`on_overflow` must be one of"),
    # configs and checkpoints
    ("load-missing-directory", lambda tmp, _: load_checkpoint(tmp / "none"), CheckpointError, r"no checkpoint directory at .*none"),
    ("config-arguments-list", lambda: ModelConfig("transformer_encoder", [1, 2]), CheckpointError, r"`arguments` must be a dict.*list"),
    ("config-factory-unknown", lambda: ModelConfig("rnn", {}), CheckpointError, r"unknown model factory 'rnn'"),
    ("config-json-list", lambda tmp, _: config_json(tmp, [1, 2]), CheckpointError, r"a JSON list, not an object"),
    ("config-json-no-factory", lambda tmp, _: config_json(tmp, {"format": checkpoint.FORMAT, "version": 1, "arguments": {}}), CheckpointError, r"lacks 'factory'"),
    ("config-as-dict", lambda tmp, _: save_checkpoint(tmp / "c", MODEL, CONFIG.to_json()), TypeError, r"`config` must be a ModelConfig.*dict"),
    ("config-of-another-model", lambda tmp, _: save_checkpoint(tmp / "c", MODEL, ModelConfig("transformer_encoder", {**CONFIG.arguments, "d_model": 16})), CheckpointError, r"saved to .*c.*shape \(3, 8\).*expects shape \(3, 16\)"),
    ("tensor-bytes-corrupted", lambda tmp, _: corrupt_tensor_bytes(tmp), CheckpointError, r"weights\.safetensors is corrupt: its sha256"),
    ("save-into-users-directory", lambda tmp, _: into_a_users_directory(tmp), CheckpointError, r"refusing to replace .*mine: it exists and is not a dense_armor checkpoint"),
    ("save-onto-a-file", lambda tmp, _: onto_a_file(tmp), CheckpointError, r"refusing to replace .*file"),
    # training
    ("fit-batch-size-float", lambda: fit_with(batch_size=4.0), TypeError, r"fit: `batch_size` must be a positive integer; received `batch_size=4\.0` \(float\)"),
    ("fit-loss-a-string", lambda: fit_with(loss_fn="cross_entropy"), TypeError, r"`loss_fn` must be a Loss or a function `\(model, xs, labels, key\) -> mean loss`; received str"),
    ("evaluate-loss-none", lambda: evaluate(MODEL, XS, LABELS, loss_fn=None), TypeError, r"`loss_fn` must be a Loss.*received NoneType"),
    ("fit-steps-float", lambda: fit_with(steps=2.5), TypeError, r"fit: `steps` must be an integer >= 0; received `steps=2\.5`"),
    ("fit-steps-negative", lambda: fit_with(steps=-1), ValueError, r"fit: `steps` must be an integer >= 0; received `steps=-1`"),
    ("fit-eval-every-zero", lambda: fit_with(eval_every=0), ValueError, r"fit: `eval_every` must be a positive integer; received `eval_every=0`"),
    ("fit-labels-column", lambda: fit_with(labels=LABELS[:, None]), ValueError, r"`labels` must have shape \(N,\).*\(8, 1\).*reshape"),
    ("fit-labels-negative", lambda: fit_with(labels=LABELS - 1), ValueError, r"`labels` must lie in \[0, 2\).*from -1 to 0"),
    ("fit-labels-too-large", lambda: fit_with(labels=LABELS * 5), ValueError, r"\[0, 2\).*from 0 to 5"),
    ("fit-labels-float", lambda: fit_with(labels=LABELS.astype(np.float32)), ValueError, r"`labels` must be integers.*float32"),
    ("fit-labels-length", lambda: fit_with(labels=LABELS[:5]), ValueError, r"8 inputs but 5 labels"),
    ("fit-valid-labels", lambda: fit_with(valid=(XS, LABELS + 2)), ValueError, r"fit \(valid\).*\[0, 2\)"),
    ("fit-resume-another-model", lambda tmp, _: resume_another_model(tmp), CheckpointError, r"holds a run of another model"),
    ("fit-nan-loss-first-step", nan_loss_at_the_first_step, FloatingPointError, r"training loss is nan at step 1"),
    ("fit-resume-another-model-sharded", lambda tmp, _: resume_another_model(tmp, "orbax"), CheckpointError, r"holds a run of another model"),
    ("fit-shard-params-a-string", lambda: fit_with(shard_params="false"), ValueError, r"`shard_params` must be True or False; received `shard_params='false'` \(str\)"),
    ("fit-resume-a-string", lambda: fit_with(resume="no"), ValueError, r"`resume` must be True or False; received `resume='no'`"),
    ("partition-specs-shard-params-a-string", lambda: partition_specs(MODEL, Mesh(np.array(jax.devices()[:1]), ("data",)), "yes"), ValueError, r"`shard_params` must be True or False"),
    ("fit-checkpoint-format", lambda: fit_with(checkpoint_format="zip"), ValueError, r"`checkpoint_format` must be one of \('safetensors', 'orbax'\); received 'zip'"),
    ("fit-train-a-string", lambda: source_fit("train.npz"), TypeError, r"`train` must be `\(xs, labels\)` or a BatchSource.*str"),
    ("fit-source-wrong-rows", lambda: source_fit(lambda step: (XS[:3], LABELS[:3])), ValueError, r"data source gave 3 inputs and 3 labels for step 0; this process feeds 4 rows"),
    ("fit-source-bad-labels", lambda: source_fit(lambda step: (XS[:4], LABELS[:4] + 5)), ValueError, r"fit \(data source\).*\[0, 2\)"),
    ("fit-mesh-a-string", lambda: fit_with(mesh="data"), TypeError, r"`mesh` must be a jax.sharding.Mesh.*str"),
    ("fit-mesh-axis-names", lambda: fit_with(mesh=Mesh(np.array(jax.devices()[:1]), ("batch",))), ValueError, r"a mesh's axes are `\"data\"` and, optionally, `\"model\"`; received \('batch',\)"),
    ("device-mesh-model-not-dividing", lambda: device_mesh(model=len(jax.devices()) + 1), ValueError, r"`model=\d+` must divide the \d+ devices"),
    ("device-mesh-model-zero", lambda: device_mesh(model=0), ValueError, r"device_mesh: `model` must be a positive integer; received `model=0`"),
    ("shard-source-batch-too-large", lambda: ShardSource(XS, LABELS, 9), ValueError, r"`batch_size=9` must lie in \[1, 8\], the rows this process holds"),
    ("shard-source-lengths", lambda: ShardSource(XS, LABELS[:3], 2), ValueError, r"8 inputs but 3 labels"),
    ("fit-orbax-not-installed", lambda tmp, _: orbax_not_installed(tmp), ImportError, r"`checkpoint_format=\"orbax\"` needs Orbax: pip install 'dense-armor\[scale\]'"),
    ("sharded-directory-is-a-file", lambda tmp, _: ShardedCheckpoints(tmp / "afile") if (tmp / "afile").write_text("x") else None, CheckpointError, r"afile is a file, not a checkpoint directory"),
    ("sharded-save-negative-step", lambda tmp, _: sharded_store(tmp).save(-1, MODEL, CONFIG), ValueError, r"ShardedCheckpoints.save: `step` must be an integer >= 0; received `step=-1`"),
    ("sharded-save-config-a-dict", lambda tmp, _: sharded_store(tmp).save(1, MODEL, dict(CONFIG.arguments)), TypeError, r"`config` must be a ModelConfig; received dict"),
    ("sharded-restore-a-step-not-saved", lambda tmp, _: sharded_restore_missing_step(tmp), CheckpointError, r"no sharded checkpoint of step 9 .*\(saved steps: \[1\]\)"),
    ("fit-resume-a-model-alone", lambda tmp, _: resume_from_a_model_alone(tmp, "safetensors"), CheckpointError, r"latest checkpoint in .*run is not a training run's"),
    ("fit-resume-a-model-alone-sharded", lambda tmp, _: resume_from_a_model_alone(tmp, "orbax"), CheckpointError, r"latest checkpoint in .*run is not a training run's"),
    ("sharded-restore-nothing-saved", lambda tmp, _: sharded_store(tmp).restore(), CheckpointError, r"no sharded checkpoint of step None in .*sharded \(saved steps: \[\]\)"),
    ("sharded-max-to-keep-zero", lambda tmp, _: sharded_store(tmp, max_to_keep=0), ValueError, r"ShardedCheckpoints \(or None\): `max_to_keep` must be a positive integer; received `max_to_keep=0`"),
    ("sharded-keep-best-string", lambda tmp, _: sharded_store(tmp, keep_best="yes"), ValueError, r"`keep_best` must be True or False"),
    ("sharded-save-another-config", lambda tmp, _: sharded_store(tmp).save(1, MODEL, ModelConfig("transformer_encoder", {**CONFIG.arguments, "d_ff": 32})), CheckpointError, r"the arrays of the model saved to .*sharded at .*hidden.W.value have shape \(8, 16\).*expects shape \(8, 32\)"),
    ("sharded-to-single-without-optimizer", lambda tmp, _: sharded_with_optimizer_state(tmp), CheckpointError, r"holds an optimizer state; pass the `optimizer`"),
    ("evaluate-length", lambda: evaluate(MODEL, XS, LABELS[:3]), ValueError, r"8 inputs but 3 labels"),
    ("evaluate-batch-size-zero", lambda: evaluate(MODEL, XS, LABELS, batch_size=0), ValueError, r"evaluate: `batch_size` must be a positive integer; received `batch_size=0`"),
    ("evaluate-labels-range", lambda: evaluate(MODEL, XS, LABELS - 1), ValueError, r"\[0, 2\)"),
    ("evaluate-empty", lambda: evaluate(MODEL, XS[:0], LABELS[:0]), ValueError, r"empty data set"),
    # streams and artifacts
    ("full-cache-under-jax-jit", full_cache_under_jax_jit, ValueError, r"the key/value cache is full \(capacity 1\): the stream stepped past the last slot.*larger capacity.*`window`.*on_overflow='nan'"),
    ("export-matmul-precision", lambda tmp, _: export_model(MODEL, CONFIG, tmp / "art", matmul_precision="tf32"), ArtifactError, r"matmul_precision must be one of \('highest', 'default'\); got 'tf32'"),
    ("artifact-step-without-cache", lambda tmp, _: artifact_step_without_cache(tmp), ArtifactError, r"`cache` must be the list of arrays.*NoneType"),
    ("cli-out-below-a-file", cli_out_below_a_file, SystemExit, r"dense-armor export: error: .*afile"),
    # round three: silent results
    ("rope-base-nan", lambda: MultiHeadSelfAttention(8, 2, KEY, rope_base=float("nan")), ValueError, r"`rope_base` must be a finite number above 1.*nan"),
    ("rope-base-inf", lambda: transformer_encoder(3, 8, 2, 16, 1, 2, KEY, 6, positions="rope", rope_base=float("inf")), ValueError, r"`rope_base` must be a finite number above 1.*inf"),
    ("rope-base-numpy-nan", lambda: MultiHeadSelfAttention(8, 2, KEY, rope_base=np.float32("nan")), ValueError, r"finite number above 1"),
    ("fit-source-negative-label-at-a-later-step", lambda: source_fit(labels_at(1, np.array([0, -1, 1, 0]))), ValueError, r"fit \(data source\): `labels` must lie in \[0, 2\).*from -1 to 1 at step 1"),
    ("fit-source-label-past-n-out-at-a-later-step", lambda: source_fit(labels_at(1, np.array([0, 2, 1, 0]))), ValueError, r"from 0 to 2 at step 1"),
    ("fit-source-float-labels-at-a-later-step", lambda: source_fit(labels_at(1, np.zeros(4, np.float32))), ValueError, r"`labels` must be integers; received dtype float32 at step 1"),
    ("array-source-batch-size-bool", lambda: ArraySource(XS, LABELS, True), ValueError, r"ArraySource: `batch_size` must be a positive integer; received `batch_size=True` \(bool\)"),
    ("import-torch-in-proj-extra-rows", lambda: import_torch(torch_state(encoder__layers__0__self_attn__in_proj_weight=lambda a: np.concatenate([a, a[:2]])), TORCH_CONFIG), InteropError, r"'encoder.layers.0.self_attn.in_proj_weight' has shape \(50, 16\); the model .* needs shape \(48, 16\)"),
    ("import-torch-in-proj-bias-extra", lambda: import_torch(torch_state(encoder__layers__1__self_attn__in_proj_bias=lambda a: np.append(a, 0.0)), TORCH_CONFIG), InteropError, r"'encoder.layers.1.self_attn.in_proj_bias' has shape \(49,\).*\(48,\)"),
    ("import-torch-linear-transposed", lambda: import_torch(torch_state(embed__weight=lambda a: np.ones((3, 16), np.float32)), TORCH_CONFIG), InteropError, r"'embed.weight' has shape \(3, 16\).*needs shape \(16, 3\)"),
    ("import-torch-nan-weight", lambda: import_torch(torch_state(encoder__layers__0__linear1__weight=lambda a: np.where(np.arange(a.size).reshape(a.shape) == 5, np.nan, a)), TORCH_CONFIG), InteropError, r"'encoder.layers.0.linear1.weight' holds 1 non-finite value"),
    ("import-torch-inf-bias", lambda: import_torch(torch_state(head__bias=lambda a: a + np.inf), TORCH_CONFIG), InteropError, r"'head.bias' holds 5 non-finite"),
    ("export-source-date-epoch-past-any-calendar", lambda tmp, _: export_with_a_date_that_is_no_number(tmp, "99999999999999"), ArtifactError, r"`SOURCE_DATE_EPOCH` must be an integer number of seconds .*received '99999999999999'"),
    ("export-source-date-epoch-no-number", lambda tmp, _: export_with_a_date_that_is_no_number(tmp), ArtifactError, r"`SOURCE_DATE_EPOCH` must be an integer number of seconds since 1970-01-01 UTC .*received 'yesterday'"),
    ("export-force-a-string", lambda tmp, _: export_over_a_users_directory(tmp), ArtifactError, r"`force` must be True or False; received `force='false'` \(str\)"),
    ("artifact-load-verify-a-string", lambda tmp, _: load(exported(tmp), verify="no"), ArtifactError, r"`verify` must be True or False; received `verify='no'`"),
    ("iree-check-edited-input-shape", lambda tmp, capsys: iree_edited(tmp, capsys, lambda m: claim_step_input(m, ["B", 4])), SystemExit, r"error: static/step.*the manifest says input 'x_t' has shape \(1, 4\).*the module has \(1, 3\)"),
    ("iree-check-edited-output-shape", lambda tmp, capsys: iree_edited(tmp, capsys, lambda m: claim_step_output(m, ["B", 7])), SystemExit, r"error: static/step.*output 'y_t' has shape \(1, 7\).*the module has \(1, 2\)"),
    ("iree-check-edited-dtype", lambda tmp, capsys: iree_edited(tmp, capsys, lambda m: m["functions"]["forward"]["inputs"][-1].update(dtype="bfloat16")), SystemExit, r"error: static/forward.*dtype bfloat16; the module has .* float32"),
    ("pjrt-check-edited-output-shape", lambda tmp, capsys: pjrt_refused(tmp, capsys, edit=lambda m: claim_step_output(m, ["B", 7])), SystemExit, r"error: static/step.*the manifest says output y_t is \(1, 7\) float32; the module has \(1, 2\) float32"),
    ("pjrt-check-plugin-missing", lambda tmp, capsys: pjrt_refused(tmp, capsys, "--plugin", str(tmp / "none.so")), SystemExit, r"error: cannot load the PJRT plugin .*none\.so"),
    ("pjrt-check-with-iree-too", lambda tmp, capsys: pjrt_refused(tmp, capsys, "--iree"), SystemExit, r"error: --pjrt and --iree are two checks: choose one"),
    ("run-pjrt-repeat-a-bool", lambda tmp, _: run_pjrt(exported(tmp), repeat=True), ArtifactError, r"`repeat` must be a positive integer; received True"),
    ("run-pjrt-steps-a-string", lambda tmp, _: run_pjrt(exported(tmp), steps="2"), ArtifactError, r"`steps` must be a positive integer .*received '2'"),
    ("run-pjrt-tolerance-nan", lambda tmp, _: run_pjrt(exported(tmp), tolerance=float("nan")), ArtifactError, r"`tolerance` must be a non-negative finite number or None; received nan"),
    ("run-pjrt-tolerance-a-string", lambda tmp, _: run_pjrt(exported(tmp), tolerance="0.1"), ArtifactError, r"`tolerance` must be .*received '0.1'"),
    ("build-runner-without-the-header", lambda tmp, _: (exported(tmp) / "pjrt_c_api.h").unlink() or build_runner(tmp / "art", tmp / "runner"), ArtifactError, r"has no pjrt_c_api\.h: export the model again"),
    ("iree-check-dropped-output", lambda tmp, capsys: iree_edited(tmp, capsys, lambda m: m["functions"]["step"]["outputs"].pop()), SystemExit, r"lists \d+ outputs of this module; the module has \d+"),
    # round three: unclear errors
    ("step-on-streams-without-vmap", lambda: MODEL.step(jnp.ones(3), MODEL.init_streams(2, 6)), ShapeError, r"a batch of streams from `init_streams`.*jax.vmap\(model.step\)"),
    ("device-mesh-no-devices", lambda: device_mesh(devices=[]), ValueError, r"device_mesh: `devices` is empty"),
    ("data-mesh-no-devices", lambda: data_mesh([]), ValueError, r"data_mesh: `devices` is empty"),
    ("device-mesh-model-float", lambda: device_mesh(model=1.0), TypeError, r"device_mesh: `model` must be a positive integer; received `model=1.0` \(float\)"),
    ("fit-source-returns-none", lambda: source_fit(lambda step: None), TypeError, r"a data source must return this process's `\(xs, labels\)`.*at step 0 it returned NoneType"),
    ("fit-source-returns-three", lambda: source_fit(lambda step: (XS[:4], LABELS[:4], None)), TypeError, r"returned tuple of 3 items"),
    ("fit-source-returns-an-array", lambda: source_fit(lambda step: XS[:4]), TypeError, r"returned ndarray"),
    ("fit-source-scalar-labels", lambda: source_fit(lambda step: (XS[:4], 1)), ValueError, r"a scalar as labels for step 0"),
    ("shard-source-part-negative", lambda: ShardSource(XS, LABELS, 2, part=-1), ValueError, r"ShardSource: `part` must be an integer >= 0; received `part=-1`"),
    ("shard-source-seed-string", lambda: ShardSource(XS, LABELS, 2, seed="1"), ValueError, r"ShardSource: `seed` must be an integer >= 0; received `seed='1'`"),
    ("array-source-batch-size-float", lambda: ArraySource(XS, LABELS, 2.5), ValueError, r"ArraySource: `batch_size` must be a positive integer; received `batch_size=2.5` \(float\)"),
    ("array-source-lengths", lambda: ArraySource(XS, LABELS[:3], 2), ValueError, r"ArraySource: 8 inputs but 3 labels"),
    ("fit-resume-tuple-mixers", lambda tmp, _: resume_with_tuple_mixers(tmp), SystemExit, r"resumed"),
    ("import-torch-config-lacks-an-argument", lambda: import_torch(TORCH_STATE, ModelConfig("transformer_encoder", {k: v for k, v in TORCH_CONFIG.arguments.items() if k != "d_ff"})), InteropError, r"does not build a model: .*d_ff"),
    ("import-torch-tensor-a-string", lambda: import_torch({**torch_state(), "embed.weight": "abc"}, TORCH_CONFIG), InteropError, r"'embed.weight' must be an array; received str"),
    ("import-torch-config-a-dict", lambda: import_torch(TORCH_STATE, dict(TORCH_CONFIG.arguments)), InteropError, r"`config` must be a ModelConfig.*received dict"),
    ("cli-serve-pages-one", lambda tmp, capsys: cli_serve(tmp, capsys, "--pages", "1"), SystemExit, r"dense-armor serve: error: Server: `pages` must be an integer >= 2; received `pages=1`"),
    ("cli-serve-pages-not-a-number", lambda tmp, capsys: cli_serve(tmp, capsys, "--pages", "x"), SystemExit, r"dense-armor serve: error: argument --pages: invalid int value: 'x'"),
    ("cli-serve-page-size-zero", lambda tmp, capsys: cli_serve(tmp, capsys, "--pages", "8", "--page-size", "0"), SystemExit, r"dense-armor serve: error: Server: `page_size` must be a positive integer; received `page_size=0`"),
    ("cli-serve-mesh-data-axis", lambda tmp, capsys: cli_serve(tmp, capsys, "--mesh", "data=2"), SystemExit, r"dense-armor serve: error: argument --mesh: expected model=N \(N devices, N >= 1\); got 'data=2'"),
    ("cli-serve-mesh-zero", lambda tmp, capsys: cli_serve(tmp, capsys, "--mesh", "model=0"), SystemExit, r"argument --mesh: expected model=N .*; got 'model=0'"),
    ("cli-serve-mesh-past-the-devices", lambda tmp, capsys: cli_serve(tmp, capsys, "--mesh", "model=2"), SystemExit, r"dense-armor serve: error: --mesh model=2: this machine has 1 cpu device\(s\)"),
    ("generate-mesh-a-string", lambda: generate(TINY_LM, [[1]], 2, mesh="model=2"), TypeError, r"generate: `mesh` must be a jax.sharding.Mesh"),
    ("generate-mesh-abstract", lambda: generate(TINY_LM, [[1]], 2, mesh=jax.sharding.AbstractMesh((1, 1), ("data", "model"))), TypeError, r"generate: `mesh` must hold devices; received an abstract mesh"),
    ("server-mesh-true", lambda: Server(TINY_LM, capacity=8, mesh=True), TypeError, r"Server: `mesh` must be a jax.sharding.Mesh .*; received bool"),
    ("stream-tokens-mesh-a-device", lambda: list(stream_tokens(TINY_LM, [1], 2, mesh=jax.devices()[0])), TypeError, r"stream_tokens: `mesh` must be a jax.sharding.Mesh"),
    ("cli-serve-mesh-not-a-number", lambda tmp, capsys: cli_serve(tmp, capsys, "--mesh", "model=two"), SystemExit, r"argument --mesh: expected model=N .*; got 'model=two'"),
    ("generate-mesh-other-axes", lambda: generate(TINY_LM, [[1]], 2, mesh=jax.sharding.Mesh(np.array(jax.devices()[:1]), ("heads",))), ValueError, r"generate: a mesh's axes are `\"data\"` and, optionally, `\"model\"`; received \('heads',\)"),
    ("cli-serve-share-prefixes-without-pages", lambda tmp, capsys: cli_serve(tmp, capsys, "--share-prefixes"), SystemExit, r"dense-armor serve: error: Server: `share_prefixes` shares pages: give `pages` too"),
    ("cli-serve-request-larger-than-the-pool", lambda tmp, capsys: cli_serve(tmp, capsys, "--pages", "2", "--page-size", "1"), SystemExit, r"dense-armor serve: error: request 1 \(0\): Server.submit: .* 3 pages of 1; the pool has 1"),
    ("cli-import-torch-config-lacks-arguments", lambda tmp, capsys: cli_import_config(tmp, capsys, {"factory": "transformer_encoder"}), SystemExit, r"dense-armor import-torch: error: .*config.json: the config lacks 'arguments'"),
    ("cli-import-torch-d-model-not-a-number", lambda tmp, capsys: cli_import_config(tmp, capsys, {"factory": "transformer_encoder", "arguments": {**TORCH_CONFIG.arguments, "d_model": "abc"}}), SystemExit, r"import-torch: error: .*does not build a model.*`d_model`.*'abc'"),
    ("cli-import-torch-unknown-factory", lambda tmp, capsys: cli_import_config(tmp, capsys, {"factory": "mlp", "arguments": {}}), SystemExit, r"import-torch: error: .*unknown model factory 'mlp'"),
    ("export-static-shape-float", lambda tmp, _: export_model(MODEL, CONFIG, tmp / "art", static_shapes=[(1, 2.5)]), ArtifactError, r"static shape \(1, 2.5\): `T` must be a positive integer; received `T=2.5`"),
    ("export-static-shape-a-number", lambda tmp, _: export_model(MODEL, CONFIG, tmp / "art", static_shapes=[4]), ArtifactError, r"a static shape is \(B, T\), a tuple of integers; got 4"),
    ("export-platforms-a-string", lambda tmp, _: export_model(MODEL, CONFIG, tmp / "art", platforms="cpu"), ArtifactError, r"`platforms` must be a list of platform names.*'cpu'"),
    ("export-sampling-for-an-encoder", lambda tmp, _: export_model(MODEL, CONFIG, tmp / "art", sampling={"temperature": 1.0}), ArtifactError, r"`sampling` is for a language model's decoding; a 'transformer_encoder' model has no tokens to sample"),
    ("export-sampling-unknown-rule", lambda tmp, _: export_model(LM_CONFIG.build(KEY), LM_CONFIG, tmp / "art", sampling={"temp": 1.0}), ArtifactError, r"`sampling` must be a dict of \['min_p', 'temperature', 'top_k', 'top_p'\]; received \{'temp': 1.0\}"),
    ("export-sampling-negative-temperature", lambda tmp, _: export_model(LM_CONFIG.build(KEY), LM_CONFIG, tmp / "art", sampling={"temperature": -1.0}), ArtifactError, r"export_model: sampling: `temperature` must be a finite number >= 0"),
    ("export-sampling-top-p-past-one", lambda tmp, _: export_model(LM_CONFIG.build(KEY), LM_CONFIG, tmp / "art", sampling={"temperature": 1.0, "top_p": 1.5}), ArtifactError, r"`top_p` must be a number in \(0, 1\]"),
    ("export-capacity-past-a-learned-table", lambda tmp, _: export_model(WINDOWED_LEARNED.build(KEY), WINDOWED_LEARNED, tmp / "art", capacity=10), ArtifactError, r"capacity 10 > max_len 6: the positional encoding of this model stops at step 6"),
    ("export-capacity-bool", lambda tmp, _: export_model(MODEL, CONFIG, tmp / "art", capacity=True), ArtifactError, r"`capacity` must be a positive integer; received `capacity=True`"),
    ("export-seed-negative", lambda tmp, _: export_model(MODEL, CONFIG, tmp / "art", seed=-1), ArtifactError, r"`seed` must be an integer >= 0; received `seed=-1`"),
    ("export-seed-a-string", lambda tmp, _: export_model(MODEL, CONFIG, tmp / "art", seed="1"), ArtifactError, r"`seed` must be an integer >= 0; received `seed='1'` \(str\)"),
    ("export-seed-a-bool", lambda tmp, _: export_model(MODEL, CONFIG, tmp / "art", seed=True), ArtifactError, r"`seed` must be an integer >= 0; received `seed=True` \(bool\)"),
    ("export-seed-a-float", lambda tmp, _: export_model(MODEL, CONFIG, tmp / "art", seed=1.5), ArtifactError, r"`seed` must be an integer >= 0; received `seed=1.5` \(float\)"),
    ("sequential-step-two-dimensional", lambda: MODEL.step(jnp.ones((1, 3)), MODEL.init_cache(6)), ShapeError, r"Sequential.step: `x_t` must be one step of shape \(n_in=3,\).*`x_t.shape=\(1, 3\)`.*jax.vmap"),
    ("sequential-step-integers", lambda: MODEL.step(jnp.ones(3, int), MODEL.init_cache(6)), ShapeError, r"Sequential.step: `x_t` must be one step of shape \(n_in=3,\), floating point; received `x_t.shape=\(3,\)` dtype int32"),
    ("sequential-step-wrong-width", lambda: MODEL.step(jnp.ones(4), MODEL.init_cache(6)), ShapeError, r"Sequential.step: `x_t`.*\(n_in=3,\).*\(4,\)"),
    ("sequential-prefill-one-step", lambda: MODEL.prefill(jnp.ones(3), MODEL.init_cache(6)), ShapeError, r"Sequential.prefill: `x` must be K steps of shape \(K, n_in=3\)"),
    ("sequential-step-a-list", lambda: MODEL.step([1.0, 2.0, 3.0], MODEL.init_cache(6)), ShapeError, r"`x_t` must be one step.*received list"),
    ("decoder-step-integers", lambda: transformer_decoder(3, 8, 2, 16, 1, 2, KEY, 6).step(jnp.ones(3, int), transformer_decoder(3, 8, 2, 16, 1, 2, KEY, 6).init_cache(jnp.ones((2, 8)), 6)), ShapeError, r"TransformerDecoder.step: `x_t` must be one step of shape \(n_in=3,\)"),
    ("config-json-a-list", lambda tmp, _: config_json(tmp, [1, 2]), CheckpointError, r"ckpt/config.json: not a dense_armor checkpoint config: a JSON list"),
    ("save-with-another-models-config", lambda tmp, _: save_checkpoint(tmp / "c", MODEL, ModelConfig("transformer_encoder", {**CONFIG.arguments, "d_model": 12})), CheckpointError, r"the config disagrees with the model \(likely in `d_model=12`: the model has 8 where the config builds 12\)"),
    ("save-with-a-deeper-config", lambda tmp, _: save_checkpoint(tmp / "c", MODEL, ModelConfig("transformer_encoder", {**CONFIG.arguments, "depth": 2})), CheckpointError, r"the config disagrees with the model: .*missing \['.layers\[3\]"),
    ("compile-jobs-zero", lambda tmp, _: compile_artifact(exported(tmp), ["llvm-cpu"], jobs=0), ArtifactError, r"compile_artifact \(or None\): `jobs` must be a positive integer; received `jobs=0`"),
    ("compile-unknown-function", lambda tmp, _: compile_artifact(exported(tmp), ["llvm-cpu"], functions=["forward", "decode"]), ArtifactError, r"the artifact has no function \['decode'\]; its functions: \['forward', 'init_cache', 'prefill', 'reset', 'step'\]"),
    ("compile-functions-a-string", lambda tmp, _: compile_artifact(exported(tmp), ["llvm-cpu"], functions="forward"), ArtifactError, r"`functions` must be a non-empty list of the artifact's functions"),
    ("compile-cache-a-file", lambda tmp, _: compile_artifact(exported(tmp), ["llvm-cpu"], cache=tmp / "art" / "manifest.json"), ArtifactError, r"the compile cache .*manifest.json is a file, not a directory"),
    ("check-golden-steps-zero", lambda tmp, _: check_golden(load(exported(tmp)), steps=0), ArtifactError, r"`steps` must be a positive integer .* or None for all; received 0"),
    ("check-iree-steps-a-string", lambda tmp, _: check_iree(exported(tmp), steps="3"), ArtifactError, r"`steps` must be a positive integer.*received '3'"),
    ("check-iree-weights-corrupted", lambda tmp, _: check_iree(flip_a_weight_byte(exported(tmp))), ArtifactError, r"weights\.safetensors does not match its sha256 in the manifest \(corrupted\)"),
    ("check-iree-device-a-gpu", lambda tmp, _: check_iree(exported(tmp), device="cuda"), ArtifactError, r"`device` must be one of \('local-task', 'local-sync'\); received 'cuda'"),
    ("run-py-iree-device-unknown", lambda tmp, _: run_py([str(exported(tmp)), "--iree", "--device", "local-gpu"]), SystemExit, r"^2$"),
    ("run-py-device-without-iree", lambda tmp, capsys: run_py_refused(tmp, capsys, "--device", "local-sync"), SystemExit, r"error: --device chooses how IREE runs: it goes with --iree"),
    ("run-py-iree-runner-without-iree", lambda tmp, capsys: run_py_refused(tmp, capsys, "--iree-runner", "python"), SystemExit, r"error: --iree-runner chooses how IREE runs: it goes with --iree"),
    ("run-py-iree-runner-unknown", lambda tmp, _: run_py([str(exported(tmp)), "--iree", "--iree-runner", "iree-run"]), SystemExit, r"^2$"),
    ("pjrt-cache-entries-corrupted", lambda tmp, _: pjrt_cache_survives(tmp, flip_every_entry), SystemExit, r"^  modules: 5 compiled, 0 read from the cache"),
    ("pjrt-cache-a-file", lambda tmp, _: pjrt_cache_survives(tmp, a_file_in_its_place), SystemExit, r"^warning: cannot write the executable cache .*cache: .*\n  modules: 5 compiled, 0 read"),
    ("check-iree-runner-unknown", lambda tmp, _: check_iree(exported(tmp), runner="tool"), ArtifactError, r"`runner` must be one of \('auto', 'python', 'iree-run-module'\); received 'tool'"),
    ("check-iree-runner-a-bool", lambda tmp, _: check_iree(exported(tmp), runner=True), ArtifactError, r"`runner` must be one of .*received True"),
    ("run-py-steps-negative", lambda tmp, capsys: run_py_refused(tmp, capsys, "--steps", "-3"), SystemExit, r"error: `steps` must be a positive integer .*received -3"),
    ("run-py-iree-steps-zero", lambda tmp, capsys: run_py_refused(tmp, capsys, "--iree", "--steps", "0"), SystemExit, r"error: `steps` must be a positive integer .*received 0"),
    ("init-streams-float", lambda: MODEL.init_streams(2.0, 6), ValueError, r"`batch` must be a positive integer; received `batch=2.0` \(float\)"),
    ("initialize-timeout-float", lambda: initialize("127.0.0.1:1", 2, 0, timeout=1.5), ValueError, r"`timeout` must be a positive number of seconds; got 1.5"),
    ("evaluate-batch-size-string", lambda: evaluate(MODEL, XS, LABELS, batch_size="8"), TypeError, r"evaluate: `batch_size` must be a positive integer; received `batch_size='8'`"),
    # the layers of a token language model, and the sampling rules
    ("embedding-float-ids", lambda: Embedding(11, 4, KEY)(jnp.array([1.0])), ShapeError, r"Embedding.forward.*`ids`: expected Int"),
    ("embedding-id-past-the-vocabulary", lambda: Embedding(11, 4, KEY)(jnp.array([3, 11])), TokenIdError, r"token id 11 at position \(1,\) is outside the vocabulary \[0, 11\)"),
    ("embedding-negative-id", lambda: Embedding(11, 4, KEY)(jnp.array([-1])), TokenIdError, r"token id -1 at position \(0,\)"),
    ("embedding-on-invalid-unknown", lambda: Embedding(11, 4, KEY, on_invalid="clip"), ValueError, r"`on_invalid` must be one of \('raise', 'nan'\); received `on_invalid='clip'`"),
    ("embedding-vocab-zero", lambda: Embedding(0, 4, KEY), ValueError, r"`vocab` must be a positive integer; received `vocab=0`"),
    ("rms-norm-eps-nan", lambda: RMSNorm(4, eps=float("nan")), ValueError, r"`eps` must be a positive finite number; received `eps=nan`"),
    ("rms-norm-eps-string", lambda: RMSNorm(4, eps="1e-6"), ValueError, r"`eps` must be a positive finite number; received `eps='1e-6'` \(str\)"),
    ("rms-norm-wrong-width", lambda: RMSNorm(4)(jnp.ones((2, 5))), ShapeError, r"RMSNorm.forward: received `x.shape=\(2, 5\)`; expected `\(\*T, d_model=4\)`"),
    ("gated-feed-forward-activation-unknown", lambda: GatedFeedForward(4, 8, KEY, "swish"), ValueError, r"`activation` must be one of \('relu', 'gelu', 'gelu_tanh', 'silu'\); received `activation='swish'`"),
    ("lm-head-wrong-width", lambda: LMHead(4, 9, KEY)(jnp.ones((2, 5))), ShapeError, r"LMHead.forward: received `h.shape=\(2, 5\)`"),
    ("sample-top-p-zero", lambda: sample(jnp.zeros(5), KEY, top_p=0.0), ValueError, r"`top_p` must be a number in \(0, 1\] \(or None\); received `top_p=0.0`"),
    ("sample-top-p-above-one", lambda: sample(jnp.zeros(5), KEY, top_p=1.5), ValueError, r"`top_p` must be a number in \(0, 1\]"),
    ("sample-top-p-nan", lambda: sample(jnp.zeros(5), KEY, top_p=float("nan")), ValueError, r"`top_p` must be a number in \(0, 1\]"),
    ("sample-temperature-negative", lambda: sample(jnp.zeros(5), KEY, temperature=-1.0), ValueError, r"`temperature` must be a finite number >= 0 \(0 is greedy\); received `temperature=-1.0`"),
    ("sample-temperature-nan", lambda: sample(jnp.zeros(5), KEY, temperature=float("nan")), ValueError, r"`temperature` must be a finite number >= 0"),
    ("sample-temperature-string", lambda: sample(jnp.zeros(5), KEY, temperature="0.7"), ValueError, r"received `temperature='0.7'` \(str\)"),
    ("sample-top-k-zero", lambda: sample(jnp.zeros(5), KEY, top_k=0), ValueError, r"`top_k` must be a positive integer; received `top_k=0`"),
    ("sample-top-k-float", lambda: sample(jnp.zeros(5), KEY, top_k=2.5), TypeError, r"`top_k` must be a positive integer; received `top_k=2.5`"),
    ("sample-top-k-bool", lambda: sample(jnp.zeros(5), KEY, top_k=True), TypeError, r"`top_k` must be a positive integer; received `top_k=True`"),
    ("sample-min-p-negative", lambda: sample(jnp.zeros(5), KEY, min_p=-0.1), ValueError, r"`min_p` must be a number in \[0, 1\] \(or None\); received `min_p=-0.1`"),
    ("sample-integer-logits", lambda: sample(jnp.zeros(5, int), KEY), ValueError, r"`logits` must be a floating-point array `\(..., vocab\)`.*dtype int32"),
    ("sample-empty-vocabulary", lambda: sample(jnp.zeros((2, 0)), KEY), ValueError, r"`logits` must be a floating-point array.*shape \(2, 0\)"),
    ("lm-positions-unknown", lambda: TransformerLM(16, 16, 2, 32, 1, KEY, 8, positions="sinusoidal"), ValueError, r"`positions` must be one of \('rope', 'learned'\); received `positions='sinusoidal'`"),
    ("lm-norm-unknown", lambda: TransformerLM(16, 16, 2, 32, 1, KEY, 8, norm="batch"), ValueError, r"`norm` must be one of \('layer', 'rms', 'rms_plus_one'\); received `norm='batch'`"),
    ("lm-feed-forward-unknown", lambda: TransformerLM(16, 16, 2, 32, 1, KEY, 8, feed_forward="sparse"), ValueError, r"`feed_forward` must be one of \('mlp', 'gated', 'moe'\)"),
    ("lm-heads-not-dividing", lambda: TransformerLM(16, 30, 4, 32, 1, KEY, 8), ValueError, r"`d_model` must be divisible by `n_heads`; received `d_model=30`, `n_heads=4`"),
    ("lm-tie-a-string", lambda: TransformerLM(16, 16, 2, 32, 1, KEY, 8, tie_embeddings="yes"), ValueError, r"`tie_embeddings` must be True or False; received `tie_embeddings='yes'`"),
    ("lm-misspelt-option", lambda: TransformerLM(16, 16, 2, 32, 1, KEY, 8, windw=3), TypeError, r"TransformerLM got unexpected keyword arguments \['windw'\]; the attention's options are \['window'"),
    ("lm-eps-nan", lambda: TransformerLM(16, 16, 2, 32, 1, KEY, 8, eps=float("nan")), ValueError, r"`eps` must be a positive finite number; received `eps=nan`"),
    ("lm-float-ids", lambda: TransformerLM(16, 16, 2, 32, 1, KEY, 8)(jnp.array([1.0, 2.0])), ShapeError, r"TransformerLM.forward.*`ids`: expected Int\['T'\]"),
    ("lm-a-batch-of-ids", lambda: TransformerLM(16, 16, 2, 32, 1, KEY, 8)(jnp.ones((2, 3), int)), ShapeError, r"TransformerLM.forward: received `ids.shape=\(2, 3\)`; expected `\(T\)`.*jax.vmap"),
    ("lm-prefill-last-a-batch-of-ids", lambda: TINY_LM.prefill_last(jnp.ones((2, 3), int), TINY_LM.init_cache(8)), ShapeError, r"TransformerLM.prefill_last: received `ids.shape=\(2, 3\)`; expected `\(K\)`"),
    ("lm-prefill-last-float-ids", lambda: TINY_LM.prefill_last(jnp.array([1.0, 2.0]), TINY_LM.init_cache(8)), ShapeError, r"TransformerLM.prefill_last.*`ids`: expected Int\['K'\]"),
    ("lm-prefill-last-no-tokens", lambda: TINY_LM.prefill_last(jnp.zeros(0, jnp.int32), TINY_LM.init_cache(8)), ValueError, r"TransformerLM.prefill_last: received no tokens \(`ids.shape=\(0,\)`\): there is no last token"),
    ("lm-step-two-ids", lambda: TransformerLM(16, 16, 2, 32, 1, KEY, 8).step(jnp.array([1, 2]), TransformerLM(16, 16, 2, 32, 1, KEY, 8).init_cache(4)), ShapeError, r"TransformerLM.step: received `x_t.shape=\(2,\)`; expected `\(\)`"),
    ("lm-source-input-id-past-the-vocabulary-at-a-later-step", lambda: lm_source_fit(1, np.full((4, 6), 16), np.zeros((4, 6), int)), ValueError, r"fit \(data source\): `xs` must lie in \[0, 16\), the model's vocabulary; received ids from 16 to 16 at step 1"),
    ("lm-source-negative-label-at-a-later-step", lambda: lm_source_fit(1, np.zeros((4, 6), int), np.full((4, 6), -1)), ValueError, r"`labels` must lie in \[0, 16\).*from -1 to -1 at step 1"),
    ("lm-source-float-inputs-at-a-later-step", lambda: lm_source_fit(1, np.zeros((4, 6), np.float32), np.zeros((4, 6), int)), ValueError, r"`xs` must be integer token ids; received dtype float32 at step 1"),
    # continuous batching
    ("server-not-a-language-model", lambda: Server(MODEL), TypeError, r"Server: `model` must be a TransformerLM; received Sequential"),
    ("server-zero-slots", lambda: Server(TINY_LM, slots=0), ValueError, r"`slots` must be a positive integer"),
    ("server-warm-up-threads-a-string", lambda: Server(TINY_LM, capacity=8).warm_up(threads="4"), (TypeError, ValueError), r"Server.warm_up: `threads` must be a positive integer; received `threads='4'`"),
    ("server-warm-up-zero-threads", lambda: Server(TINY_LM, capacity=8).warm_up(threads=0), ValueError, r"Server.warm_up: `threads` must be a positive integer; received `threads=0`"),
    ("server-chunk-a-string", lambda: Server(TINY_LM, chunk="4"), (TypeError, ValueError), r"`chunk` must be a positive integer"),
    ("server-capacity-past-learned-positions", lambda: Server(TINY_GPT, capacity=9), ValueError, r"`capacity=9` passes the model's context of 8 positions \(`max_len`"),
    ("server-capacity-past-a-rotary-context", lambda: Server(TINY_LM, capacity=9), ValueError, r"`capacity=9` passes the model's context of 8 positions \(`max_len`: an imported checkpoint's max_position_embeddings"),
    ("generate-past-a-rotary-context", lambda: generate(TINY_LM, [[1, 2, 3]], 6), ValueError, r"generate: the longest prompt \(3 tokens\) and `max_new_tokens=6` need 9 positions; the model is made for 8 \(its context"),
    ("serve-http-default-temperature-negative", lambda tmp, capsys: cli_serve(tmp, capsys, "--http", "--temperature", "-1"), SystemExit, r"serve: error: --temperature: `temperature` must be a number in \[0.0, 2.0\]"),
    ("serve-compile-cache-onto-a-file", lambda tmp, capsys: (tmp / "taken").write_text("x") and cli_serve(tmp, capsys, "--compile-cache", tmp / "taken"), SystemExit, r"serve: error: --compile-cache .*taken: File exists"),
    ("serve-http-default-top-k-a-bool", lambda tmp, capsys: cli_serve(tmp, capsys, "--http", "--top-k", "x"), SystemExit, r"argument --top-k: invalid int value: 'x'"),
    ("server-capacity-past-longrope", lambda: Server(TransformerLM(16, 8, 2, 16, 1, KEY, 32, rope_scaling={"rope_type": "longrope", "factor": 2.0, "original_max_position_embeddings": 16, "short_factor": [1.0, 1.0], "long_factor": [2.0, 2.0]}), capacity=17), ValueError, r"`capacity=17` passes the model's context of 16 positions \(.*LongRoPE's pretrained length\)"),
    ("server-temperature-without-key", lambda: Server(TINY_LM, temperature=0.5), TypeError, r"`key` must be a JAX PRNG key, e.g. `jax.random.PRNGKey\(0\)`; received None"),
    ("server-stop-token-outside-the-vocabulary", lambda: Server(TINY_LM, stop_tokens=[16]), ValueError, r"Server: `stop_tokens` \(16,\) must lie in \[0, 16\)"),
    ("server-stop-tokens-a-string", lambda: Server(TINY_LM, stop_tokens="2"), ValueError, r"Server: `stop_tokens` must be a list of token ids; received str"),
    ("server-request-longer-than-the-capacity", lambda: Server(TINY_LM, capacity=8).submit([1, 2, 3], 6), ValueError, r"Server.submit: the prompt \(3 tokens\) and `max_new_tokens=6` need 9 cache slots; each slot holds capacity=8"),
    ("server-prompt-outside-the-vocabulary", lambda: Server(TINY_LM).submit([1, 16], 2), ValueError, r"Server.submit: prompt 0 holds token id 16, outside the vocabulary \[0, 16\)"),
    ("server-empty-prompt", lambda: Server(TINY_LM).submit([], 2), ValueError, r"Server.submit: prompt 0 is empty"),
    ("server-float-prompt", lambda: Server(TINY_LM).submit([1.0, 2.0], 2), ValueError, r"Server.submit: prompt 0 must be a 1-D sequence of integer token ids"),
    ("server-max-new-tokens-zero", lambda: Server(TINY_LM).submit([1], 0), ValueError, r"`max_new_tokens` must be a positive integer"),
    ("server-slots-a-bool", lambda: Server(TINY_LM, slots=True), (TypeError, ValueError), r"Server: `slots` must be a positive integer; received `slots=True` \(bool\)"),
    ("server-capacity-zero", lambda: Server(TINY_LM, capacity=0), ValueError, r"Server: `capacity` must be a positive integer; received `capacity=0`"),
    ("server-temperature-nan", lambda: Server(TINY_LM, temperature=float("nan"), key=KEY), ValueError, r"`temperature` must be a finite number >= 0 \(0 is greedy\); received `temperature=nan`"),
    ("server-prompt-a-string", lambda: Server(TINY_LM).submit("abc", 2), ValueError, r"Server.submit: prompt 0 must be a 1-D sequence of integer token ids; received shape \(\) dtype <U3"),
    ("server-max-new-tokens-a-string", lambda: Server(TINY_LM).submit([1], "2"), (TypeError, ValueError), r"Server.submit: `max_new_tokens` must be a positive integer; received `max_new_tokens='2'` \(str\)"),
    ("server-max-queue-negative", lambda: Server(TINY_LM, max_queue=-1), ValueError, r"Server: `max_queue` must be an integer >= 0"),
    ("server-warm-up-with-requests-queued", lambda: _full_server().warm_up(), ValueError, r"Server.warm_up: call it before submitting requests"),
    ("server-max-queue-a-string", lambda: Server(TINY_LM, max_queue="8"), (TypeError, ValueError), r"`max_queue` must be an integer"),
    ("sampling-top-p-above-one", lambda: Sampling(0.5, top_p=1.5), ValueError, r"`top_p` must be a number in \(0, 1\]"),
    ("sampling-temperature-a-string", lambda: Sampling("0.5"), ValueError, r"`temperature` must be a finite number >= 0"),
    ("sampling-top-k-a-float", lambda: Sampling(1.0, top_k=2.5), (TypeError, ValueError), r"`top_k` must be a positive integer"),
    ("server-submit-key-not-a-key", lambda: Server(TINY_LM).submit([1], 2, key=3), TypeError, r"`key` must be a JAX PRNG key"),
    ("server-submit-stop-outside-the-vocabulary", lambda: Server(TINY_LM).submit([1], 2, stop_tokens=[99]), ValueError, r"Server.submit: `stop_tokens` \(99,\) must lie in \[0, 16\)"),
    ("server-queue-full", lambda: _full_server().submit([1], 2), QueueFull, r"Server.submit: 1 requests wait already \(max_queue=1\)"),
    ("server-pages-one", lambda: Server(TINY_LM, pages=1), ValueError, r"Server: `pages` must be an integer >= 2; received `pages=1` \(int\)"),
    ("server-pages-a-string", lambda: Server(TINY_LM, pages="8"), (TypeError, ValueError), r"Server: `pages` must be an integer >= 2; received `pages='8'` \(str\)"),
    ("server-pages-a-bool", lambda: Server(TINY_LM, pages=True), (TypeError, ValueError), r"`pages` must be an integer >= 2; received `pages=True` \(bool\)"),
    ("server-page-size-zero", lambda: Server(TINY_LM, pages=8, page_size=0), ValueError, r"Server: `page_size` must be a positive integer; received `page_size=0`"),
    ("server-page-size-a-float", lambda: Server(TINY_LM, pages=8, page_size=2.5), (TypeError, ValueError), r"`page_size` must be a positive integer; received `page_size=2.5` \(float\)"),
    ("server-share-prefixes-a-string", lambda: Server(TINY_LM, pages=8, share_prefixes="yes"), TypeError, r"Server: `share_prefixes` must be True, False or None; received 'yes'"),
    ("server-share-prefixes-without-pages", lambda: Server(TINY_LM, share_prefixes=True), ValueError, r"Server: `share_prefixes` shares pages: give `pages` too"),
    ("server-request-larger-than-the-pool", lambda: Server(TINY_LM, capacity=8, pages=3, page_size=2).submit([1, 2, 3], 3), ValueError, r"Server.submit: the prompt and `max_new_tokens=3` write 5 positions, 3 pages of 2; the pool has 2 \(`pages=3`, less the null page\)"),
    ("server-run-on-an-empty-queue", lambda: next(Server(TINY_LM).run()), ValueError, r"Server.run: the queue is empty; `submit` requests"),
    ("generate-not-a-language-model", lambda: generate(MODEL, [[1]], 3), TypeError, r"generate: `model` must be a TransformerLM; received Sequential"),
    ("greedy-a-list", lambda: greedy([1.0, 2.0]), ShapeError, r"`logits`: expected Float"),
    # several processes
    ("coordinator-without-port", with_env(DENSE_ARMOR_COORDINATOR="127.0.0.1"), ValueError, r"DENSE_ARMOR_COORDINATOR must be `host:port`.*'127.0.0.1'"),
    ("coordinator-port-not-a-number", with_env(DENSE_ARMOR_COORDINATOR="127.0.0.1:http"), ValueError, r"DENSE_ARMOR_COORDINATOR.*'127.0.0.1:http'"),
    ("coordinator-port-out-of-range", with_env(DENSE_ARMOR_COORDINATOR="localhost:70000"), ValueError, r"port in \[1, 65535\]"),
    ("num-processes-not-a-number", with_env(DENSE_ARMOR_COORDINATOR="127.0.0.1:1", DENSE_ARMOR_NUM_PROCESSES="two"), ValueError, r"DENSE_ARMOR_NUM_PROCESSES must be an integer >= 1.*'two'"),
    ("initialize-timeout-zero", lambda: initialize("127.0.0.1:1", 2, 0, timeout=0), ValueError, r"`timeout` must be a positive number of seconds; got 0"),
    ("initialize-bind-address-without-port", lambda: initialize("127.0.0.1:1", 2, 0, bind_address="0.0.0.0"), ValueError, r"bind_address must be `host:port`.*'0.0.0.0'"),
    ("initialize-local-devices-negative", lambda: initialize("127.0.0.1:1", 2, 0, local_device_ids=[0, -1]), ValueError, r"`local_device_ids` must be a device index or a non-empty list"),
    ("accumulate-not-dividing", lambda: fit_with(batch_size=4, accumulate=3), ValueError, r"`accumulate=3` micro-batches must divide `batch_size=4`"),
    ("accumulate-a-float", lambda: fit_with(accumulate=2.0), (TypeError, ValueError), r"fit: `accumulate` must be a positive integer; received `accumulate=2.0`"),
    ("train-step-labels-of-another-length", lambda: make_train_step(ADAM)(MODEL, ADAM.init(eqx.filter(MODEL, eqx.is_inexact_array)), XS, LABELS[:2]), ValueError, r"make_train_step: a batch of \(\d+,\) inputs needs one label per input; received labels of shape \(2,\)"),
    ("train-step-accumulate-a-bool", lambda: make_train_step(ADAM, accumulate=True), (TypeError, ValueError), r"make_train_step: `accumulate` must be a positive integer; received `accumulate=True` \(bool\)"),
    ("train-step-accumulate-zero", lambda: make_train_step(ADAM, accumulate=0), ValueError, r"make_train_step: `accumulate` must be a positive integer; received `accumulate=0`"),
    ("loss-averages-samples-a-string", lambda: Loss(lambda m, x, y, k: 0.0, averages_samples="true"), ValueError, r"`averages_samples` must be True or False; received `averages_samples='true'`"),
    ("stream-of-a-non-model", lambda: Stream(jnp.ones(3), 4), TypeError, r"Stream: expected a model that streams \(with `init_cache`, `step` and `prefill`\); received ArrayImpl"),
    ("stream-of-a-decoder-without-its-context", lambda: Stream(TransformerDecoderBlock(8, 2, 16, KEY, d_context=3), 4), TypeError, r"Stream: TransformerDecoderBlock streams against a context: pass `context=`"),
    ("stream-context-mask-without-a-context", lambda: Stream(MultiHeadSelfAttention(8, 2, KEY, causal=True), 4, context_mask=jnp.ones(3, bool)), TypeError, r"Stream: `context_mask` needs a `context`"),
    ("stream-capacity-a-string", lambda: Stream(MultiHeadSelfAttention(8, 2, KEY, causal=True), "4"), (TypeError, ValueError), r"Stream: `capacity` must be a positive integer; received `capacity='4'` \(str\)"),
    ("stream-capacity-zero", lambda: Stream(MultiHeadSelfAttention(8, 2, KEY, causal=True), 0), ValueError, r"Stream: `capacity` must be a positive integer; received `capacity=0`"),
    ("stream-of-a-layer-that-sees-the-future", lambda: Stream(MultiHeadSelfAttention(8, 2, KEY), 4), CannotStream, r"causal"),
    ("stream-prefill-of-a-scalar", lambda: Stream(MultiHeadSelfAttention(8, 2, KEY, causal=True), 4).prefill(1.0), TypeError, r"Stream.prefill: expected a chunk of steps \(a leading axis of `K` rows\); received a scalar"),
    ("stream-past-its-capacity", lambda: Stream(MultiHeadSelfAttention(8, 2, KEY, causal=True), 2).prefill(jnp.ones((3, 8))), eqx.EquinoxRuntimeError, r"Stream.prefill: the stream is full: 0 of its 2 steps taken, and this prefill needs 3"),
    ("process-id-too-large", with_env(DENSE_ARMOR_COORDINATOR="127.0.0.1:1", DENSE_ARMOR_NUM_PROCESSES="2", DENSE_ARMOR_PROCESS_ID="2"), ValueError, r"process id 2 is outside \[0, 2\)"),
]  # fmt: skip


@pytest.mark.optax
@pytest.mark.parametrize("action, error, words", [pytest.param(*r[1:], id=r[0]) for r in BAD])
def test_a_bad_input_gets_a_clear_error(action, error, words, tmp_path, capsys):
    with pytest.raises(error) as raised:
        action(tmp_path, capsys) if action.__code__.co_argcount == 2 else action()
    assert (
        raised.type is error
        or error is SystemExit
        or not issubclass(raised.type, KeyError | AttributeError | IndexError)
    )
    message = str(raised.value)
    assert re.search(words, message, re.S), message


def test_the_sweep_covers_every_cause_it_names():
    ids = [row[0] for row in BAD]
    assert len(ids) == len(set(ids)) >= 50


# What used to be refused and must be accepted


@pytest.mark.optax  # fit's optax updates mix int and float
def test_numpy_integer_sizes_are_welcome():
    m = MultiHeadSelfAttention(np.int64(8), np.int32(2), KEY)
    assert m(jnp.ones((3, 8))).shape == (3, 8)
    with pytest.raises(ShapeError, match=r"d_model=8"):
        m(jnp.ones((3, 7)))
    config = ModelConfig("transformer_encoder", {**CONFIG.arguments, "d_model": np.int64(8)})
    assert config == CONFIG and type(config.arguments["d_model"]) is int
    # one integer check for the whole package: NumPy integers pass everywhere a size is taken
    caches = MODEL.init_streams(np.int64(2), np.int32(6))
    assert jax.tree.leaves(caches)[0].shape[0] == 2
    assert device_mesh(model=np.int64(1)).shape == {"data": len(jax.devices()), "model": 1}
    source = ArraySource(XS, LABELS, np.int64(4), seed=np.int64(1))
    assert source(0)[0].shape == (4, 6, 3) and type(source.batch_size) is int
    assert ShardSource(XS, LABELS, np.int32(2), part=np.int64(0))(1)[1].shape == (2,)
    assert fit_with(steps=np.int64(2), batch_size=np.int32(4)).history[-1]["step"] == 2
    assert evaluate(MODEL, XS, LABELS, batch_size=np.int64(3))["accuracy"] >= 0


def test_numpy_arrays_are_welcome_in_the_functions_as_in_the_layers():
    q = np.random.default_rng(0).normal(size=(2, 5, 4)).astype(np.float32)
    expected = scaled_dot_product_attention(jnp.asarray(q), jnp.asarray(q), jnp.asarray(q))
    np.testing.assert_array_equal(scaled_dot_product_attention(q, q, q), expected)
    np.testing.assert_array_equal(scaled_dot_product_attention(q=q, k=q, v=q), expected)
    with pytest.raises(ShapeError, match=r"`v`: expected Float\['\*#batch S d_v'\]"):
        scaled_dot_product_attention(q, q, q[:, :3])


def test_a_config_equals_itself_read_back_from_its_json():
    mixed = {
        **CONFIG.arguments,
        "depth": 2,
        "mixers": ("attention", "gru"),
        "shape": (np.int64(1), 2),
    }
    config = ModelConfig("transformer_encoder", mixed)
    assert config.arguments["mixers"] == ["attention", "gru"]
    assert config.arguments["shape"] == [1, 2] and type(config.arguments["shape"][0]) is int
    assert ModelConfig.from_json(json.loads(json.dumps(config.to_json()))) == config


def test_an_empty_prefill_changes_nothing():
    for cache in (MODEL.init_cache(6), MODEL.init_cache()):
        ys, after = MODEL.prefill(jnp.zeros((0, 3)), cache)
        assert ys.shape == (0, 2)
        for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(cache), strict=True):
            np.testing.assert_array_equal(a, b)


def test_reset_takes_one_fresh_cache_for_every_chosen_stream():
    caches = MODEL.init_streams(3, 6)
    for _ in range(2):
        _, caches = jax.vmap(MODEL.step)(jnp.ones((3, 3)), caches)
    single = MODEL.step(jnp.ones(3), MODEL.init_cache(6))[1]  # one stream after one step
    out = reset(caches, jnp.array([True, False, True]), fresh=single)
    np.testing.assert_array_equal(out[2].index, [1, 2, 1])


def test_empty_sequences_on_both_paths():
    for flag in (True, False):
        assert attention(memory_efficient=flag)(jnp.zeros((0, 8))).shape == (0, 8)
    out = blocked_attention(jnp.zeros((2, 0, 4)), jnp.zeros((2, 0, 4)), jnp.zeros((2, 0, 3)))
    assert out.shape == (2, 0, 3)
    no_keys = blocked_attention(jnp.ones((5, 4)), jnp.zeros((0, 4)), jnp.zeros((0, 3)))
    np.testing.assert_array_equal(no_keys, np.zeros((5, 3)))


def test_fixed_and_ring_caches_step_in_64_bit_mode():
    with jax.enable_x64(True):
        for m, capacity in ((attention(causal=True), 4), (attention(causal=True, window=2), None)):
            x = jax.random.normal(KEY, (5 if capacity is None else 4, 8))
            cache = m.init_cache(capacity)
            for t in range(x.shape[0]):
                y_t, cache = m.step(x[t], cache)
            np.testing.assert_allclose(y_t, m(x)[-1], atol=1e-5)


# Masked positions contribute nothing, their values included


@pytest.mark.parametrize("memory_efficient", [False, True])
def test_nan_in_padding_never_reaches_the_output(memory_efficient):
    enc = transformer_encoder(3, 8, 2, 16, 2, 2, KEY, 8, memory_efficient=memory_efficient)
    x = jax.random.normal(KEY, (5, 3))
    padded = jnp.concatenate([x, jnp.full((3, 3), jnp.nan)])
    mask = jnp.arange(8) < 5
    y = enc(padded, mask=mask)
    assert bool(jnp.isfinite(y).all())
    np.testing.assert_allclose(y, enc(x), atol=1e-5)


@pytest.mark.parametrize("memory_efficient", [False, True])
@pytest.mark.parametrize("bad", [jnp.nan, jnp.inf])
def test_a_later_non_finite_step_leaves_earlier_causal_rows_as_step_gives_them(
    memory_efficient, bad
):
    block = TransformerBlock(8, 2, 16, KEY, causal=True, memory_efficient=memory_efficient)
    x = jax.random.normal(KEY, (6, 8)).at[4, 2].set(bad)
    y = block(x)
    assert bool(jnp.isfinite(y[:4]).all()) and not bool(jnp.isfinite(y[4:]).any())
    cache, rows = block.init_cache(6), []
    for t in range(4):
        y_t, cache = block.step(x[t], cache)
        rows.append(y_t)
    np.testing.assert_allclose(y[:4], jnp.stack(rows), atol=1e-5)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
@pytest.mark.parametrize("capacity", [None, 4])
def test_a_step_that_sees_a_non_finite_value_is_nan_whole(capacity, bad):
    """A single step skips zeroing hidden values (its hidden rows are unwritten zeros): the
    rule still holds, an infinite value seen gives a NaN row, not an infinite column."""
    m = attention(causal=True)
    _, cache = m.step(jnp.ones(8), m.init_cache(capacity))
    if capacity is None:  # growing: (t, d_model)
        cache = eqx.tree_at(lambda c: c.values, cache, cache.values.at[0, 3].set(bad))
    else:  # fixed: (n_heads, capacity, d_head)
        cache = eqx.tree_at(lambda c: c.values, cache, cache.values.at[1, 0, 1].set(bad))
    y, cache = m.step(jnp.full(8, 0.5), cache)
    assert bool(jnp.isnan(y).all())
    y, _ = m.step(jnp.full(8, 0.25), cache)  # and stays so: the row is still seen
    assert bool(jnp.isnan(y).all())


def test_a_ring_step_leaves_out_a_non_finite_value_past_its_window():
    m = attention(causal=True, window=2)
    x = jax.random.normal(KEY, (5, 8)).at[0, 3].set(np.nan)
    cache, rows = m.init_cache(), []
    for t in range(5):
        y_t, cache = m.step(x[t], cache)
        rows.append(y_t)
    assert not bool(jnp.isfinite(rows[0]).any()) and not bool(jnp.isfinite(rows[1]).any())
    clean = m(x.at[0].set(0.0))  # step 0 out of every later window: as if it were anything
    np.testing.assert_allclose(jnp.stack(rows[2:]), clean[2:], atol=1e-5)


@pytest.mark.parametrize("window", [None, 2])
def test_blocked_and_materialised_mark_the_same_rows_that_see_a_nan(window):
    q, k, v = (jax.random.normal(jax.random.fold_in(KEY, i), (7, 4)) for i in range(3))
    v = v.at[2, 1].set(jnp.nan)
    rows, cols = np.arange(7)[:, None], np.arange(7)[None, :]
    mask = (cols <= rows) & (cols > rows - (window or 7))
    dense = scaled_dot_product_attention(q, k, v, jnp.asarray(mask))
    blocked = blocked_attention(q, k, v, causal=True, window=window, block_size=(2, 3))
    sees = mask[:, 2]  # the rows whose mask shows key 2
    np.testing.assert_array_equal(np.isnan(dense).any(-1), sees)
    np.testing.assert_array_equal(np.isnan(blocked).any(-1), sees)
    np.testing.assert_allclose(dense[~sees], blocked[~sees], atol=2e-6)


@pytest.mark.parametrize("bad", [jnp.nan, jnp.inf, -jnp.inf])
def test_without_a_mask_a_non_finite_value_makes_every_row_nan(bad):
    """No mask: every query sees every key, so one non-finite value gives NaN rows (not inf,
    not a mixture), in each sequence of a batch that holds one and in no other; values shared
    by broadcasting over a leading axis of the queries too."""
    q = jax.random.normal(KEY, (2, 3, 5, 4))
    k = jax.random.normal(jax.random.fold_in(KEY, 1), (3, 6, 4))
    v = jax.random.normal(jax.random.fold_in(KEY, 2), (3, 6, 2)).at[1, 4, 0].set(bad)
    out = scaled_dot_product_attention(q, k, v)
    assert out.shape == (2, 3, 5, 2)
    assert bool(jnp.isnan(out[:, 1]).all())
    clean = np.asarray(jnp.delete(out, 1, axis=1))
    assert np.isfinite(clean).all()
    ref = scaled_dot_product_attention(q[:, ::2], k[::2], v[::2])  # without the bad sequence
    np.testing.assert_allclose(clean, ref, rtol=1e-6)


def test_a_full_cache_under_jax_jit_is_the_first_line_logged(caplog):
    """Under plain `jax.jit` JAX logs a failed callback before XLA's wrapper: for an overflow the
    logged line is the message itself, and the exception still carries it."""
    with (
        caplog.at_level("ERROR", logger="jax._src.callback"),
        pytest.raises(ValueError, match="CpuCallback") as raised,
    ):
        full_cache_under_jax_jit()
    logged = [r.getMessage() for r in caplog.records if r.name == "jax._src.callback"]
    assert logged and logged[0].startswith("dense_armor: the key/value cache is full (capacity 1)")
    assert "on_overflow='nan'" in logged[0] and "\n" not in logged[0]
    assert "the key/value cache is full (capacity 1)" in str(raised.value)


def test_other_callback_failures_are_logged_as_jax_logs_them(caplog):
    def fails(x):
        raise RuntimeError("not an overflow")

    f = jax.jit(lambda x: jax.pure_callback(fails, jax.ShapeDtypeStruct((), jnp.float32), x))
    with (
        caplog.at_level("ERROR", logger="jax._src.callback"),
        pytest.raises(Exception, match="not an overflow"),
    ):
        f(jnp.ones(())).block_until_ready()
    assert [r.getMessage() for r in caplog.records if r.name == "jax._src.callback"] == [
        "jax.pure_callback failed"
    ]


def test_a_visible_nan_still_propagates():
    q = k = jnp.ones((3, 4))
    v = jnp.ones((3, 2)).at[1, 0].set(jnp.nan)
    for out in (scaled_dot_product_attention(q, k, v), blocked_attention(q, k, v)):
        assert bool(jnp.isnan(out).all())  # every query sees value 1: every row is NaN


# Killed checkpoint writers: SIGKILL at every step of the save protocol, twice in a row

KILLER = pathlib.Path(__file__).resolve().parent / "checkpoint_killer.py"


def test_no_sequence_of_kills_loses_the_last_complete_checkpoint(tmp_path):
    versions = [jax.tree.map(lambda a, i=i: a + i, MODEL) for i in range(4)]
    source = tmp_path / "source"
    for i, model in enumerate(versions):
        save_checkpoint(source / f"v{i}", model, CONFIG)
    steps = [*WRITE_STEPS, "never"]
    pairs = [(first, second) for first in steps for second in steps]
    ran = subprocess.run(
        [sys.executable, str(KILLER), str(source), str(tmp_path / "runs"), json.dumps(pairs)],
        capture_output=True,
        text=True,
        timeout=600,
        env=child_env(),
    )
    assert ran.returncode == 0, ran.stderr
    signals = json.loads(ran.stdout)
    renamed = steps.index("renamed")
    for n, (first, second) in enumerate(pairs):
        assert signals[n] == [-signal.SIGKILL if s != "never" else 0 for s in (first, second)], (
            first,
            second,
        )
        directory = tmp_path / "runs" / str(n) / "ckpt"
        # the newest save that got past its rename is the one in place; else the one before
        expected = (
            2 if steps.index(second) >= renamed else 1 if steps.index(first) >= renamed else 0
        )
        loaded = load_checkpoint(directory)
        for name, array in tree_arrays(loaded.model).items():
            np.testing.assert_array_equal(array, tree_arrays(versions[expected])[name])
        # the next save cleans up whatever the kills left, and is the one that loads
        save_checkpoint(directory, versions[3], CONFIG)
        leftovers = sorted(p.name for p in directory.parent.iterdir() if p.name != "ckpt")
        assert leftovers == [], (first, second, leftovers)
        final = tree_arrays(load_checkpoint(directory).model)
        for name, array in tree_arrays(versions[3]).items():
            np.testing.assert_array_equal(final[name], array)
