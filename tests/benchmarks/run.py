"""Run every benchmark and print its table: `nox -s bench` (or `python -m tests.benchmarks.run`),
or the ones named: `nox -s bench -- encoder streaming`. After them, every recorded figure beside
the Performance page's (see `recorded`); `--record` writes this run's figures and the page's
table."""

import datetime
import sys

from . import (
    bench_deploy,
    bench_depth,
    bench_encoder,
    bench_gqa,
    bench_hybrid,
    bench_lm,
    bench_long,
    bench_precision,
    bench_recurrent,
    bench_serve,
    bench_sharding,
    bench_streaming,
    recorded,
)
from .harness import FIGURES, machine

BENCHMARKS = {
    "encoder": bench_encoder,
    "streaming": bench_streaming,
    "long": bench_long,
    "deploy": bench_deploy,
    "depth": bench_depth,
    "gqa": bench_gqa,
    "recurrent": bench_recurrent,
    "sharding": bench_sharding,
    "lm": bench_lm,
    "hybrid": bench_hybrid,
    "precision": bench_precision,
    "serve": bench_serve,
}


def main() -> None:
    arguments = sys.argv[1:]
    write = "--record" in arguments
    chosen = [a for a in arguments if a != "--record"] or list(BENCHMARKS)
    unknown = [name for name in chosen if name not in BENCHMARKS]
    if unknown:
        raise SystemExit(f"unknown benchmarks {unknown}; choose from {list(BENCHMARKS)}.")
    today, where = str(datetime.date.today()), machine()
    print(f"dense_armor benchmarks, {today}, {where}")
    for name in chosen:
        print(BENCHMARKS[name].run(), flush=True)
    if FIGURES and recorded.RECORDED.exists():
        print(recorded.compare(FIGURES, recorded.load()))
    if write:
        recorded.write(FIGURES, today, where)
        print(f"\nwrote {recorded.RECORDED} and the Performance page's table")


if __name__ == "__main__":
    main()
