"""Independent float64 NumPy implementations of the page's equations, for exact-value tests."""

import numpy as np


def softmax(scores: np.ndarray) -> np.ndarray:
    shifted = scores - scores.max(axis=-1, keepdims=True)
    e = np.exp(shifted)
    return e / e.sum(axis=-1, keepdims=True)


def attention(q, k, v, mask=None):
    scores = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    if mask is not None:
        scores = np.where(mask, scores, -np.inf)
    return softmax(scores) @ v


def multi_head(x, wq, wk, wv, wo, n_heads, causal=False):
    t, d = x.shape
    dh = d // n_heads
    heads = []
    mask = np.tril(np.ones((t, t), bool)) if causal else None
    for h in range(n_heads):
        cols = slice(h * dh, (h + 1) * dh)
        heads.append(attention((x @ wq)[:, cols], (x @ wk)[:, cols], (x @ wv)[:, cols], mask))
    return np.concatenate(heads, axis=-1) @ wo


def layer_norm(x, gain, bias, eps=1e-5):
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * gain + bias


def sinusoid(length, d_model):
    table = np.zeros((length, d_model))
    for pos in range(length):
        for i in range(d_model):
            angle = pos / 10000 ** (2 * (i // 2) / d_model)
            table[pos, i] = np.sin(angle) if i % 2 == 0 else np.cos(angle)
    return table


def as64(param) -> np.ndarray:
    return np.asarray(param.value, np.float64)


def block(x, b):
    """The post-LN block of the page, from a TransformerBlock's weights."""
    a = b.attention
    attn = multi_head(
        x, as64(a.W_Q), as64(a.W_K), as64(a.W_V), as64(a.W_O), a.n_heads, causal=a.causal
    )
    y = layer_norm(x + attn, as64(b.norm1.gain), as64(b.norm1.bias))
    ff = b.feed_forward
    hidden = np.maximum(0.0, y @ as64(ff.hidden.W) + as64(ff.hidden.b))
    f = hidden @ as64(ff.out.W) + as64(ff.out.b)
    return layer_norm(y + f, as64(b.norm2.gain), as64(b.norm2.bias))
