"""Training losses: the `Loss` protocol (a loss's value, the checks of its labels, the metrics it
reports, whether it is a mean over samples) and the library's two, `cross_entropy_loss` and
`next_token_loss`; with the host-side checks of labels and token ids they share with `fit` and
`evaluate`."""

import contextlib
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

from ..nn.core import require_bool
from ..nn.layers.language import ids_checked

__all__ = [
    "CrossEntropy",
    "Loss",
    "LossFn",
    "NextToken",
    "as_loss",
    "check_classification_data",
    "check_ids",
    "check_labels",
    "cross_entropy_loss",
    "next_token_loss",
    "next_token_loss_balanced",
    "output_width",
]

LossFn = Callable[[Any, jax.Array, jax.Array, jax.Array | None], jax.Array]


class Loss:
    """A training loss and what `fit` and `evaluate` ask of it besides its value: the checks of
    its labels, and the metrics it reports. `Loss(function)` wraps any
    `function(model, xs, labels, key) -> mean loss` (a loss of other targets: no label checks,
    the loss alone as metric); `cross_entropy_loss` is the classification loss, which knows its
    labels are class indices and reports the accuracy. `as_loss` makes a `Loss` of either.

    `averages_samples=True` declares the loss a mean over the batch's samples (equal weights),
    so that the mean of its values on equal parts of a batch is its value on the whole batch:
    `make_train_step` may then run a large batch in micro-batches. The library's losses are;
    a `Loss(function)` is not unless it says so."""

    def __init__(self, function: LossFn, averages_samples: bool = False):
        require_bool(averages_samples=averages_samples)
        self.function = function
        self.averages_samples = averages_samples

    # Equal for the same function, so that a jitted evaluation compiles once per loss.
    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, Loss)
            and type(other) is type(self)
            and other.function == self.function
            and other.averages_samples == self.averages_samples
        )

    def __hash__(self) -> int:
        return hash((type(self), self.function, self.averages_samples))

    def __call__(
        self, model: Any, xs: jax.Array, labels: jax.Array, key: jax.Array | None = None
    ) -> jax.Array:
        return self.function(model, xs, labels, key)

    def check_data(self, caller: str, model: Any, xs: Any, labels: Any) -> None:
        """Refuse a whole data set the loss cannot take: here, none or one whose inputs and
        labels differ in number."""
        if len(xs) == 0 or len(xs) != len(labels):
            raise ValueError(f"{caller}: {len(xs)} inputs and {len(labels)} labels.")

    def batch_checker(self, model: Any, xs: Any) -> Callable[..., None] | None:
        """A check of each batch as a data source gives it,
        `check(caller, xs, labels, rows, where)`, or `None` (none here)."""
        return None

    def checked_inputs(self) -> contextlib.AbstractContextManager[None]:
        """The context `fit` and `evaluate` trace this loss in, on data that `check_data` or
        the batch checker passed: here none, for inputs it does not check."""
        return contextlib.nullcontext()

    def correct(self, model: Any, xs: jax.Array, labels: jax.Array) -> jax.Array | None:
        """The batch's correct predictions, for an accuracy, or `None` (none here)."""
        return None


class CrossEntropy(Loss):
    """Mean softmax cross-entropy of `model` on a batch `xs (B, T, n_in)` with integer `labels`
    in `[0, n_out)`: checked as such (a label outside would train silently, optax taking -1 as the
    last class), and the accuracy reported beside the loss. With a `key`, each sample gets its
    own dropout key."""

    def __init__(self) -> None:
        super().__init__(self._cross_entropy, averages_samples=True)

    @staticmethod
    def _cross_entropy(
        model: Any, xs: jax.Array, labels: jax.Array, key: jax.Array | None = None
    ) -> jax.Array:
        if key is None:
            logits = jax.vmap(model)(xs)
        else:
            keys = jax.random.split(key, xs.shape[0])
            logits = jax.vmap(lambda x, k: model(x, key=k))(xs, keys)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    def check_data(self, caller: str, model: Any, xs: Any, labels: Any) -> None:
        check_classification_data(caller, model, xs, labels)

    def batch_checker(self, model: Any, xs: Any) -> Callable[..., None]:
        n_out = output_width(model, xs)  # traced once, for every later batch

        def check(caller: str, xs: Any, labels: Any, rows: int, where: str) -> None:
            check_labels(caller, labels, n_out, rows, where)

        return check

    def correct(self, model: Any, xs: jax.Array, labels: jax.Array) -> jax.Array:
        return (jax.vmap(model)(xs).argmax(axis=-1) == labels).sum()


