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
}


def make(name: str) -> None:
    config_class, model_class, arguments, shard_size = CASES[name]
    torch.manual_seed(sum(map(ord, name)))
    model = model_class(config_class(**arguments)).to(torch.float32).eval()
    directory = HERE / name
    shutil.rmtree(directory, ignore_errors=True)
    if shard_size is None:
        model.save_pretrained(directory, safe_serialization=True)
    else:
        model.save_pretrained(directory, safe_serialization=True, max_shard_size=shard_size)
    (directory / "generation_config.json").unlink(missing_ok=True)
    generator = torch.Generator().manual_seed(7)
    ids = torch.randint(3, VOCAB, (2, 8), generator=generator)
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
    save_file(
        {
            "ids": ids.numpy().astype(np.int32),
            "logits": logits.numpy().astype(np.float32),
            "prompt": prompt.numpy().astype(np.int32),
            "generated": generated[:, prompt.shape[1] :].numpy().astype(np.int32),
        },
        str(HERE / f"{name}.io.safetensors"),
        metadata={"transformers": transformers.__version__, "torch": torch.__version__},
    )
    files = sorted(p.name for p in directory.iterdir())
    print(name, files, json.loads((directory / "config.json").read_text())["architectures"])


if __name__ == "__main__":
    HERE.mkdir(parents=True, exist_ok=True)
    for case in CASES:
        make(case)
