"""Classify handwritten digits read row by row with a causal transformer encoder.

scikit-learn's bundled digits (1,797 images of 8x8 pixels, no download) are read as sequences of
8 rows of 8 pixels. A causal `transformer_encoder` learns to name the digit; because it is causal,
its cached step gives a prediction after every row, so we also report how accurate an early
decision is after 1, 2, ..., 8 rows (computed with the fixed-cache step, and checked against
forward on the prefixes).

    python examples/digits.py [--steps 1500] [--out examples/runs/digits]

Writes `best/` and `last/` checkpoints, `report.json`, `learning_curves.png`,
`early_decision.png` and `attention.png` (a heat map of the last block's attention on one test
digit) into `--out`. With an existing `last/` checkpoint of the same run it resumes
(and, if that run had finished, reuses it).

Then it compares mixers: the same encoder with GRU blocks, minGRU blocks and a mixed stack
(a minGRU block, then an attention block) in place of the attention blocks, trained alike
into `--out/compare/` (`--no-compare` skips it). Each one's test accuracy, training time,
early-decision curve, per-step latency and state bytes per stream go into the report and
`comparison.png`.
"""

import argparse
import json
import pathlib
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import matplotlib
import numpy as np
import optax
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

from dense_armor.checkpoints import ModelConfig, load_checkpoint
from dense_armor.plots import plot_attention
from dense_armor.training import evaluate, fit
from dense_armor.utility.neural import attention_maps

matplotlib.use("Agg")
import matplotlib.pyplot as plt

ROOT = pathlib.Path(__file__).resolve().parent
TARGET_ACCURACY = 0.95


# The compared models: what mixes the steps in each of the two blocks.
COMPARED = {
    "attention": "attention",
    "GRU": "gru",
    "minGRU": "mingru",
    "minGRU + attention": ["mingru", "attention"],
}


def model_config(max_len: int = 8, mixers: str | list[str] = "attention") -> ModelConfig:
    arguments = {
        "n_in": 8,
        "d_model": 64,
        "n_heads": 4,
        "d_ff": 128,
        "depth": 2,
        "n_out": 10,
        "max_len": max_len,
        "causal": True,
        "dropout": 0.1,
    }
    if mixers != "attention":
        arguments["mixers"] = mixers
    return ModelConfig("transformer_encoder", arguments)


