"""The mixture-of-experts feed-forward (Shazeer et al. 2017; Mixtral's and Qwen3-MoE's sparse
block): a router picks `top_k` of `n_experts` SwiGLU experts for each position, and the position's
output is their outputs weighted by the router's softmax (in float32), renormalised over the
chosen ones when `normalize_top_k` (Mixtral always; Qwen3-MoE as `norm_topk_prob` says).

Two computations give the same result: a dense one, every expert on every position and the
outputs combined by weights that are zero off the chosen experts (a one-hot sum, no scatter); and
a routed one, each choice's expert's matrices sliced out in turn (at the indices `largest` gives,
clipped: in range by construction), which reads `top_k / n_experts` of the weights. The
routed one runs when a call makes fewer choices than there are experts (`T * top_k <
n_experts`: a decoding step), the dense one otherwise (a prompt, and a prompt of symbolic length
in an export). Measured on the 2-core AMD EPYC
(d_model 1024, experts 384 wide, 8 of 64, XLA CPU): one position 2.4 ms routed against 7.9 ms
dense; 4 positions 6.9 against 10.8; 16 positions 37.3 against 15.3.

A shared expert (`shared_d_ff`, Qwen2-MoE's, Qwen3-Next's and Qwen3.5-MoE's) is a SwiGLU that
every position goes through besides the chosen ones, its output scaled by `sigmoid(x w)` (`w
(d_model, 1)`, `shared_gate`) and added to theirs.

`balance_loss(router_logits, n_experts, top_k)` is the load-balancing loss of Switch Transformer
and Mixtral (transformers' `load_balancing_loss_func`): `n_experts * sum_e f_e P_e`, `f_e` the
share of choices that went to expert `e` (per slot of the top k) and `P_e` its mean router
probability, over every position of every layer.
"""

from collections.abc import Mapping
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jaxtyping import Array, Float, PRNGKeyArray

from ..core import Param, Pointwise, python_scalar, require_bool, require_key, require_positive
from .basic import ACTIVATIONS, check_activation
from .language import GatedFeedForward

__all__ = ["MixtureOfExperts", "balance_loss"]


def largest(probs: Array, k: int) -> tuple[Array, Array]:
    """The `k` largest of `probs (..., n)` and their indices, largest first (ties: the lower
    index), by `k` rounds of max and argmax: reductions and comparisons only. (`lax.top_k` lowers
    to a StableHLO composite that the PJRT plugins of 2026 cannot read back, so an exported step
    would not run from C.)"""
    positions = jnp.arange(probs.shape[-1]).reshape((1,) * (probs.ndim - 1) + (-1,))
    values, indices = [], []
    for _ in range(k):
        index = jnp.argmax(probs, axis=-1)
        values.append(jnp.max(probs, axis=-1))
        indices.append(index)
        probs = jnp.where(positions == index[..., None], -jnp.inf, probs)
    return jnp.stack(values, axis=-1), jnp.stack(indices, axis=-1).astype(jnp.int32)


def _normal(key: PRNGKeyArray, shape: tuple[int, ...]) -> Param:
    return Param(0.02 * jr.normal(key, shape))


