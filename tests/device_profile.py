"""Where a serving run's time goes: the device lane's `serve --profile DIR` runs each measured
load under `jax.profiler.trace` (no Python tracer: it would slow the host loop it measures) and
sums the trace's events with JAX's own reader (`jax.profiler.ProfileData`): for every plane (a
device's, the host's) and every line of it (a TPU's "XLA Modules", "XLA Ops", ...), each event
name's count and total milliseconds, the largest first, and the line's busy time (the union of
its events) against the run's wall time: a chip busy for a fraction of the wall time waits on the
host."""

import contextlib
import json
import pathlib
from collections.abc import Iterator
from typing import Any

TOP = 15


@contextlib.contextmanager
def traced(directory: pathlib.Path) -> Iterator[None]:
    """`jax.profiler.trace` into `directory`, without the Python tracer."""
    import jax

    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0
    options.host_tracer_level = 1
    with jax.profiler.trace(str(directory), profiler_options=options):
        yield


def _busy_ns(spans: list[tuple[float, float]]) -> float:
    """The length of the union of `(start, end)` spans."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def _line(line: Any) -> dict[str, Any]:
    names: dict[str, list[float]] = {}
    spans = []
    for event in line.events:
        start, length = float(event.start_ns), float(event.duration_ns)
        spans.append((start, start + length))
        entry = names.setdefault(event.name, [0, 0.0])
        entry[0] += 1
        entry[1] += length
    top = sorted(names.items(), key=lambda item: -item[1][1])[:TOP]
    return {
        "events": len(spans),
        "busy_ms": round(_busy_ns(spans) / 1e6, 3),
        "top": [{"name": n, "count": c, "total_ms": round(t / 1e6, 3)} for n, (c, t) in top],
    }


def summarize(directory: pathlib.Path, wall_s: float) -> dict[str, Any]:
    """The trace written under `directory` (its last `.xplane.pb`) summed by plane and line."""
    from jax.profiler import ProfileData

    found = sorted(directory.rglob("*.xplane.pb"), key=lambda p: p.stat().st_mtime)
    if not found:
        return {"wall_ms": round(wall_s * 1e3, 3), "planes": {}, "note": "no trace written"}
    data = ProfileData.from_file(str(found[-1]))
    planes = {}
    for plane in data.planes:
        lines = {line.name: _line(line) for line in plane.lines}
        lines = {name: line for name, line in lines.items() if line["events"]}
        if lines:
            planes[plane.name] = lines
    return {"wall_ms": round(wall_s * 1e3, 3), "planes": planes}


def brief(summary: dict[str, Any]) -> str:
    """The device planes' lines in a few lines of text: busy against wall, the top names."""
    out = [f"wall {summary['wall_ms']:.1f} ms"]
    for plane, lines in summary["planes"].items():
        if not plane.startswith("/device:"):
            continue
        for name, line in lines.items():
            top = ", ".join(f"{t['name']} {t['total_ms']:.1f}ms/{t['count']}" for t in line["top"])
            out.append(f"{plane} {name}: busy {line['busy_ms']:.1f} ms; {top}")
    return "\n".join(out)


def write(summary: dict[str, Any], path: pathlib.Path) -> None:
    path.write_text(json.dumps(summary, indent=1) + "\n")
