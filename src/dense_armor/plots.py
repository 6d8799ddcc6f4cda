"""Pictures: attention heat maps. Needs matplotlib (`pip install "dense-armor[examples]"`)."""

import os
import pathlib
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["plot_attention"]


def plot_attention(
    weights: Any,
    path: str | os.PathLike[str],
    *,
    head: int = 0,
    title: str | None = None,
    query_labels: Sequence[str] | None = None,
    key_labels: Sequence[str] | None = None,
) -> pathlib.Path:
    """Write a heat map of attention weights to a PNG file.

    **Arguments:** `weights` of shape `(T, S)` or `(n_heads, T, S)` (then `head` picks one), e.g.
    from `MultiHeadSelfAttention.attention_weights` or `attention_maps`; `path`; `title`; labels
    for the rows (queries) and the columns (keys).

    **Returns:** the path written.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise ImportError("plot_attention needs matplotlib: pip install matplotlib") from error
    array = np.asarray(weights, np.float32)
    if array.ndim == 3:
        if not 0 <= head < array.shape[0]:
            raise ValueError(f"`head={head}` is out of range for {array.shape[0]} heads.")
        array = array[head]
    if array.ndim != 2:
        raise ValueError(f"expected weights of shape (T, S) or (n_heads, T, S); got {array.shape}.")
    fig, axis = plt.subplots(figsize=(1.0 + 0.45 * array.shape[1], 0.8 + 0.45 * array.shape[0]))
    image = axis.imshow(array, cmap="viridis", vmin=0.0, vmax=max(float(array.max()), 1e-6))
    axis.set_xlabel("key (step attended to)")
    axis.set_ylabel("query (step attending)")
    rows, cols = array.shape
    axis.set_xticks(range(cols), list(key_labels or map(str, range(cols))))
    axis.set_yticks(range(rows), list(query_labels or map(str, range(rows))))
    if title:
        axis.set_title(title)
    fig.colorbar(image, ax=axis, fraction=0.046, pad=0.04, label="weight")
    fig.tight_layout()
    out = pathlib.Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