def digits_splits(seed: int = 0) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Train / validation / test splits (70 / 10 / 20 %, stratified), images as (8 rows, 8)."""
    digits = load_digits()
    xs = (digits.images / 16.0).astype(np.float32)
    labels = digits.target.astype(np.int32)
    x_rest, x_test, y_rest, y_test = train_test_split(
        xs, labels, test_size=0.2, stratify=labels, random_state=seed
    )
    x_train, x_valid, y_train, y_valid = train_test_split(
        x_rest, y_rest, test_size=0.125, stratify=y_rest, random_state=seed
    )
    return {"train": (x_train, y_train), "valid": (x_valid, y_valid), "test": (x_test, y_test)}


def early_decisions(
    model: eqx.Module, xs: np.ndarray, labels: np.ndarray, capacity: int, gap: bool = True
) -> dict:
    """Accuracy after each row, from the fixed-cache step; and, with `gap`, its largest gap to
    forward on every prefix (one compilation per prefix length)."""
    rows = xs.shape[1]

    def tick(cache, x_t):
        y_t, cache = model.step(x_t, cache)
        return cache, y_t

    def stream(x):
        return jax.lax.scan(tick, model.init_cache(capacity, on_overflow="nan"), x)[1]

    logits = np.asarray(jax.jit(jax.vmap(stream))(jnp.asarray(xs)))  # (N, rows, n_out)
    accuracy = [float((logits[:, t].argmax(-1) == labels).mean()) for t in range(rows)]
    if not gap:
        return {"accuracy_by_rows": accuracy}
    forward = jax.jit(jax.vmap(model))
    largest = max(
        float(np.abs(logits[:, t] - np.asarray(forward(jnp.asarray(xs[:, : t + 1])))).max())
        for t in range(rows)
    )
    return {"accuracy_by_rows": accuracy, "max_gap_step_vs_forward": largest}


def plot(history: list[dict], early: dict, out: pathlib.Path) -> list[pathlib.Path]:
    steps = [r["step"] for r in history]
    fig, loss_axis = plt.subplots(figsize=(6.4, 4.0))
    loss_axis.plot(steps, [r["train_loss"] for r in history], label="training loss", color="C0")
    loss_axis.plot(steps, [r["valid_loss"] for r in history], label="validation loss", color="C1")
    loss_axis.set_xlabel("optimizer step")
    loss_axis.set_ylabel("cross-entropy")
    loss_axis.set_yscale("log")
    acc_axis = loss_axis.twinx()
    acc_axis.plot(
        steps, [r["valid_accuracy"] for r in history], color="C2", label="validation accuracy"
    )
    acc_axis.set_ylabel("accuracy")
    acc_axis.set_ylim(0, 1)
    handles = loss_axis.get_legend_handles_labels()[0] + acc_axis.get_legend_handles_labels()[0]
    loss_axis.legend(handles=handles, loc="lower left")
    loss_axis.set_title("Digits, causal transformer encoder: learning curves")
    fig.tight_layout()
    curves = out / "learning_curves.png"
    fig.savefig(curves, dpi=120)
    plt.close(fig)

    fig, axis = plt.subplots(figsize=(6.4, 4.0))
    accuracy = early["accuracy_by_rows"]
    rows = np.arange(1, len(accuracy) + 1)
    axis.plot(rows, accuracy, marker="o")
    for r, a in zip(rows, accuracy, strict=True):
        axis.annotate(f"{a:.2f}", (r, a), textcoords="offset points", xytext=(0, 7), ha="center")
    axis.set_xlabel("rows of the image seen")
    axis.set_ylabel("test accuracy")
    axis.set_ylim(0, 1.05)
    axis.set_xticks(rows)
    axis.grid(alpha=0.3)
    axis.set_title("Early decisions from the cached step")
    fig.tight_layout()
    early_path = out / "early_decision.png"
    fig.savefig(early_path, dpi=120)
    plt.close(fig)
    return [curves, early_path]


def train(config: ModelConfig, data: dict, args: argparse.Namespace, out: pathlib.Path):
    """`fit` of the model of `config` on the training split, checkpoints into `out`."""
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, 2e-3, min(100, args.steps // 10 + 1), args.steps
    )
    optimizer = optax.chain(
        optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=1e-4)
    )
    # optax's schedules mix int and float arrays; run them under standard promotion whatever
    # the caller's setting.
    with jax.numpy_dtype_promotion("standard"):
        return fit(
            config.build(jax.random.PRNGKey(args.seed)),
            optimizer,
            data["train"],
            steps=args.steps,
            batch_size=args.batch_size,
            seed=args.seed,
            valid=data["valid"],
            eval_every=args.eval_every or max(1, args.steps // 20),
            checkpoint_dir=out,
            config=config,
            progress=not args.no_progress,
        )


def training_seconds(history: list[dict], batch_size: int) -> float:
    """The time `fit` spent on optimizer steps, from its history (kept across a resume)."""
    seconds, previous = 0.0, 0
    for record in history:
        seconds += (record["step"] - previous) * batch_size / record["samples_per_s"]
        previous = record["step"]
    return seconds


def state_bytes(model: eqx.Module, capacity: int) -> dict:
    """One stream's state: its bytes at `capacity`, and the bytes one more step of capacity adds
    (0 for a state of constant size)."""

    def size(capacity: int) -> int:
        return sum(a.nbytes for a in jax.tree.leaves(model.init_cache(capacity)))

    return {
        "state_bytes": size(capacity),
        "state_bytes_per_step": size(capacity + 1) - size(capacity),
    }


def step_latencies(models: list[eqx.Module], capacity: int, rounds: int = 400) -> list[float]:
    """Each model's median seconds per jitted `step` of one stream, the models called in turn
    (A B C D A B ...) so that they share the machine's state."""
    calls = []
    for model in models:
        params, static = eqx.partition(model, eqx.is_array)
        step = jax.jit(lambda p, x, c, static=static: eqx.combine(p, static).step(x, c))
        x_t, cache = jnp.zeros(model[0].n_in), model.init_cache(capacity, on_overflow="nan")
        step(params, x_t, cache)[0].block_until_ready()  # compiles
        calls.append(lambda step=step, p=params, x=x_t, c=cache: step(p, x, c)[0])
    times: list[list[float]] = [[] for _ in models]
    for _ in range(rounds):
        for call, samples in zip(calls, times, strict=True):
            tick = time.perf_counter()
            call().block_until_ready()
            samples.append(time.perf_counter() - tick)
    return [float(np.median(samples)) for samples in times]


def compare(data: dict, args: argparse.Namespace, attention: dict) -> list[dict]:
    """Each compared model (the attention one already trained, in `attention`): test accuracy,
    training time, early decisions, per-step latency and state size."""
    rows, models = [], []
    for name, mixers in COMPARED.items():
        config = model_config(mixers=mixers)
        if mixers == "attention":
            history, model, early = attention["history"], attention["model"], attention["early"]
        else:
            out = args.out / "compare" / "-".join([mixers] if isinstance(mixers, str) else mixers)
            print(f"comparison: training the {name} model into {out}", flush=True)
            history = train(config, data, args, out).history
            model = load_checkpoint(out / "best").model
            # (step == forward is the attention model's check here; the recurrent layers' is in
            # the test suite)
            early = early_decisions(
                model, *data["test"], capacity=config.arguments["max_len"], gap=False
            )
        rows.append(
            {
                "model": name,
                "mixers": mixers,
                "parameters": sum(p.value.size for p in model.params()),
                "test_accuracy": evaluate(model, *data["test"])["accuracy"],
                "train_seconds": training_seconds(history, args.batch_size),
                "accuracy_by_rows": early["accuracy_by_rows"],
                **state_bytes(model, config.arguments["max_len"]),
            }
        )
        models.append(model)
    for row, seconds in zip(rows, step_latencies(models, 8), strict=True):
        row["step_seconds"] = seconds
    return rows


