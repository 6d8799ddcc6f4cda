"""Load directories written by `export_hf` with transformers and compare their logits with the
golden data's (needs torch and transformers; a check run by hand, not a test):

    python tests/torch_reference/check_hf_export.py EXPORTED_ROOT

`EXPORTED_ROOT/<case>/` for each case of `make_hf_golden.CASES` that is there.
"""

import pathlib
import sys

import numpy as np
import torch
import transformers
from safetensors.numpy import load_file

HERE = pathlib.Path(__file__).resolve().parent.parent / "data" / "hf"
# Qwen3.5's golden logits are transformers' float64 ones, from which its float32 forward lies
# 1.5e-4 (its mixture of experts: 1.4e-5; make_hf_golden.py): the written directory is held to that
TOLERANCE = {"qwen3_5": 2e-4, "qwen3_5_moe": 2e-5}

if __name__ == "__main__":
    root = pathlib.Path(sys.argv[1])
    for directory in sorted(p for p in root.iterdir() if p.is_dir()):
        golden = load_file(str(HERE / f"{directory.name}.io.safetensors"))
        model = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
        with torch.no_grad():
            logits = model(torch.from_numpy(golden["ids"]).long()).logits.numpy()
        error = float(np.abs(logits - golden["logits"]).max())
        print(f"{directory.name}: {type(model).__name__}, largest logit difference {error:.2e}")
        assert error < TOLERANCE.get(directory.name, 1e-5), directory.name
