"""The shell of a causal mixer `(T, d_model) -> (T, d_model)` whose cache is a state of one size
however long the stream (LFM2's `ShortConv`, Qwen3.5's `GatedDeltaNet`): `forward` from the
state before the first step, `prefill` from a given state, each through the mixer's one
computation of a run of steps."""

from typing import Any, ClassVar

from jaxtyping import Array, Bool, Float, PRNGKeyArray

from ..core import Layer, shape_checked

__all__ = ["StatefulMixer"]


class StatefulMixer(Layer):
    """A subclass gives `init_cache()` (the state before the first step), `_run(x, state, mask)
    -> (y, state after the valid steps)` and `_check(state, method)` (a `ShapeError` for a
    state that is not its own); `step` is `Layer`'s, a prefill of one step."""

    d_model: int
    causal: ClassVar[bool] = True
    accepts_mask: ClassVar[bool] = True

    def _run(self, x: Array, state: Any, mask: Array | None) -> tuple[Array, Any]:
        raise NotImplementedError

    def _check(self, state: object, method: str) -> None:
        raise NotImplementedError

    @shape_checked
    def forward(
        self,
        x: Float[Array, "T d_model"],
        *,
        mask: Bool[Array, " T"] | None = None,
        key: PRNGKeyArray | None = None,
    ) -> Float[Array, "T d_model"]:
        """Every step's output from the state before the first step (a padded step, where
        `mask` is false, changes no valid one)."""
        return self._run(x, self.init_cache(), mask)[0]

    @shape_checked
    def prefill(
        self,
        x: Float[Array, "K d_model"],
        cache: Any,
        *,
        mask: Bool[Array, " K"] | None = None,
    ) -> tuple[Float[Array, "K d_model"], Any]:
        """`K` steps from the state `cache`: what `K` calls of `step` return, stacked; the
        state after the valid steps of `mask` (a prefix)."""
        self._check(cache, "prefill")
        return self._run(x, cache, mask)
