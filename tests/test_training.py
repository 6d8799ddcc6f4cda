import sys

import equinox as eqx
import jax
import numpy as np
import optax
import pytest

from dense_armor.checkpoints import ModelConfig, load_checkpoint, tree_arrays
from dense_armor.training import Loss, cross_entropy_loss, evaluate, fit, make_train_step

pytestmark = pytest.mark.optax

CONFIG = ModelConfig(
    "transformer_encoder",
    {
        "n_in": 3,
        "d_model": 16,
        "n_heads": 2,
        "d_ff": 32,
        "depth": 1,
        "n_out": 2,
        "max_len": 8,
        "causal": True,
        "dropout": 0.1,
    },
)


def toy_data(n=96, seed=0):
    rng = np.random.default_rng(seed)
    xs = rng.normal(size=(n, 6, 3)).astype(np.float32)
    labels = (xs[:, :, 0].sum(axis=1) > 0).astype(np.int32)
    return xs, labels


def test_train_step_decreases_the_loss():
    xs, labels = toy_data(32)
    model = CONFIG.build(jax.random.PRNGKey(0))
    optimizer = optax.adam(3e-3)
    opt_state = optimizer.init(eqx.filter(model, eqx.is_inexact_array))
    step = make_train_step(optimizer)
    before = float(cross_entropy_loss(model, xs, labels))
    for i in range(30):
        model, opt_state, _ = step(model, opt_state, xs, labels, jax.random.PRNGKey(i))
    assert float(cross_entropy_loss(model, xs, labels)) < 0.7 * before


def test_evaluate_counts_accuracy_over_batches():
    xs, labels = toy_data(50)
    model = CONFIG.build(jax.random.PRNGKey(0))
    predictions = np.asarray(jax.vmap(model)(xs)).argmax(-1)
    metrics = evaluate(model, xs, labels, batch_size=16)
    assert metrics["accuracy"] == pytest.approx(float((predictions == labels).mean()))
    assert metrics["loss"] == pytest.approx(float(cross_entropy_loss(model, xs, labels)), rel=1e-5)
    with pytest.raises(ValueError, match="empty"):
        evaluate(model, xs[:0], labels[:0])


def test_fit_resumes_exactly_as_an_uninterrupted_run(tmp_path):
    train, valid = toy_data(96, 0), toy_data(32, 1)
    options = dict(steps=12, batch_size=16, seed=5, valid=valid, eval_every=4, progress=False)
    whole = fit(CONFIG.build(jax.random.PRNGKey(0)), optax.adam(1e-3), train, **options)

    first = fit(
        CONFIG.build(jax.random.PRNGKey(0)),
        optax.adam(1e-3),
        train,
        **{**options, "steps": 8},
        checkpoint_dir=tmp_path,
        config=CONFIG,
    )
    assert len(first.history) == 2
    resumed = fit(
        CONFIG.build(jax.random.PRNGKey(99)),
        optax.adam(1e-3),
        train,
        **options,
        checkpoint_dir=tmp_path,
        config=CONFIG,
    )
    assert [r["train_loss"] for r in resumed.history] == [r["train_loss"] for r in whole.history]
    assert [r["valid_loss"] for r in resumed.history] == [r["valid_loss"] for r in whole.history]
    a, b = tree_arrays(resumed.model), tree_arrays(whole.model)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    best = load_checkpoint(tmp_path / "best")
    assert best.state["record"]["valid_accuracy"] == max(r["valid_accuracy"] for r in whole.history)


def test_fit_rejects_bad_arguments():
    xs, labels = toy_data(16)
    model = CONFIG.build(jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match="batch_size"):
        fit(model, optax.adam(1e-3), (xs, labels), steps=1, batch_size=32, progress=False)
    with pytest.raises(ValueError, match="labels"):
        fit(model, optax.adam(1e-3), (xs, labels[:3]), steps=1, progress=False)
    with pytest.raises(ValueError, match="config"):
        fit(model, optax.adam(1e-3), (xs, labels), steps=1, batch_size=8, checkpoint_dir="x")


def test_fit_stops_on_a_non_finite_loss():
    xs, labels = toy_data(16)
    xs[0, 0, 0] = np.nan
    with pytest.raises(FloatingPointError, match="step 1"):  # checked every step
        fit(
            CONFIG.build(jax.random.PRNGKey(0)),
            optax.sgd(0.1),
            (xs, labels),
            steps=4,
            batch_size=16,
            eval_every=2,
            progress=False,
        )


