"""Make the PyTorch reference data of tests/test_recurrent.py (needs torch; run once, output kept).

    python tests/torch_reference/make_recurrent_golden.py

For `torch.nn.GRU` and `torch.nn.LSTM` (one layer, batch first, PyTorch's own initialisation):
the state dict (`<name>.safetensors`, keys as PyTorch names them) and, in `<name>.io.safetensors`,
a batch of inputs, a nonzero initial state and what the layer returns from the zero state and from
that initial state (every step's output and the final state).
"""

import json
import pathlib

import torch
from safetensors.numpy import save_file

HERE = pathlib.Path(__file__).resolve().parent.parent / "data" / "torch"
N_IN, D, T, B = 5, 7, 11, 3


def main() -> None:
    HERE.mkdir(parents=True, exist_ok=True)
    for name, cls in (("gru", torch.nn.GRU), ("lstm", torch.nn.LSTM)):
        torch.manual_seed(0)
        layer = cls(N_IN, D, batch_first=True)
        x = torch.randn(B, T, N_IN)
        h0 = torch.randn(1, B, D)
        state = h0 if name == "gru" else (h0, torch.randn(1, B, D))
        io = {"x": x}
        with torch.no_grad():
            y, final = layer(x)
            y0, final0 = layer(x, state)
        finals = [final] if name == "gru" else list(final)
        finals0 = [final0] if name == "gru" else list(final0)
        states = [state] if name == "gru" else list(state)
        for label, tensor in zip("hc", states, strict=False):
            io[f"{label}0"] = tensor[0]
        for label, tensor in zip("hc", finals, strict=False):
            io[f"{label}_n"] = tensor[0]
        for label, tensor in zip("hc", finals0, strict=False):
            io[f"{label}_n_from_state"] = tensor[0]
        io["y"], io["y_from_state"] = y, y0
        metadata = {"torch": torch.__version__, "case": json.dumps({"n_in": N_IN, "d": D})}
        state_dict = {k: v.numpy() for k, v in layer.state_dict().items()}
        save_file(state_dict, str(HERE / f"{name}.safetensors"), metadata=metadata)
        # A batch-first output is a strided view; safetensors writes the bytes as they lie.
        io = {k: v.contiguous().numpy() for k, v in io.items()}
        save_file(io, str(HERE / f"{name}.io.safetensors"))


if __name__ == "__main__":
    main()