cross_entropy_loss = CrossEntropy()


class NextToken(CrossEntropy):
    """A language model's loss: the mean softmax cross-entropy of `CrossEntropy`, of `model`'s
    logits on token ids `xs (B, T)` against `labels (B, T)`, the token that follows each position
    (for a text `tokens (B, T + 1)`: `xs = tokens[:, :-1]`, `labels = tokens[:, 1:]`). Both are
    checked as integer ids of the model's vocabulary (an id outside would train silently), data
    sets and every batch a source gives alike; the accuracy is that of the next token over all
    positions.
    """

    def check_data(self, caller: str, model: Any, xs: Any, labels: Any) -> None:
        xs, labels = np.asarray(xs), np.asarray(labels)
        if xs.ndim != 2 or xs.size == 0 or labels.shape != xs.shape:
            raise ValueError(
                f"{caller}: next-token data are token ids `xs (B, T)` and the ids that follow "
                f"them, `labels` of the same shape; received shapes {xs.shape} and "
                f"{labels.shape}."
            )
        for name, ids in (("xs", xs), ("labels", labels)):
            check_ids(caller, name, ids, None)  # integers, before the model sees them
        vocab = output_width(model, xs)
        for name, ids in (("xs", xs), ("labels", labels)):
            check_ids(caller, name, ids, vocab)

    def batch_checker(self, model: Any, xs: Any) -> Callable[..., None]:
        vocab = output_width(model, xs)

        def check(caller: str, xs: Any, labels: Any, rows: int, where: str) -> None:
            for name, ids in (("xs", np.asarray(xs)), ("labels", np.asarray(labels))):
                check_ids(caller, name, ids, vocab, where)

        return check

    def checked_inputs(self) -> contextlib.AbstractContextManager[None]:
        """`ids_checked()`: every id was checked before the model sees it (`check_data`, or the
        batch checker for each batch of a source), so the traced embedding needs no check of
        its own; that check is a callback to Python, which JAX's persistent compilation cache
        never keeps, and without it the training step compiles once per machine, not once per
        process."""
        return ids_checked()

    def correct(self, model: Any, xs: jax.Array, labels: jax.Array) -> jax.Array:
        """The correct next tokens, as a fraction of each sequence's positions (so that the
        accuracy over samples is the accuracy over tokens)."""
        hits = jax.vmap(model)(xs).argmax(axis=-1) == labels
        return hits.mean(axis=-1).sum()


next_token_loss = NextToken()


