"""Make the PyTorch reference data of tests/test_interop.py (needs torch; run once, output kept).

    python tests/torch_reference/make_golden.py

For each case: a `torch.nn.TransformerEncoder` (or `TransformerDecoder`) stack between an input
`Linear` and an output `Linear`, with the sinusoidal positions of Vaswani et al. added after the
input layer, in eval mode; its state dict as safetensors (`<case>.safetensors`, keys as PyTorch
names them) and inputs, padding masks and outputs (`<case>.io.safetensors`). The encoder pools
by a masked mean over time; the decoder attends causally to itself and to a padded context.
"""

import json
import math
import pathlib

import numpy as np
import torch
from safetensors.numpy import save_file

HERE = pathlib.Path(__file__).resolve().parent.parent / "data" / "torch"
N_IN, D, HEADS, D_FF, DEPTH, N_OUT, T, S, B = 3, 16, 4, 32, 2, 5, 7, 4, 3


def positions(length: int, d: int) -> torch.Tensor:
    p = np.arange(length)[:, None] * np.exp(-math.log(10000.0) * 2 * np.arange(d // 2) / d)
    table = np.stack([np.sin(p), np.cos(p)], axis=-1).reshape(length, d)
    return torch.tensor(table, dtype=torch.float32)


class Encoder(torch.nn.Module):
    def __init__(self, norm_first: bool, activation: str, eps: float):
        super().__init__()
        self.embed = torch.nn.Linear(N_IN, D)
        layer = torch.nn.TransformerEncoderLayer(
            D, HEADS, D_FF, dropout=0.0, activation=activation, layer_norm_eps=eps,
            batch_first=True, norm_first=norm_first,
        )  # fmt: skip
        norm = torch.nn.LayerNorm(D, eps=eps) if norm_first else None
        self.encoder = torch.nn.TransformerEncoder(
            layer, DEPTH, norm=norm, enable_nested_tensor=False
        )
        self.head = torch.nn.Linear(D, N_OUT)

    def forward(self, x, valid):
        h = self.embed(x) + positions(x.shape[1], D)
        h = self.encoder(h, src_key_padding_mask=~valid)
        h = (h * valid[..., None]).sum(1) / valid.sum(1, keepdim=True)
        return self.head(h)


class Decoder(torch.nn.Module):
    def __init__(self, norm_first: bool, activation: str, eps: float):
        super().__init__()
        self.embed = torch.nn.Linear(N_IN, D)
        layer = torch.nn.TransformerDecoderLayer(
            D, HEADS, D_FF, dropout=0.0, activation=activation, layer_norm_eps=eps,
            batch_first=True, norm_first=norm_first,
        )  # fmt: skip
        norm = torch.nn.LayerNorm(D, eps=eps) if norm_first else None
        self.decoder = torch.nn.TransformerDecoder(layer, DEPTH, norm=norm)
        self.head = torch.nn.Linear(D, N_OUT)

    def forward(self, x, context, context_valid):
        h = self.embed(x) + positions(x.shape[1], D)
        causal = torch.nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        h = self.decoder(
            h, context, tgt_mask=causal, tgt_is_causal=True,
            memory_key_padding_mask=~context_valid,
        )  # fmt: skip
        return self.head(h)


CASES = {
    "encoder_post_ln": (Encoder, {"norm_first": False, "activation": "relu", "eps": 1e-5}),
    "encoder_pre_ln_gelu": (Encoder, {"norm_first": True, "activation": "gelu", "eps": 1e-6}),
    "decoder_post_ln": (Decoder, {"norm_first": False, "activation": "relu", "eps": 1e-5}),
    "decoder_pre_ln_gelu": (Decoder, {"norm_first": True, "activation": "gelu", "eps": 1e-6}),
}


def main() -> None:
    HERE.mkdir(parents=True, exist_ok=True)
    for i, (name, (cls, options)) in enumerate(CASES.items()):
        torch.manual_seed(i)
        model = cls(**options).eval()
        with torch.no_grad():  # nonzero biases everywhere (PyTorch starts attention's at zero)
            for parameter in model.parameters():
                if parameter.ndim == 1:
                    parameter.add_(0.1 * torch.randn_like(parameter))
        x = torch.randn(B, T, N_IN)
        valid = torch.ones(B, T, dtype=torch.bool)
        valid[0, -2:] = False  # padding at the end of the first sequence
        io = {"x": x.numpy(), "valid": valid.numpy()}
        with torch.no_grad():
            if cls is Encoder:
                y = model(x, valid)
            else:
                context = torch.randn(B, S, D)
                context_valid = torch.ones(B, S, dtype=torch.bool)
                context_valid[1, -1] = False
                io.update(context=context.numpy(), context_valid=context_valid.numpy())
                y = model(x, context, context_valid)
        io["y"] = y.numpy()
        state = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
        metadata = {
            "torch": torch.__version__,
            "options": json.dumps({**options, "depth": DEPTH, "n_heads": HEADS}),
        }
        save_file(state, str(HERE / f"{name}.safetensors"), metadata=metadata)
        save_file(io, str(HERE / f"{name}.io.safetensors"))
        print(name, {k: v.shape for k, v in io.items()})


if __name__ == "__main__":
    main()
