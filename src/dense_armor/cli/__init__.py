"""The `dense-armor` command.

dense-armor export CHECKPOINT_DIR --out DIR [--static B,T[,S] ...] [--capacity N]
                   [--platforms cpu,cuda,tpu] [--force] [--temperature T] [--top-k K]
                   [--top-p P] [--min-p P] [--kv-dtype int8]
dense-armor compile DIR [--target llvm-cpu[,cuda,vulkan-spirv]] [--cpu host] [--cuda-arch sm_80]
                    [--functions init_cache,sample_prefill,sample_step]
dense-armor runner DIR [--plugin PLUGIN.so] [--steps N] [--repeat R] [--tolerance T] [--cc CC]
dense-armor inspect DIR
dense-armor import-torch STATE.safetensors --config CONFIG.json --out CHECKPOINT_DIR
                         [--embed NAME] [--head NAME]
dense-armor import-hf HF_MODEL_DIR --out CHECKPOINT_DIR [--dtype bfloat16] [--quantize int8]
                      [--quantize-embeddings]
dense-armor export-hf CHECKPOINT_DIR --out HF_MODEL_DIR [--architecture Qwen3ForCausalLM]
dense-armor generate CHECKPOINT_DIR (--prompt TEXT | --ids 1,2,3) [--tokenizer tokenizer.json]
                     [--max-new-tokens 32] [--temperature 0] [--top-k K] [--top-p P]
                     [--min-p P] [--stop 2,...] [--seed 0] [--kv-dtype int8]
dense-armor serve CHECKPOINT_DIR [--input FILE] [--slots 8] [--capacity N] [--chunk 16]
                  [--pages N] [--page-size 16] [--share-prefixes | --no-share-prefixes]
                  [--decode-steps K] [--max-logprobs 20]
                  [--tokenizer tokenizer.json] [--max-new-tokens 32] [--temperature 0]
                  [--top-k K] [--top-p P] [--min-p P] [--stop 2,...] [--seed 0]
                  [--kv-dtype int8]
                  [--http [--host 127.0.0.1] [--port 8000] [--max-queue 64] [--name NAME]
                          [--tool-parser hermes|llama3|mistral]]

`serve`'s sampling flags and --max-new-tokens are the defaults of the requests that set none
(over HTTP, OpenAI's defaults where a flag is not given: temperature 1, the room left in the
context); --capacity defaults to the checkpoint's context (`max_len`, an imported model's
max_position_embeddings), bounded by memory.
"""

import argparse
import sys
from collections.abc import Sequence

from . import artifacts, language, serve
from .common import UsageError

__all__ = ["main"]

COMMANDS = {**artifacts.COMMANDS, **language.COMMANDS, **serve.COMMANDS}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dense-armor", description="dense_armor tools")
    commands = parser.add_subparsers(dest="command", required=True)
    artifacts.add_commands(commands)  # export, compile, runner, import-torch, inspect
    language.add_commands(commands)  # import-hf, export-hf, generate
    serve.add_commands(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: `dense-armor export | compile | runner | import-torch | import-hf |
    generate | serve | inspect`; exit 2 with one line naming the error for what a user can fix
    (`runner`: the C runner's own status, 1 for errors beyond the tolerance)."""
    args = _parser().parse_args(argv)
    from ..checkpoints.trees import CheckpointError
    from ..export import ArtifactError
    from ..huggingface import HuggingFaceError
    from ..interop import InteropError

    try:
        status = COMMANDS[args.command](args)
    except (
        ArtifactError,
        CheckpointError,
        InteropError,
        HuggingFaceError,
        UsageError,
        OSError,
    ) as error:
        print(f"dense-armor {args.command}: error: {error}", file=sys.stderr)
        return 2
    return status or 0
