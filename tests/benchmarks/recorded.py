"""The figures the Performance page's (docs/performance.md) encoder and streaming table is
generated from, and the regression guard that prints them beside a new run's.

`nox -s bench -- encoder streaming` prints, after the benchmarks' own tables, every recorded
figure of this run beside the one in `recorded.json` (the run the page's table came from) and
their ratio; `nox -s bench -- encoder streaming --record` writes this run's figures to
`recorded.json` and regenerates the page's table from them, dated and with the machine. The table
lives between the page's two `bench table` markers; `tests/test_benchmark_table.py` checks that
it is what `recorded.json` generates.

Figures are seconds, named "<benchmark>/<system>" (see `harness.record`).
"""

import json
import pathlib
from typing import Any

RECORDED = pathlib.Path(__file__).with_name("recorded.json")
PAGE = pathlib.Path(__file__).resolve().parents[2] / "docs" / "performance.md"
BEGIN = "<!-- bench table: `nox -s bench -- encoder streaming --record` writes it -->"
END = "<!-- /bench table -->"

# (row label, figure prefix, unit): the rows that compare dense_armor with its peers.
PEER_ROWS = [
    (
        "encoder training step, B=32 T=128 d_model=128 depth 2 (adam, jit)",
        "encoder training step",
    ),
    ("encoder forward, same shapes", "encoder forward"),
]
# The row of dense_armor's model in the peers' one-batch training step (no micro-batches).
ONE_BATCH = "the same step in one batch, as the peers' (`make_train_step(accumulate=1)`)"


def load(path: pathlib.Path = RECORDED) -> dict[str, Any]:
    """`{"date", "machine", "figures"}` as `--record` wrote them."""
    try:
        recorded = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: not JSON ({error}); write it again with --record.") from None
    if not isinstance(recorded, dict) or not isinstance(recorded.get("figures"), dict):
        raise ValueError(f"{path}: expected an object with `date`, `machine` and `figures`.")
    return recorded


def compare(figures: dict[str, float], recorded: dict[str, Any]) -> str:
    """Each figure of this run beside the recorded one: the regression guard's table."""
    old = recorded["figures"]
    lines = [
        f"\nAgainst the Performance page's figures ({recorded['date']}, {recorded['machine']})",
        f"{'figure':<52}{'recorded':>12}{'this run':>12}   this / recorded",
    ]
    for name in sorted(set(old) | set(figures)):
        before, now = old.get(name), figures.get(name)
        cells = ["-" if t is None else _ms(t) for t in (before, now)]
        ratio = f"{now / before:.2f}x" if before and now else "-"
        lines.append(f"{name:<52}{cells[0]:>12}{cells[1]:>12}   {ratio}")
    return "\n".join(lines)


def _ms(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} us"
    return f"{seconds * 1e3:.2f} ms" if seconds < 0.01 else f"{seconds * 1e3:.1f} ms"


def table(recorded: dict[str, Any]) -> str:
    """The Performance page's table (markdown) from recorded figures; below 1.00x is faster than
    dense_armor."""
    f = recorded["figures"]
    rows = [
        f"Measured by `nox -s bench -- encoder streaming` on {recorded['date']}, "
        f"{recorded['machine']} (in brackets: a peer's time over dense_armor's, above 1.00x where "
        "dense_armor is faster; dense_armor's training step is `make_train_step`'s, which ran the "
        "batch in micro-batches here, see above):",
        "",
        "| benchmark | dense_armor | Equinox | Flax NNX | other |",
        "| --- | --- | --- | --- | --- |",
    ]
    for label, prefix in PEER_ROWS:
        for system, row in (("dense_armor", label), ("dense_armor, one batch", ONE_BATCH)):
            if f"{prefix}/{system}" not in f:
                continue
            ours = f[f"{prefix}/{system}"]
            peers = [f[f"{prefix}/{peer}"] for peer in ("equinox", "flax nnx")]
            cells = [f"{_ms(p)} ({p / ours:.2f}x)" for p in peers]
            rows.append(f"| {row} | {_ms(ours)} | {cells[0]} | {cells[1]} | |")
    step = f["streaming step/dense_armor step"]
    flax = f["streaming step/flax nnx decode"]
    recompute = f["streaming step/recompute"]
    stream = f["streaming step/dense_armor stream"]
    rows.append(
        "| causal attention step, d_model=128, 8 heads, capacity 512: `Stream` (raises when full, "
        f"on the host) | {_ms(stream)} | | {_ms(flax)} ({flax / stream:.2f}x, decode cache) | "
        f"recompute over the prefix: {_ms(recompute)} ({recompute / stream:.0f}x) |"
    )
    rows.append(
        '| the layer\'s `step` under `jax.jit`, default cache (`on_overflow="raise"`: a callback '
        f"in the step) | {_ms(step)} | | {_ms(flax)} ({flax / step:.2f}x) | |"
    )
    nan = f.get("streaming step/dense_armor step, nan")
    if nan is not None:
        rows.append(
            '| the same step, `on_overflow="nan"` (no callback: the exported step\'s mode) | '
            f"{_ms(nan)} | | {_ms(flax)} ({flax / nan:.2f}x) | |"
        )
    forward = f["exported/exported forward"] / f["exported/python forward (jit)"]
    stepped = f["exported/exported step"] / f["exported/python step (jit)"]
    rows.append(
        "| exported forward / step vs the jitted Python model | | | | "
        f"{forward:.2f}x / {stepped:.2f}x |"
    )
    return "\n".join(rows)


def readme_block(text: str) -> str:
    """The table between the Performance page's markers."""
    if BEGIN not in text or END not in text:
        raise ValueError(f"{PAGE}: the markers {BEGIN!r} and {END!r} are missing.")
    return text.split(BEGIN, 1)[1].split(END, 1)[0].strip("\n")


def write(figures: dict[str, float], date: str, machine: str) -> None:
    """Write this run's figures to `recorded.json` and regenerate the Performance page's table."""
    missing = [
        name
        for name in (
            *(f"{p}/{s}" for _, p in PEER_ROWS for s in ("dense_armor", "equinox", "flax nnx")),
            "streaming step/dense_armor step",
            "streaming step/dense_armor stream",
        )
        if name not in figures
    ]
    if missing:
        raise SystemExit(
            f"--record needs the encoder and streaming benchmarks; this run lacks {missing}."
        )
    recorded = {"date": date, "machine": machine, "figures": dict(sorted(figures.items()))}
    text = PAGE.read_text()
    readme_block(text)  # the markers are there
    before, rest = text.split(BEGIN, 1)
    after = rest.split(END, 1)[1]
    RECORDED.write_text(json.dumps(recorded, indent=2) + "\n")
    PAGE.write_text(f"{before}{BEGIN}\n{table(recorded)}\n{END}{after}")
