"""Interleaved timing: systems measured in turn (A B A B ...) in one process, medians and ratios.

Benchmarks print tables; they never assert a time.
"""

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


def machine() -> str:
    return (
        f"{platform.processor() or platform.machine()}, {jax.device_count()} "
        f"{jax.default_backend()} device(s), jax {jax.__version__}, python "
        f"{platform.python_version()}"
    )