def mean_squared_error(model, xs, targets, key=None):
    """A regression loss: the model's 2 outputs against float targets."""
    return ((jax.vmap(model)(xs) - targets) ** 2).mean()


def test_fit_validates_with_its_own_loss():
    xs, _ = toy_data(48)
    targets = np.stack([xs[:, :, 0].mean(axis=1), xs[:, :, 1].mean(axis=1)], axis=1)
    result = fit(
        CONFIG.build(jax.random.PRNGKey(0)),
        optax.adam(3e-3),
        (xs[:32], targets[:32]),
        steps=4,
        batch_size=16,
        eval_every=2,
        valid=(xs[32:], targets[32:]),
        loss_fn=mean_squared_error,
        progress=False,
    )
    last = result.history[-1]
    assert "valid_accuracy" not in last
    by_hand = float(np.mean((np.asarray(jax.vmap(result.model)(xs[32:])) - targets[32:]) ** 2))
    np.testing.assert_allclose(last["valid_loss"], by_hand, rtol=1e-5)
    metrics = evaluate(
        result.model, xs[32:], targets[32:], batch_size=5, loss_fn=mean_squared_error
    )
    np.testing.assert_allclose(metrics["loss"], by_hand, rtol=1e-5)
    best = min(result.history, key=lambda r: r["valid_loss"])
    assert result.best["step"] == best["step"]  # the best run is the lowest validation loss


def test_accumulated_micro_batches_train_like_the_whole_batch():
    """`accumulate=4`: four micro-batches of 8, their gradients summed then averaged, give the
    update of one batch of 32 (no dropout: its masks are drawn per micro-batch)."""
    xs, labels = toy_data(96)
    config = ModelConfig(CONFIG.factory, {**CONFIG.arguments, "dropout": 0.0})
    runs = {
        k: fit(
            config.build(jax.random.PRNGKey(0)),
            optax.adam(3e-3),
            (xs, labels),
            steps=12,
            batch_size=32,
            eval_every=4,
            progress=False,
            accumulate=k,
        )
        for k in (1, 4)
    }
    losses = {k: [r["train_loss"] for r in run.history] for k, run in runs.items()}
    np.testing.assert_allclose(losses[4], losses[1], rtol=1e-5)
    assert losses[1][-1] < losses[1][0]
    for path, a in tree_arrays(runs[1].model).items():
        np.testing.assert_allclose(tree_arrays(runs[4].model)[path], a, atol=1e-5, err_msg=path)
    with pytest.raises(ValueError, match=r"`accumulate=3` micro-batches must divide"):
        fit(config.build(jax.random.PRNGKey(0)), optax.adam(1e-3), (xs, labels), steps=1,
            batch_size=32, accumulate=3, progress=False)  # fmt: skip
    with pytest.raises(TypeError, match=r"`accumulate` must be a positive integer"):
        make_train_step(optax.adam(1e-3), accumulate="2")


@pytest.fixture
def tiny_budget(monkeypatch):
    """`make_train_step`'s CPU budget for a step's temporaries lowered to 64 KiB, so that the
    small models of these tests take the path of a large step."""
    from dense_armor.training import step as train_step

    monkeypatch.setattr(train_step, "CPU_STEP_BYTES", 64 * 2**10)


def _whole_batch_gradient(model, xs, labels):
    """The gradient of the mean cross-entropy over the whole batch, by `jax.grad` directly (no
    dense_armor training code)."""

    def loss(m):
        logits = jax.vmap(m)(xs)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    return eqx.filter_grad(loss)(model)


def test_a_large_step_on_the_cpu_runs_in_micro_batches_with_the_whole_batch_gradient(
    tiny_budget,
):
    """Past the budget, the default step cuts the batch of 24 into equal micro-batches (a
    divisor of 24) and its update is the whole batch's: with SGD at rate 1 the update is minus
    the gradient, compared with `jax.grad` of the mean loss over all 24."""
    xs, labels = toy_data(24)
    config = ModelConfig(CONFIG.factory, {**CONFIG.arguments, "dropout": 0.0})
    model = config.build(jax.random.PRNGKey(0))
    optimizer = optax.sgd(1.0)
    opt_state = optimizer.init(eqx.filter(model, eqx.is_inexact_array))
    step = make_train_step(optimizer)
    k = step.micro_batches(model, opt_state, xs, labels)
    assert k > 1 and 24 % k == 0
    new, _, loss = step(model, opt_state, xs, labels, None)
    expected = _whole_batch_gradient(model, xs, labels)
    np.testing.assert_allclose(float(loss), float(cross_entropy_loss(model, xs, labels)), rtol=1e-6)
    for path, before in tree_arrays(model).items():
        grad = tree_arrays(expected)[path]
        np.testing.assert_allclose(before - tree_arrays(new)[path], grad, atol=2e-6, err_msg=path)
    # the whole batch under the default budget: one step of 24
    from dense_armor.training import step as train_step

    assert train_step.CPU_STEP_BYTES == 64 * 2**10
    whole = make_train_step(optimizer, accumulate=1)(model, opt_state, xs, labels, None)
    np.testing.assert_allclose(float(whole[2]), float(loss), rtol=1e-6)