class MixtureOfExperts(Pointwise):
    """`top_k` of `n_experts` gated feed-forwards per position, chosen and weighted by a router.

    **Arguments:** `d_model`, `d_ff` (each expert's hidden width), `key`, `n_experts`, `top_k`,
    `normalize_top_k=True`, `activation="silu"` (SwiGLU experts), `shared_d_ff=None` (the width
    of a shared expert, see the module). `params()` is `[router (d_model, n_experts), W_gate
    (n_experts, d_model, d_ff), W_up (same), W_down (n_experts, d_ff, d_model)]`, then with a
    shared expert its `[W_gate, W_up, W_down]` and `shared_gate (d_model, 1)`; all normal with
    std 0.02. `forward(x)` maps `(*T, d_model) -> (*T, d_model)`;
    `routed(x)` gives the output and the router's logits `(*T, n_experts)`.
    """

    router: Param
    W_gate: Param
    W_up: Param
    W_down: Param
    shared: GatedFeedForward | None
    shared_gate: Param | None
    d_model: int = eqx.field(static=True, converter=python_scalar)
    n_experts: int = eqx.field(static=True, converter=python_scalar)
    top_k: int = eqx.field(static=True, converter=python_scalar)
    normalize_top_k: bool = eqx.field(static=True, converter=python_scalar)
    activation: str = eqx.field(static=True, converter=python_scalar)
    tensor_parallel: ClassVar[Mapping[str, tuple[int, str | None]]] = {
        "W_gate": (-1, None),
        "W_up": (-1, None),
        "W_down": (-2, None),
    }

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        key: PRNGKeyArray,
        n_experts: int,
        top_k: int,
        normalize_top_k: bool = True,
        activation: str = "silu",
        shared_d_ff: int | None = None,
    ):
        require_key(key)
        require_positive(d_model=d_model, d_ff=d_ff, n_experts=n_experts, top_k=top_k)
        if shared_d_ff is not None:
            require_positive(shared_d_ff=shared_d_ff)
        require_bool(normalize_top_k=normalize_top_k)
        check_activation(activation)
        if top_k > n_experts:
            raise ValueError(
                f"`top_k` must be at most `n_experts`; received `top_k={top_k}`, "
                f"`n_experts={n_experts}`."
            )
        rkey, gkey, ukey, dkey = jr.split(key, 4)
        self.router = _normal(rkey, (d_model, n_experts))
        self.W_gate = _normal(gkey, (n_experts, d_model, d_ff))
        self.W_up = _normal(ukey, (n_experts, d_model, d_ff))
        self.W_down = _normal(dkey, (n_experts, d_ff, d_model))
        # the shared expert's keys from a separate fold: a model without one keeps its weights
        skey, wkey = jr.split(jr.fold_in(key, 1))
        self.shared = self.shared_gate = None
        if shared_d_ff is not None:
            self.shared = GatedFeedForward(d_model, shared_d_ff, skey, activation)
            self.shared_gate = _normal(wkey, (d_model, 1))
        self.d_model, self.n_experts, self.top_k = d_model, n_experts, top_k
        self.normalize_top_k, self.activation = normalize_top_k, activation

    def forward(
        self, x: Float[Array, "*T d_model"], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, "*T d_model"]:
        return self.routed(x)[0]

    def routed(self, x: Array) -> tuple[Array, Array]:
        """The output `(*T, d_model)` and the router's logits `(*T, n_experts)` (float32)."""
        lead = x.shape[:-1]
        flat = x.reshape(-1, self.d_model)
        logits = jnp.einsum(
            "td,de->te", flat, self.router.value.astype(x.dtype), preferred_element_type=jnp.float32
        )
        chosen, experts = largest(jax.nn.softmax(logits, axis=-1), self.top_k)
        if self.normalize_top_k:
            chosen = chosen / chosen.sum(axis=-1, keepdims=True)
        steps = flat.shape[0]  # symbolic in an exported prefill: dense there
        if isinstance(steps, int) and steps * self.top_k < self.n_experts:  # a few positions
            out = self._routed(flat, chosen, experts)
        else:
            out = self._dense(flat, chosen, experts)
        if self.shared is not None and self.shared_gate is not None:
            gate = jax.nn.sigmoid(self.shared_gate.project(flat))
            out = out + (gate * self.shared(flat)).astype(out.dtype)
        return out.astype(x.dtype).reshape(*lead, self.d_model), logits.reshape(*lead, -1)

    def _expert(self, x: Array, weights: list[Array], spec: tuple[str, str]) -> Array:
        """The SwiGLU of `x` through experts' matrices `[gate, up, down]` (`spec`: the einsum
        subscripts of the first two and of the last)."""
        gate, up, down = weights
        act = ACTIVATIONS[self.activation]
        h = act(jnp.einsum(spec[0], x, gate)) * jnp.einsum(spec[0], x, up)
        return jnp.einsum(spec[1], h, down)

    def _dense(self, x: Array, chosen: Array, experts: Array) -> Array:
        """Every expert on every position, combined by weights zero off the chosen experts."""
        weights = (jax.nn.one_hot(experts, self.n_experts) * chosen[..., None]).sum(axis=1)
        w = [a.array(x.dtype) for a in (self.W_gate, self.W_up, self.W_down)]
        outs = self._expert(x, w, ("td,edf->tef", "tef,efd->ted"))
        return jnp.einsum("te,ted->td", weights.astype(outs.dtype), outs)

    def _routed(self, x: Array, chosen: Array, experts: Array) -> Array:
        """Each of the `T * top_k` choices in turn (a scan), its expert's matrices sliced out
        at an index clipped into range (a slice, not a gather: XLA's CPU gather of the matrices
        copies them, 6x slower than the dense form at one position)."""
        steps, k = experts.shape
        indices = jnp.clip(experts.reshape(-1), 0, self.n_experts - 1)

        def one(carry: None, item: tuple[Array, Array]) -> tuple[None, Array]:
            expert, row = item
            w = [
                jax.tree.map(lambda w: jax.lax.dynamic_index_in_dim(w, expert, 0, False), a).array(
                    x.dtype
                )
                for a in (self.W_gate, self.W_up, self.W_down)
            ]
            return None, self._expert(row, w, ("d,df->f", "f,fd->d"))

        _, outs = jax.lax.scan(one, None, (indices, jnp.repeat(x, k, axis=0)))
        return jnp.einsum("tk,tkd->td", chosen.astype(outs.dtype), outs.reshape(steps, k, -1))


def balance_loss(router_logits: Array, n_experts: int, top_k: int) -> Array:
    """The load-balancing loss of the router logits `(..., n_experts)` of every layer and
    position (see the module's docstring)."""
    probs = jax.nn.softmax(router_logits.reshape(-1, n_experts).astype(jnp.float32), axis=-1)
    _, experts = largest(probs, top_k)
    share = jax.nn.one_hot(experts, n_experts).mean(axis=0)  # (top_k, n_experts)
    return (share * probs.mean(axis=0)[None]).sum() * n_experts
