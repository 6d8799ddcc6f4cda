"""Make the Hugging Face reference data of the language-model tests (needs torch and
transformers; run once, output kept; neither is a dependency of the package or the tests).

    python tests/torch_reference/make_hf_golden.py

For each case, a tiny random model built by transformers from the config below, in float32 and
eval mode, saved as a Hugging Face model directory (`tests/data/hf/<case>/`: `config.json` and
`model.safetensors`, or shards and `model.safetensors.index.json`), and its reference outputs
(`tests/data/hf/<case>.io.safetensors`): the logits of fixed token ids `ids (2, 8)`, and the greedy
generation of 32 new tokens after `prompt (1, 5)` by `model.generate(do_sample=False)` (no stop
token), checked here against the argmax of the uncached forward on every prefix.
The weights start normal with a larger std than the models' usual 0.02, so that the logits of
different tokens are far apart and an argmax is not decided by round-off.
"""

import json
import pathlib
import shutil

import numpy as np
import torch
import transformers
from safetensors.numpy import save_file

HERE = pathlib.Path(__file__).resolve().parent.parent / "data" / "hf"
VOCAB, D, LAYERS, HEADS, D_FF, POSITIONS, NEW_TOKENS = 96, 32, 2, 4, 64, 64, 32
LLAMA = dict(
    vocab_size=VOCAB, hidden_size=D, intermediate_size=D_FF, num_hidden_layers=LAYERS,
    num_attention_heads=HEADS, max_position_embeddings=POSITIONS, rms_norm_eps=1e-6,
    initializer_range=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=0,
)  # fmt: skip
GPT2 = dict(
    vocab_size=VOCAB, n_positions=POSITIONS, n_embd=D, n_layer=LAYERS, n_head=HEADS, n_inner=D_FF,
    initializer_range=0.2, bos_token_id=1, eos_token_id=2,
)  # fmt: skip
ORIGINAL = ("gpt2", "llama_gqa", "llama_tied", "qwen2")  # made with ids (2, 8)
PHI3 = dict(  # Phi-3/4-mini's options beside Llama's
    LLAMA, num_key_value_heads=2, tie_word_embeddings=True, rms_norm_eps=1e-5, hidden_act="silu",
    resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0,
)  # fmt: skip
QWEN35 = dict(  # Qwen3.5's text models' options beside Llama's
    LLAMA, num_key_value_heads=2, head_dim=16, linear_num_value_heads=4, linear_num_key_heads=2,
    linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
    tie_word_embeddings=False,
    initializer_range=0.1,  # at 0.2 eight layers amplified float32 round-off past 1e-5
    rope_parameters={
        "rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
        "mrope_section": [1, 1, 0], "mrope_interleaved": True,
    },
)  # fmt: skip
CASES = {
    # GPT-2: learned positions, pre-LN LayerNorm with biases, the tanh GELU, fused c_attn in
    # Conv1D layout, a tied head
    "gpt2": (
        transformers.GPT2Config,
        transformers.GPT2LMHeadModel,
        GPT2,
        None,
    ),
    # Llama with grouped-query attention (2 key/value heads) and an untied head, saved in shards
    "llama_gqa": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        dict(LLAMA, num_key_value_heads=2, tie_word_embeddings=False),
        "20KB",
    ),
    # Llama with multi-head attention and a tied head
    "llama_tied": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        dict(LLAMA, num_key_value_heads=HEADS, tie_word_embeddings=True),
        None,
    ),
    # Qwen2: Llama's layers with biases on the query, key and value projections
    "qwen2": (
        transformers.Qwen2Config,
        transformers.Qwen2ForCausalLM,
        dict(LLAMA, num_key_value_heads=2, tie_word_embeddings=False),
        None,
    ),
    # Llama 3.2 (Llama-3.2-1B's config, sizes shrunk): rotary base 500000 with `llama3` scaling
    # (factor 32, 8192 pretrained positions), grouped queries, a tied head, eps 1e-5
    "llama32": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        dict(
            LLAMA,
            num_key_value_heads=2,
            tie_word_embeddings=True,
            rms_norm_eps=1e-5,
            rope_theta=500000.0,
            rope_scaling=dict(
                rope_type="llama3",
                factor=32.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=8192,
            ),
        ),
        None,
    ),
    # Qwen2.5 with YaRN (the long-context variants' `rope_scaling`: factor 4 over 32768 pretrained
    # positions, here 16, so that the ramp between interpolation and extrapolation falls inside
    # the head)
    "qwen2_yarn": (
        transformers.Qwen2Config,
        transformers.Qwen2ForCausalLM,
        dict(
            LLAMA,
            num_key_value_heads=2,
            tie_word_embeddings=False,
            rope_theta=1000000.0,
            rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16),
        ),
        None,
    ),
    # Qwen3 (Qwen3-0.6B's config): a head width apart from hidden / heads (16, not 8), RMSNorm on
    # each head's queries and keys, rotary base 1e6, a tied head
    "qwen3": (
        transformers.Qwen3Config,
        transformers.Qwen3ForCausalLM,
        dict(
            LLAMA,
            num_key_value_heads=2,
            head_dim=16,
            tie_word_embeddings=True,
            rope_theta=1000000.0,
            attention_bias=False,
            use_sliding_window=False,
        ),
        None,
    ),
    # Mistral (Mistral-7B-v0.1's sliding window, Mistral-Nemo's head width apart), window 4
    "mistral": (
        transformers.MistralConfig,
        transformers.MistralForCausalLM,
        dict(
            LLAMA,
            num_key_value_heads=2,
            head_dim=16,
            tie_word_embeddings=False,
            rope_theta=1000000.0,
            sliding_window=4,
        ),
        None,
    ),
    # Phi-3/4-mini: fused qkv_proj and gate_up_proj, Phi-4-mini's partial rotary (0.75 of each
    # head), a tied head
    "phi3": (
        transformers.Phi3Config,
        transformers.Phi3ForCausalLM,
        dict(PHI3, partial_rotary_factor=0.75, rope_theta=10000.0),
        None,
    ),
    # Phi-4-mini's LongRoPE (within its pretrained length, 48 positions here, of 64: the short
    # factors and the attention factor of 64 / 48), its partial rotary and tied head
    "phi4_mini": (
        transformers.Phi3Config,
        transformers.Phi3ForCausalLM,
        dict(
            PHI3,
            original_max_position_embeddings=48,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.75,
                "short_factor": [1.0, 1.25, 2.5],
                "long_factor": [1.5, 3.0, 7.0],
                "original_max_position_embeddings": 48,
            },
        ),
        None,
    ),
    # OLMo 2 (OLMo-2-1B's config): RMSNorm over the whole query and key projections, norms after
    # each sub-layer and none before, rotary base 500000, an untied head
    "olmo2": (
        transformers.Olmo2Config,
        transformers.Olmo2ForCausalLM,
        dict(
            LLAMA,
            num_key_value_heads=4,
            tie_word_embeddings=False,
            rope_theta=500000.0,
            attention_bias=False,
        ),
        None,
    ),
    # Gemma (1): embedding scaled by sqrt(hidden), RMSNorm scaled by 1 + w, tanh GeGLU, head 16
    "gemma": (
        transformers.GemmaConfig,
        transformers.GemmaForCausalLM,
        dict(
            LLAMA,
            num_key_value_heads=1,
            head_dim=16,
            hidden_act="gelu_pytorch_tanh",
            hidden_activation="gelu_pytorch_tanh",
            tie_word_embeddings=True,
        ),
        None,
    ),
    # Gemma 2 (gemma-2-2b's config): sliding (window 4) and global layers in turn, four norms per
    # block, attention-logit and final-logit soft-capping (caps lowered to 5 and 3, where these
    # tiny models' scores and logits reach them), a query scale apart from head_dim**-0.5
    "gemma2": (
        transformers.Gemma2Config,
        transformers.Gemma2ForCausalLM,
        dict(
            LLAMA,
            num_hidden_layers=4,
            num_key_value_heads=2,
            head_dim=16,
            hidden_activation="gelu_pytorch_tanh",
            query_pre_attn_scalar=24,
            sliding_window=4,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=3.0,
            tie_word_embeddings=True,
        ),
        None,
    ),
    # Gemma 3 text (gemma-3-1b-it's config, with gemma-3-4b's linear scaling of the global
    # layers): sliding layers (window 4, base 10000) and global ones (base 1e6), q/k norms; two
    # sliding layers to one global (the checkpoints' five to one, shrunk), four layers so that the
    # pattern repeats and leaves one over
    "gemma3": (
        transformers.Gemma3TextConfig,
        transformers.Gemma3ForCausalLM,
        dict(
            LLAMA,
            num_hidden_layers=4,
            sliding_window_pattern=3,
            num_key_value_heads=1,
            head_dim=16,
            hidden_activation="gelu_pytorch_tanh",
            query_pre_attn_scalar=16,
            sliding_window=4,
            rope_theta=1000000.0,
            rope_local_base_freq=10000.0,
            rope_scaling=dict(rope_type="linear", factor=8.0),
            tie_word_embeddings=True,
        ),
        None,
    ),
    # StarCoder2: LayerNorm with biases, the two-layer MLP with tanh GELU, biases everywhere,
    # a sliding window (4)
    "starcoder2": (
        transformers.Starcoder2Config,
        transformers.Starcoder2ForCausalLM,
        dict(
            LLAMA,
            num_key_value_heads=2,
            norm_epsilon=1e-5,
            use_bias=True,
            sliding_window=4,
            hidden_act="gelu_pytorch_tanh",
            rope_theta=100000.0,
            tie_word_embeddings=True,
            residual_dropout=0.0,
            embedding_dropout=0.0,
        ),
        None,
    ),
    # Mixtral (Mixtral-8x7B's config): 8 experts, top 2 renormalised, a sliding window unset
    "mixtral": (
        transformers.MixtralConfig,
        transformers.MixtralForCausalLM,
        dict(
            LLAMA,
            num_key_value_heads=2,
            num_local_experts=8,
            num_experts_per_tok=2,
            tie_word_embeddings=False,
            rope_theta=1000000.0,
            sliding_window=None,
            router_aux_loss_coef=0.02,
            output_router_logits=False,
        ),
        None,
    ),
    # Qwen3-MoE (Qwen3-30B-A3B's config): 16 experts here (128 there), top 4 without
    # renormalisation (`norm_topk_prob` false, as Qwen1.5-MoE; Qwen3-30B-A3B has it true), expert
    # width apart from the dense one, head width apart, q/k norms
    "qwen3_moe": (
        transformers.Qwen3MoeConfig,
        transformers.Qwen3MoeForCausalLM,
        dict(
            LLAMA,
            num_key_value_heads=2,
            head_dim=16,
            num_experts=16,
            num_experts_per_tok=4,
            moe_intermediate_size=24,
            norm_topk_prob=False,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            tie_word_embeddings=False,
            rope_theta=1000000.0,
            output_router_logits=False,
        ),
        None,
    ),
    # LFM2 (LFM2-350M's layer pattern, shrunk): short gated convolutions (kernel 3) with full
    # attention on some layers, per-head query/key norms, the feed-forward width adjusted as
    # LFM2 adjusts it (two thirds of 72, up to a multiple of 16: 48), a tied head
    "lfm2": (
        transformers.Lfm2Config,
        transformers.Lfm2ForCausalLM,
        dict(
            LLAMA,
            num_hidden_layers=4,
            num_key_value_heads=2,
            intermediate_size=72,
            block_multiple_of=16,
            layer_types=["conv", "conv", "full_attention", "conv"],
            norm_eps=1e-5,
            conv_L_cache=3,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        ),
        None,
    ),
    # Qwen3.5's text model (Qwen3.5-9B's layout, shrunk): Gated DeltaNet layers (4 value heads
    # over 2 key heads, widths 8, kernel 4) and full attention (gated output, 1 + w query/key
    # norms, a quarter of each head rotated) in turn, four layers: two of each, the pattern
    # repeated (the checkpoints' full attention every fourth layer is the mixture of experts'
    # below)
    "qwen3_5": (
        transformers.Qwen3_5TextConfig,
        transformers.Qwen3_5ForCausalLM,
        dict(QWEN35, num_hidden_layers=4, full_attention_interval=2),
        None,
    ),
    # Qwen3.5's mixture-of-experts text model (Qwen3.5-35B-A3B's layout, shrunk): the layers of
    # qwen3_5 above, each feed-forward 8 experts (top 2, renormalised) and a shared expert of its
    # own width behind a sigmoid gate
    "qwen3_5_moe": (
        transformers.Qwen3_5MoeTextConfig,
        transformers.Qwen3_5MoeForCausalLM,
        dict(
            QWEN35,
            num_hidden_layers=4,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=24,
            shared_expert_intermediate_size=40,
            output_router_logits=False,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000000.0,
                "partial_rotary_factor": 0.25,
            },
        ),
        None,
    ),
    # Qwen3.5 as published: the multimodal wrapper (`Qwen3_5ForConditionalGeneration`, the text
    # model's config its `text_config`, its tensors under `model.language_model.`) with a one-block
    # vision tower, which a text prompt leaves idle; four text layers
    "qwen3_5_vl": (
        transformers.Qwen3_5Config,
        transformers.Qwen3_5ForConditionalGeneration,
        dict(
            text_config=dict(QWEN35, num_hidden_layers=4),
            vision_config=dict(
                depth=1, hidden_size=16, num_heads=2, intermediate_size=32, out_hidden_size=32
            ),
            tie_word_embeddings=False,
        ),
        None,
    ),
}
# Qwen3.5's mixture of experts as published (`Qwen3_5MoeForConditionalGeneration`)
CASES["qwen3_5_moe_vl"] = (
    transformers.Qwen3_5MoeConfig,
    transformers.Qwen3_5MoeForConditionalGeneration,
    dict(
        text_config={
            k: v for k, v in CASES["qwen3_5_moe"][2].items() if k != "output_router_logits"
        },
        vision_config=dict(
            depth=1, hidden_size=16, num_heads=2, intermediate_size=32, out_hidden_size=32
        ),
        tie_word_embeddings=False,
    ),
    None,
)
# Cases whose vectors (norm gains, decay rates, biases) start away from their initial values
# (a gain of ones or a bias of zeros hides a wrong index), and whose reference logits are
# transformers' in float64
PERTURBED = ("lfm2", "qwen3_5", "qwen3_5_moe", "qwen3_5_vl", "qwen3_5_moe_vl")
LONG_IDS = 24  # sequences past the windows (4) and the YaRN model's 16 pretrained positions


