"""Interleaved timing: systems measured in turn (A B A B ...) in one process, medians and ratios.

Benchmarks print tables; they never assert a time.
"""

import contextlib
import importlib.metadata
import os
import platform
import statistics
import time
from collections.abc import Callable

import jax


def block(tree: object) -> object:
    return jax.block_until_ready(tree)


def interleaved(
    systems: dict[str, Callable[[], object]], rounds: int = 30, warmup: int = 3
) -> dict[str, float]:
    """Median seconds per call of each system, calling them in turn `rounds` times."""
    for fn in systems.values():
        for _ in range(warmup):
            block(fn())
    samples: dict[str, list[float]] = {name: [] for name in systems}
    for _ in range(rounds):
        for name, fn in systems.items():
            start = time.perf_counter()
            block(fn())
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(times) for name, times in samples.items()}


def table(title: str, medians: dict[str, float], reference: str, unit: str = "us") -> str:
    """A table of medians and of each system's time over the reference's (above 1: slower)."""
    scale = {"us": 1e6, "ms": 1e3}[unit]
    lines = [f"\n{title}", f"{'system':<34}{'median ' + unit:>12}   time / {reference}"]
    for name, seconds in medians.items():
        ratio = seconds / medians[reference]
        lines.append(f"{name:<34}{seconds * scale:>12.1f}   {ratio:.2f}x")
    return "\n".join(lines)


def _cpu() -> str:
    """The CPU's model name (Linux), else what `platform` knows."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> str:
    versions = []
    for name in ("equinox", "flax"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions.append(f"{name} {importlib.metadata.version(name)}")
    return ", ".join(
        [
            f"{_cpu()} ({os.cpu_count()} cores, {platform.machine()})",
            f"{jax.device_count()} {jax.default_backend()} device(s)",
            f"jax {jax.__version__}",
            *versions,
            f"python {platform.python_version()}",
        ]
    )


# Figures a benchmark run records (`record`), compared by `run.py` with those the Performance
# page's table was generated from (tests/benchmarks/recorded.json), and written there with
# `--record`.
FIGURES: dict[str, float] = {}


def record(name: str, seconds: float) -> None:
    """Record one figure of this run under a stable name ("encoder forward/equinox")."""
    FIGURES[name] = float(seconds)
