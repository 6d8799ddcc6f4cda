"""Where the suite's time goes, per test file: set `DENSE_ARMOR_TEST_PROFILE=DIRECTORY` and each
pytest worker writes `DIRECTORY/<worker>.json`, per file the seconds its tests took (setup, call
and teardown) and, of those, the seconds JAX spent tracing to jaxprs, lowering to StableHLO and
compiling with XLA's backend in the worker itself (JAX's own monitoring events; a nested jit's
trace is counted inside its caller's too, so tracing is an upper bound). The rest of a file's
time is its arithmetic, its Python, and its children (the pages' and examples' interpreters,
the C runner, IREE's compiler): `python tests/profile_suite.py DIRECTORY` prints the table.
"""

import collections
import json
import os
import pathlib
import sys
import time

import pytest

EVENTS = {
    "/jax/core/compile/jaxpr_trace_duration": "trace",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
    "/jax/core/compile/backend_compile_duration": "compile",
}
COLUMNS = ("seconds", "trace", "lower", "compile", "compiles")


class Profile:
    """The pytest plugin: the current test's file, and the seconds of each kind per file."""

    def __init__(self, directory: str):
        import jax

        self.directory = pathlib.Path(directory)
        self.totals: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.functions: dict[str, collections.Counter] = collections.defaultdict(
            collections.Counter
        )
        self.file = "(outside tests)"
        jax.monitoring.register_event_duration_secs_listener(self._event)

    def _event(self, event: str, duration: float, fun_name: str = "?", **_: object) -> None:
        kind = EVENTS.get(event)
        if kind is not None:
            self.totals[self.file][kind] += duration
            function = self.functions[f"{self.file}::{fun_name}"]
            function[kind] += duration
            if kind == "compile":
                self.totals[self.file]["compiles"] += 1
                function["compiles"] += 1

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        self.file = item.path.name
        began = time.perf_counter()
        yield
        self.totals[self.file]["seconds"] += time.perf_counter() - began

    def pytest_sessionfinish(self, session):
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        self.directory.mkdir(parents=True, exist_ok=True)
        out = {name: dict(counts) for name, counts in self.totals.items()}
        (self.directory / f"{worker}.json").write_text(json.dumps(out, indent=1))
        functions = {name: dict(counts) for name, counts in self.functions.items()}
        (self.directory / f"{worker}.functions").write_text(json.dumps(functions))


def table(directory: pathlib.Path) -> str:
    merged: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for path in directory.glob("*.json"):
        for name, counts in json.loads(path.read_text()).items():
            merged[name].update(counts)
    rows = sorted(merged.items(), key=lambda item: -item[1]["seconds"])
    total = sum((c for _, c in rows), collections.Counter())
    lines = ["| file | " + " | ".join(COLUMNS) + " |", "|---" * (len(COLUMNS) + 1) + "|"]
    for name, counts in [*rows, ("all", total)]:
        cells = [f"{counts[c]:.0f}" if c == "compiles" else f"{counts[c]:.1f}" for c in COLUMNS]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def functions(directory: pathlib.Path, count: int = 40) -> str:
    """The `count` functions (file::JAX's name) of most tracing, lowering and compiling."""
    merged: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for path in directory.glob("*.functions"):
        for name, counts in json.loads(path.read_text()).items():
            merged[name].update(counts)
    for counts in merged.values():
        counts["seconds"] = counts["trace"] + counts["lower"] + counts["compile"]
    rows = sorted(merged.items(), key=lambda item: -item[1]["seconds"])[:count]
    lines = ["| function | " + " | ".join(COLUMNS) + " |", "|---" * (len(COLUMNS) + 1) + "|"]
    for name, counts in rows:
        cells = [f"{counts[c]:.0f}" if c == "compiles" else f"{counts[c]:.1f}" for c in COLUMNS]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(pathlib.Path(sys.argv[1])))
    if "--functions" in sys.argv:
        print(functions(pathlib.Path(sys.argv[1])))
