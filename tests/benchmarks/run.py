"""Run every benchmark and print its table: `nox -s bench` (or `python -m tests.benchmarks.run`)."""

import datetime
import sys

from . import (
    bench_deploy,
    bench_depth,
    bench_encoder,
    bench_gqa,
    bench_long,
    bench_recurrent,
    bench_sharding,
    bench_streaming,
)
from .harness import machine

BENCHMARKS = {
    "encoder": bench_encoder,
    "streaming": bench_streaming,
    "long": bench_long,
    "deploy": bench_deploy,
    "depth": bench_depth,
    "gqa": bench_gqa,
    "recurrent": bench_recurrent,
    "sharding": bench_sharding,
}


def main() -> None:
    chosen = sys.argv[1:] or list(BENCHMARKS)
    print(f"dense_armor benchmarks, {datetime.date.today()}, {machine()}")
    for name in chosen:
        print(BENCHMARKS[name].run(), flush=True)


if __name__ == "__main__":
    main()
