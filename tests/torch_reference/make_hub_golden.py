"""Make the reference data of the hub's older config files (needs torch and transformers; run
once, output kept; neither is a dependency of the package or the tests).

    python tests/torch_reference/make_hub_golden.py

The hub's checkpoints were mostly saved by transformers 4: their `config.json` spells keys the
older way (`rope_theta` and `rope_scaling` with `type`, Gemma 3's `rope_local_base_freq` and
`sliding_window_pattern`, no `layer_types`, Qwen's `use_sliding_window` and `max_window_layers`,
LFM2's `block_ff_dim` and `tie_embedding`) and leaves defaults out. Written here by hand the way
the hub's files are, sizes shrunk:

- `tests/data/hf_configs.json`: for each case, the hub-form config and transformers' own reading
  of it (`AutoConfig.from_pretrained(...).to_dict()`, every key in transformers 5's spelling with
  its defaults filled in). The importer must read both to the same model, or refuse the hub form
  naming the key.
- `tests/data/hf/gemma2_hub/` and `gemma3_hub/`: tiny random Gemma 2 (3 layers) and Gemma 3
  (7 layers, the pattern's default of 6) directories whose `config.json` is the hub form, and
  their logits as transformers computes them from that directory
  (`tests/data/hf/<case>.io.safetensors`).
"""

import json
import pathlib
import shutil
import tempfile

import numpy as np
import torch
import transformers
from safetensors.numpy import save_file

DATA = pathlib.Path(__file__).resolve().parent.parent / "data"
SIZES = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4)  # fmt: skip
GPT2_SIZES = dict(vocab_size=96, n_embd=32, n_layer=2, n_head=4, n_positions=64)
OLD = {"transformers_version": "4.44.0", "torch_dtype": "bfloat16", "use_cache": True}


def case(architecture, sizes=SIZES, **keys):
    return {"architectures": [architecture], **OLD, **sizes, **keys}