def test_a_small_step_and_a_loss_of_unknown_form_run_whole(tiny_budget, monkeypatch):
    """The whole batch where the step fits the budget, where the loss does not say it is a mean
    over samples (a `Loss(function)` may weigh its samples unequally), for one sample, and
    inside another trace; a loss that says so is cut."""
    from dense_armor.training import step as train_step

    xs, labels = toy_data(24)
    model = CONFIG.build(jax.random.PRNGKey(0))
    optimizer = optax.sgd(0.1)
    opt_state = optimizer.init(eqx.filter(model, eqx.is_inexact_array))
    args = (model, opt_state, xs, labels)
    assert make_train_step(optimizer).micro_batches(*args) > 1

    def mean_loss(m, xs, labels, key):
        return cross_entropy_loss(m, xs, labels, key)

    assert make_train_step(optimizer, mean_loss).micro_batches(*args) == 1
    declared = Loss(mean_loss, averages_samples=True)
    assert make_train_step(optimizer, declared).micro_batches(*args) > 1
    assert make_train_step(optimizer).micro_batches(model, opt_state, xs[:1], labels[:1]) == 1
    monkeypatch.setattr(train_step, "CPU_STEP_BYTES", 2**30)
    assert make_train_step(optimizer).micro_batches(*args) == 1
    monkeypatch.setattr(train_step, "CPU_STEP_BYTES", 64 * 2**10)
    step = make_train_step(optimizer)

    @eqx.filter_jit
    def inside(model, opt_state, xs, labels):  # traced arrays: the whole batch, no compile
        return step(model, opt_state, xs, labels, None)[2]

    np.testing.assert_allclose(
        float(inside(*args)), float(cross_entropy_loss(model, xs, labels)), rtol=1e-6
    )
    with pytest.raises(ValueError, match=r"`averages_samples` must be True or False"):
        Loss(mean_loss, averages_samples="yes")


def test_a_batch_size_with_no_fitting_divisor_runs_one_sample_at_a_time(monkeypatch):
    """A prime batch of 7 whose step exceeds the budget (one byte) however it is cut: 7
    micro-batches of one, and still the mean loss of the 7."""
    from dense_armor.training import step as train_step

    monkeypatch.setattr(train_step, "CPU_STEP_BYTES", 1)
    xs, labels = toy_data(7)
    model = CONFIG.build(jax.random.PRNGKey(0))
    optimizer = optax.sgd(0.1)
    opt_state = optimizer.init(eqx.filter(model, eqx.is_inexact_array))
    step = make_train_step(optimizer)
    assert step.micro_batches(model, opt_state, xs, labels) == 7
    _, _, loss = step(model, opt_state, xs, labels, None)
    np.testing.assert_allclose(float(loss), float(cross_entropy_loss(model, xs, labels)), rtol=1e-6)


def test_the_progress_bar_shows_on_a_terminal_only(capsys, monkeypatch):
    """`progress=True` (the default) draws the bar on a terminal and keeps a log or a pipe clean
    (pytest's capture is no terminal); `progress=False` never draws it."""
    xs, labels = toy_data(16)
    model = CONFIG.build(jax.random.PRNGKey(0))
    fit(model, optax.adam(1e-3), (xs, labels), steps=2, batch_size=8)
    assert "2/2" not in capsys.readouterr().err
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    fit(model, optax.adam(1e-3), (xs, labels), steps=2, batch_size=8)
    assert "2/2" in capsys.readouterr().err
    fit(model, optax.adam(1e-3), (xs, labels), steps=2, batch_size=8, progress=False)
    assert "2/2" not in capsys.readouterr().err
