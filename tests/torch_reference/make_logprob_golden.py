"""Make the reference log-probabilities of the serving tests (needs torch and transformers; run
once, output kept; neither is a dependency of the package or the tests).

    python tests/torch_reference/make_logprob_golden.py

For the tiny GPT-2 and Llama (grouped-query) checkpoints of `tests/data/hf/`, loaded by
transformers in float64, and three prompts each: the greedy continuation of `NEW` tokens, the
log-softmax of the logits at every position (the prompt's, then the continuation's), and from
it what OpenAI's `logprobs` and `echo` report: each prompt token's log-probability after its
predecessors (`prompt_logprobs`, the first has none), each new token's (`logprobs`), and the
`TOP` most likely tokens at each of those positions with theirs (most likely first). Written to
`tests/data/logprobs.json`.
"""

import json
import pathlib

import numpy as np
import torch
import transformers

DATA = pathlib.Path(__file__).resolve().parent.parent / "data"
CASES = ("gpt2", "llama_gqa")
LENGTHS, NEW, TOP = (1, 5, 12), 6, 5


def case(name: str) -> list[dict]:
    model = transformers.AutoModelForCausalLM.from_pretrained(DATA / "hf" / name)
    model = model.to(torch.float64).eval()
    vocab = model.config.vocab_size
    rng = np.random.default_rng(11)
    out = []
    for n in LENGTHS:
        ids = rng.integers(0, vocab, n).tolist()
        with torch.no_grad():
            for _ in range(NEW):  # greedy, the whole sequence each step (no cache)
                logits = model(torch.tensor([ids])).logits[0, -1]
                ids.append(int(torch.argmax(logits)))
            logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0], -1).numpy()
        # position t's row scores the token at t + 1
        scored = [float(logprobs[t, ids[t + 1]]) for t in range(len(ids) - 1)]
        top = np.argsort(-logprobs, axis=-1, kind="stable")[:, :TOP]
        out.append({
            "prompt": ids[:n], "tokens": ids[n:],
            "prompt_logprobs": [None, *scored[: n - 1]], "logprobs": scored[n - 1 :],
            "top_ids": top[: len(ids) - 1].tolist(),
            "top_logprobs": np.take_along_axis(logprobs, top, -1)[: len(ids) - 1].tolist(),
        })  # fmt: skip
    return out


def main() -> None:
    golden = {name: case(name) for name in CASES}
    golden["top"] = TOP
    (DATA / "logprobs.json").write_text(json.dumps(golden, indent=1) + "\n")


if __name__ == "__main__":
    main()