class NextTokenBalanced(NextToken):
    """`NextToken`'s loss plus `coefficient` times the load-balancing loss of a mixture-of-experts
    language model's routers (`experts.balance_loss` over every layer and position of the batch;
    Mixtral's `router_aux_loss_coef` is 0.02). For a model whose feed-forwards are
    `MixtureOfExperts`; the accuracy is `NextToken`'s."""

    def __init__(self, coefficient: float = 0.02) -> None:
        real = isinstance(coefficient, int | float) and not isinstance(coefficient, bool)
        if not real or not np.isfinite(coefficient) or coefficient < 0:
            raise ValueError(
                f"`coefficient` must be a finite number >= 0; received {coefficient!r}."
            )
        self.coefficient = float(coefficient)
        Loss.__init__(self, self._balanced, averages_samples=True)

    def __hash__(self) -> int:
        return hash((type(self), self.coefficient))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, NextTokenBalanced) and other.coefficient == self.coefficient

    def _balanced(
        self, model: Any, xs: jax.Array, labels: jax.Array, key: jax.Array | None = None
    ) -> jax.Array:
        from ..nn.layers.experts import balance_loss

        logits, routers = jax.vmap(model.forward_routed)(xs)
        cross_entropy = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
        ffn = model.blocks[0] if isinstance(model.blocks, tuple) else model.blocks.stacked
        experts = ffn.feed_forward
        return cross_entropy + self.coefficient * balance_loss(
            routers, experts.n_experts, experts.top_k
        )


def next_token_loss_balanced(coefficient: float = 0.02) -> NextTokenBalanced:
    """The next-token loss of a mixture-of-experts model with its load-balancing term."""
    return NextTokenBalanced(coefficient)


def check_ids(caller: str, name: str, ids: np.ndarray, vocab: int | None, where: str = "") -> None:
    """Raise `ValueError` unless `ids` are integers in `[0, vocab)` (any, for `vocab=None`),
    naming `name`."""
    if not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(
            f"{caller}: `{name}` must be integer token ids; received dtype {ids.dtype}{where}."
        )
    if vocab is not None and ids.size and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise ValueError(
            f"{caller}: `{name}` must lie in [0, {vocab}), the model's vocabulary; received ids "
            f"from {int(ids.min())} to {int(ids.max())}{where}."
        )


def as_loss(loss_fn: LossFn | Loss) -> Loss:
    """`loss_fn` as a `Loss`: itself if it is one, else wrapped (no label checks, no accuracy)."""
    if isinstance(loss_fn, Loss):
        return loss_fn
    if not callable(loss_fn):
        raise TypeError(
            "`loss_fn` must be a Loss or a function `(model, xs, labels, key) -> mean loss`; "
            f"received {type(loss_fn).__name__}."
        )
    return Loss(loss_fn)


def check_classification_data(caller: str, model: Any, xs: Any, labels: Any) -> None:
    """Raise `ValueError` unless `labels` are `len(xs)` integers in `[0, n_out)`, where `n_out`
    is the width of `model`'s output (a label outside would train silently: optax takes -1 as the
    last class)."""
    if len(xs) == 0:
        raise ValueError(f"{caller}: received an empty data set.")
    if len(xs) != len(labels):
        raise ValueError(f"{caller}: {len(xs)} inputs but {len(labels)} labels.")
    check_labels(caller, labels, output_width(model, xs), len(xs))


def output_width(model: Any, xs: Any) -> int:
    """The width of `model`'s output on one sample of `xs` (traced once, never run)."""
    return int(eqx.filter_eval_shape(model, jnp.asarray(xs[0])).shape[-1])


def check_labels(caller: str, labels: Any, n_out: int, n: int, where: str = "") -> None:
    """Raise `ValueError` unless `labels` are `n` integers (shape `(n,)`) in `[0, n_out)`;
    `where` (e.g. " at step 3") ends the message. A host-side pass over the labels alone."""
    labels = np.asarray(labels)
    if labels.ndim != 1:
        raise ValueError(
            f"{caller}: `labels` must have shape (N,), one class index per input; received shape "
            f"{labels.shape}{where}."
            + (" Flatten them: `labels.reshape(-1)`." if labels.size == n else "")
        )
    if not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(
            f"{caller}: `labels` must be integers; received dtype {labels.dtype}{where}."
        )
    if labels.size == 0:
        return
    low, high = int(labels.min()), int(labels.max())
    if low < 0 or high >= n_out:
        raise ValueError(
            f"{caller}: `labels` must lie in [0, {n_out}) for a model of {n_out} outputs; "
            f"received labels from {low} to {high}{where}."
        )