def comparison_table(rows: list[dict]) -> str:
    lines = [
        "mixers compared (same blocks, same training):",
        f"  {'model':<20}{'params':>8}{'test acc':>10}{'train s':>9}{'step us':>9}"
        f"{'state B':>9}{'+B/step':>9}   accuracy after 1..8 rows",
    ]
    for r in rows:
        lines.append(
            f"  {r['model']:<20}{r['parameters']:>8}{r['test_accuracy']:>10.4f}"
            f"{r['train_seconds']:>9.1f}{r['step_seconds'] * 1e6:>9.0f}{r['state_bytes']:>9}"
            f"{r['state_bytes_per_step']:>9}   "
            + " ".join(f"{a:.2f}" for a in r["accuracy_by_rows"])
        )
    return "\n".join(lines)


def plot_comparison(rows: list[dict], path: pathlib.Path) -> pathlib.Path:
    """The early-decision curve of each model, and each one's state bytes per stream."""
    fig, (curves, state) = plt.subplots(1, 2, figsize=(10.5, 4.0), width_ratios=[3, 2])
    for r in rows:
        accuracy = r["accuracy_by_rows"]
        label = f"{r['model']} ({r['test_accuracy']:.3f}, {r['step_seconds'] * 1e6:.0f} us/step)"
        curves.plot(range(1, len(accuracy) + 1), accuracy, marker="o", label=label)
    curves.set_xlabel("rows of the image seen")
    curves.set_ylabel("test accuracy")
    curves.set_ylim(0, 1.05)
    curves.grid(alpha=0.3)
    curves.legend(loc="lower right", fontsize=8, title="model (test accuracy, step latency)")
    curves.set_title("Early decisions from each model's cached step")
    names = [r["model"] for r in rows]
    state.barh(names, [r["state_bytes"] for r in rows], color="C7")
    for i, r in enumerate(rows):
        grows = f"+{r['state_bytes_per_step']} B/step" if r["state_bytes_per_step"] else "constant"
        state.annotate(f" {r['state_bytes']} B, {grows}", (r["state_bytes"], i), va="center")
    state.set_xscale("log")
    state.set_xlim(right=max(r["state_bytes"] for r in rows) * 30)
    state.invert_yaxis()
    state.set_xlabel("state bytes per stream after 8 steps (log)")
    state.set_title("What a stream carries")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1500, help="optimizer steps (default 1500)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument(
        "--eval-every",
        type=int,
        default=None,
        help="steps between validations and checkpoints (default: 20 in a run)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "runs" / "digits")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    parser.add_argument("--no-compare", action="store_true", help="skip the mixer comparison")
    args = parser.parse_args(argv)

    started = time.perf_counter()
    data = digits_splits(args.seed)
    config = model_config()
    result = train(config, data, args, args.out)
    best = load_checkpoint(args.out / "best").model
    test = evaluate(best, *data["test"])
    early = early_decisions(best, *data["test"], capacity=config.arguments["max_len"])
    plots = plot(result.history, early, args.out)
    first_test_digit = jnp.asarray(data["test"][0][0])
    maps = attention_maps(best, first_test_digit)
    plots.append(
        plot_attention(
            maps[-1],
            args.out / "attention.png",
            title=f"Last block, head 0, on a test digit ({int(data['test'][1][0])})",
            query_labels=[f"row {r + 1}" for r in range(8)],
            key_labels=[str(r + 1) for r in range(8)],
        )
    )
    comparison = []
    if not args.no_compare:
        attention = {"history": result.history, "model": best, "early": early}
        comparison = compare(data, args, attention)
        plots.append(plot_comparison(comparison, args.out / "comparison.png"))
    seconds = time.perf_counter() - started
    report = {
        "test_accuracy": test["accuracy"],
        "test_loss": test["loss"],
        "best_valid_accuracy": result.best["valid_accuracy"] if result.best else None,
        "steps": args.steps,
        "wall_seconds": seconds,
        "accuracy_by_rows": early["accuracy_by_rows"],
        "max_gap_step_vs_forward": early["max_gap_step_vs_forward"],
        "checkpoint": str(args.out / "best"),
        "plots": [str(p) for p in plots],
        "split_sizes": {k: len(v[1]) for k, v in data.items()},
        "comparison": comparison,
    }
    (args.out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(
        f"test accuracy {test['accuracy']:.4f} on {len(data['test'][1])} held-out digits "
        f"({'meets' if test['accuracy'] >= TARGET_ACCURACY else 'BELOW'} the 0.95 target), "
        f"{seconds:.0f} s in all"
    )
    print(
        "accuracy after each row (fixed-cache step): "
        + " ".join(f"{r + 1}:{a:.3f}" for r, a in enumerate(early["accuracy_by_rows"]))
    )
    print(f"max |step - forward| over all prefixes: {early['max_gap_step_vs_forward']:.2e}")
    if comparison:
        print(comparison_table(comparison))
    print(f"plots: {', '.join(str(p) for p in plots)}")
    return report


if __name__ == "__main__":
    main()