GEMMA2 = case(
    "Gemma2ForCausalLM", model_type="gemma2", head_dim=16, num_key_value_heads=2,
    hidden_act="gelu_pytorch_tanh", hidden_activation="gelu_pytorch_tanh",
    query_pre_attn_scalar=24, sliding_window=4, attn_logit_softcapping=5.0,
    final_logit_softcapping=3.0, rope_theta=10000.0, cache_implementation="hybrid",
    max_position_embeddings=64, initializer_range=0.2, num_hidden_layers=3,
)  # fmt: skip
GEMMA3 = case(
    "Gemma3ForCausalLM", model_type="gemma3_text", head_dim=16, num_key_value_heads=1,
    hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=16, sliding_window=4,
    rope_theta=1000000.0, rope_local_base_freq=10000.0,
    rope_scaling={"factor": 8.0, "rope_type": "linear"}, attn_logit_softcapping=None,
    final_logit_softcapping=None, cache_implementation="hybrid", max_position_embeddings=64,
    initializer_range=0.2, num_hidden_layers=7,
)  # fmt: skip
CONFIGS = {
    "gpt2-minimal": case("GPT2LMHeadModel", GPT2_SIZES, model_type="gpt2"),
    "gpt2-hub": case(
        "GPT2LMHeadModel", GPT2_SIZES, model_type="gpt2", activation_function="gelu_new",
        n_ctx=64, attn_pdrop=0.1, embd_pdrop=0.1, resid_pdrop=0.1, layer_norm_epsilon=1e-5,
        summary_activation=None, summary_first_dropout=0.1, summary_proj_to_labels=True,
        summary_type="cls_index", summary_use_proj=True,
        task_specific_params={"text-generation": {"do_sample": True, "max_length": 50}},
    ),
    "llama-minimal": case("LlamaForCausalLM", model_type="llama"),
    "llama3-rope-scaling": case(
        "LlamaForCausalLM", model_type="llama", num_key_value_heads=2, rope_theta=500000.0,
        tie_word_embeddings=True, pretraining_tp=1, rms_norm_eps=1e-5, mlp_bias=False,
        rope_scaling={"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                      "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    ),
    "llama-linear-type-key": case(
        "LlamaForCausalLM", model_type="llama", rope_scaling={"type": "linear", "factor": 2.0}
    ),
    "llama-dynamic": case(
        "LlamaForCausalLM", model_type="llama", rope_scaling={"type": "dynamic", "factor": 2.0}
    ),
    "mistral-minimal": case("MistralForCausalLM", model_type="mistral"),
    "mistral-v0.1": case("MistralForCausalLM", model_type="mistral", num_key_value_heads=2,
                         sliding_window=8, rope_theta=10000.0),
    "mistral-v0.3": case("MistralForCausalLM", model_type="mistral", num_key_value_heads=2,
                         sliding_window=None, rope_theta=1000000.0, head_dim=16),
    "mixtral-minimal": case("MixtralForCausalLM", model_type="mixtral"),
    "mixtral-hub": case(
        "MixtralForCausalLM", model_type="mixtral", num_local_experts=4, num_experts_per_tok=2,
        rope_theta=1000000.0, sliding_window=None, router_aux_loss_coef=0.02,
        output_router_logits=False, num_key_value_heads=2,
    ),
    "qwen2-minimal": case("Qwen2ForCausalLM", model_type="qwen2"),
    "qwen2.5-hub": case(
        "Qwen2ForCausalLM", model_type="qwen2", num_key_value_heads=2, rope_theta=1000000.0,
        use_sliding_window=False, sliding_window=32768, max_window_layers=21,
        tie_word_embeddings=True,
    ),
    "qwen2-window-from-a-layer": case(
        "Qwen2ForCausalLM", model_type="qwen2", use_sliding_window=True, sliding_window=8,
        max_window_layers=1,
    ),
    "qwen2-window-default-layers": case(
        "Qwen2ForCausalLM", model_type="qwen2", use_sliding_window=True, sliding_window=8
    ),
    "qwen2.5-yarn-type-key": case(
        "Qwen2ForCausalLM", model_type="qwen2", rope_theta=1000000.0,
        rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
        max_position_embeddings=128,
    ),
    "qwen3-minimal": case("Qwen3ForCausalLM", model_type="qwen3"),
    "qwen3-hub": case(
        "Qwen3ForCausalLM", model_type="qwen3", head_dim=16, num_key_value_heads=2,
        rope_theta=1000000.0, attention_bias=False, use_sliding_window=False,
        sliding_window=None, max_window_layers=28, tie_word_embeddings=True,
    ),
    "qwen3-moe-minimal": case("Qwen3MoeForCausalLM", model_type="qwen3_moe"),
    "qwen3-moe-hub": case(
        "Qwen3MoeForCausalLM", model_type="qwen3_moe", head_dim=16, num_key_value_heads=2,
        num_experts=16, num_experts_per_tok=4, moe_intermediate_size=24, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], max_window_layers=48,
        use_sliding_window=False, sliding_window=None, rope_theta=1000000.0,
    ),
    "qwen3-moe-window": case(
        "Qwen3MoeForCausalLM", model_type="qwen3_moe", use_sliding_window=True,
        sliding_window=8, max_window_layers=1,
    ),
    "phi3-minimal": case("Phi3ForCausalLM", model_type="phi3"),
    "phi3-mini-4k": case(
        "Phi3ForCausalLM", model_type="phi3", sliding_window=8, rope_theta=10000.0,
        original_max_position_embeddings=64, rope_scaling=None, embd_pdrop=0.0, resid_pdrop=0.0,
        tie_word_embeddings=False, max_position_embeddings=64,
    ),
    "phi3.5-longrope-type-key": case(
        "Phi3ForCausalLM", model_type="phi3", num_key_value_heads=2, partial_rotary_factor=0.75,
        original_max_position_embeddings=48, max_position_embeddings=64, rope_theta=10000.0,
        rope_scaling={"type": "longrope", "short_factor": [1.0, 1.25, 2.5],
                      "long_factor": [1.5, 3.0, 7.0]},
    ),
    "olmo2-minimal": case("Olmo2ForCausalLM", model_type="olmo2"),
    "olmo2-hub": case("Olmo2ForCausalLM", model_type="olmo2", rope_theta=500000.0,
                      attention_bias=False, rms_norm_eps=1e-6),
    "starcoder2-minimal": case("Starcoder2ForCausalLM", model_type="starcoder2"),
    "starcoder2-hub": case(
        "Starcoder2ForCausalLM", model_type="starcoder2", num_key_value_heads=2,
        sliding_window=8, use_bias=True, norm_epsilon=1e-5, rope_theta=100000.0,
        hidden_act="gelu_pytorch_tanh", residual_dropout=0.1, embedding_dropout=0.1,
    ),
    "gemma-minimal": case("GemmaForCausalLM", model_type="gemma"),
    "gemma-7b-gelu": case("GemmaForCausalLM", model_type="gemma", head_dim=16,
                          hidden_act="gelu", rope_theta=10000.0),
    "gemma-both-activations": case(
        "GemmaForCausalLM", model_type="gemma", head_dim=16, hidden_act="gelu",
        hidden_activation="gelu_pytorch_tanh",
    ),
    "gemma2-minimal": case("Gemma2ForCausalLM", model_type="gemma2"),
    "gemma2-hub": GEMMA2,
    "gemma3-minimal": case("Gemma3ForCausalLM", model_type="gemma3_text"),
    "gemma3-1b": case(
        "Gemma3ForCausalLM", model_type="gemma3_text", head_dim=16, num_key_value_heads=1,
        num_hidden_layers=13, sliding_window=8, sliding_window_pattern=6,
        rope_local_base_freq=10000, rope_theta=1000000, rope_scaling=None,
        query_pre_attn_scalar=16, attn_logit_softcapping=None, final_logit_softcapping=None,
    ),
    "gemma3-linear-scaling": GEMMA3,
    "gemma3-pattern-of-three": dict(GEMMA3, sliding_window_pattern=3),
    "lfm2-minimal": case("Lfm2ForCausalLM", model_type="lfm2"),
    "lfm2-hub": case(
        "Lfm2ForCausalLM", model_type="lfm2", num_hidden_layers=4, num_key_value_heads=2,
        block_auto_adjust_ff_dim=True, block_dim=32, block_ff_dim=72,
        block_ffn_dim_multiplier=1.0, block_mlp_init_scale=1.0, block_multiple_of=16,
        block_norm_eps=1e-5, block_out_init_scale=1.0, block_use_swiglu=True,
        block_use_xavier_init=True, conv_L_cache=3, conv_bias=False, conv_dim=32,
        conv_dim_out=32, conv_use_xavier_init=True, norm_eps=1e-5, num_heads=4,
        rope_theta=1000000.0, theta=1000000.0, tie_embedding=True, use_pos_enc=True,
        layer_types=["conv", "conv", "full_attention", "conv"], max_position_embeddings=128,
    ),
    "lfm2-full-attn-idxs": case(
        "Lfm2ForCausalLM", model_type="lfm2", num_hidden_layers=4, full_attn_idxs=[1, 3],
        block_multiple_of=16,
    ),
    "qwen3.5-minimal": case("Qwen3_5ForCausalLM", model_type="qwen3_5_text"),
    "qwen3.5-interval": case(
        "Qwen3_5ForCausalLM", model_type="qwen3_5_text", num_hidden_layers=4,
        full_attention_interval=2, head_dim=16, num_key_value_heads=2,
        linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8,
        linear_value_head_dim=8, linear_conv_kernel_dim=4,
    ),
    "qwen3.5-moe-minimal": case("Qwen3_5MoeForCausalLM", model_type="qwen3_5_moe_text"),
}  # fmt: skip
# The hub-form model directories, with weights and transformers' logits
MODELS = {"gemma2_hub": GEMMA2, "gemma3_hub": GEMMA3}