def make(name: str) -> None:
    config_class, model_class, arguments, shard_size = CASES[name]
    torch.manual_seed(sum(map(ord, name)))
    config = config_class(**arguments)
    config._experts_implementation = "eager"  # the experts' loop, which float64 runs too
    model = model_class(config).to(torch.float32).eval()
    if name in PERTURBED:
        with torch.no_grad():
            for parameter in model.parameters():
                if parameter.ndim == 1:
                    parameter.add_(0.3 * torch.randn_like(parameter))
    directory = HERE / name
    shutil.rmtree(directory, ignore_errors=True)
    if shard_size is None:
        model.save_pretrained(directory, safe_serialization=True)
    else:
        model.save_pretrained(directory, safe_serialization=True, max_shard_size=shard_size)
    (directory / "generation_config.json").unlink(missing_ok=True)
    generator = torch.Generator().manual_seed(7)
    ids = torch.randint(3, VOCAB, (2, 8 if name in ORIGINAL else LONG_IDS), generator=generator)
    prompt = torch.randint(3, VOCAB, (1, 5), generator=generator)
    with torch.no_grad():
        logits = model(ids).logits
        generated = model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            do_sample=False,
            max_new_tokens=NEW_TOKENS,
            eos_token_id=None,  # plain argmax: no stop, no token masked
            pad_token_id=0,
        )
        assert generated.shape[1] == prompt.shape[1] + NEW_TOKENS
        uncached = prompt  # the argmax of the whole forward on every prefix, without a cache
        for _ in range(NEW_TOKENS):
            following = model(uncached).logits[:, -1].argmax(-1, keepdim=True)
            uncached = torch.cat([uncached, following], dim=1)
        assert torch.equal(generated, uncached), name
    if name in PERTURBED:  # the reference in float64: transformers' float32 path of these
        with torch.no_grad():  # models is itself 1e-4 from it (the delta rule's chunked form)
            logits = model.to(torch.float64)(ids).logits
    outputs = {
        "ids": ids.numpy().astype(np.int32),
        "logits": logits.numpy().astype(np.float32),
        "prompt": prompt.numpy().astype(np.int32),
        "generated": generated[:, prompt.shape[1] :].numpy().astype(np.int32),
    }
    if "experts" in name or "moe" in name or name == "mixtral":  # the load-balancing loss
        with torch.no_grad():
            aux = model(ids, output_router_logits=True).aux_loss
        outputs["aux_loss"] = np.asarray(aux.numpy(), np.float32).reshape(())
    save_file(
        outputs,
        str(HERE / f"{name}.io.safetensors"),
        metadata={"transformers": transformers.__version__, "torch": torch.__version__},
    )
    files = sorted(p.name for p in directory.iterdir())
    print(name, files, json.loads((directory / "config.json").read_text())["architectures"])


if __name__ == "__main__":
    import sys

    HERE.mkdir(parents=True, exist_ok=True)
    for case in sys.argv[1:] or CASES:
        make(case)