def transformers_reading(config):
    """transformers' reading of a `config.json` holding `config`, in its own spelling."""
    with tempfile.TemporaryDirectory() as directory:
        (pathlib.Path(directory) / "config.json").write_text(json.dumps(config))
        read = transformers.AutoConfig.from_pretrained(directory)
    out = read.to_dict()
    out["architectures"] = config["architectures"]
    return json.loads(json.dumps(out))


def make_configs():
    cases = {
        name: {"hub": config, "transformers": transformers_reading(config)}
        for name, config in CONFIGS.items()
    }
    meta = {"transformers": transformers.__version__}
    path = DATA / "hf_configs.json"
    path.write_text(json.dumps({"made_with": meta, "cases": cases}, indent=1, sort_keys=True))
    print(path, len(cases))


def make_model(name):
    hub = MODELS[name]
    torch.manual_seed(sum(map(ord, name)))
    directory = DATA / "hf" / name
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(hub, indent=2, sort_keys=True) + "\n")
    config = transformers.AutoConfig.from_pretrained(directory)
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.float32).eval()
    with tempfile.TemporaryDirectory() as saved:
        model.save_pretrained(saved, safe_serialization=True)
        shutil.copyfile(pathlib.Path(saved) / "model.safetensors", directory / "model.safetensors")
    # transformers reads the hub-form directory back: the reference is that model's
    reread = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    reread = reread.eval()  # float32 whatever the file's `torch_dtype` says
    assert reread.config.layer_types == config.layer_types
    generator = torch.Generator().manual_seed(7)
    ids = torch.randint(3, hub["vocab_size"], (2, 24), generator=generator)
    with torch.no_grad():
        logits = reread(ids).logits
    outputs = {"ids": ids.numpy().astype(np.int32), "logits": logits.numpy().astype(np.float32)}
    save_file(
        outputs,
        str(DATA / "hf" / f"{name}.io.safetensors"),
        metadata={"transformers": transformers.__version__, "torch": torch.__version__,
                  "layer_types": json.dumps(config.layer_types)},
    )  # fmt: skip
    print(name, config.layer_types)


if __name__ == "__main__":
    make_configs()
    for name in MODELS:
        make_model(name)
