"""Feed a causal encoder one sample at a time, as a control loop would.

A `Stream` holds the encoder's fixed-capacity cache and its step, compiled once; each tick
donates the cache to the step, so the loop never recompiles and updates the cache in place, and a
tick past the capacity would raise before it ran. At the end the streamed outputs are checked
against `forward` on every prefix of the stream.

    python examples/stream.py --steps 200 --capacity 256
"""

import argparse
import time

import jax
import numpy as np

from dense_armor.utility.neural import Stream, transformer_encoder


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="samples to stream (default 200)")
    parser.add_argument("--capacity", type=int, default=256, help="cache capacity (default 256)")
    parser.add_argument("--check-every", type=int, default=20, help="prefixes to compare")
    args = parser.parse_args(argv)
    if not 1 <= args.steps <= args.capacity:
        parser.error(f"--steps must lie in [1, --capacity={args.capacity}]")

    n_in, n_out = 6, 4
    model = transformer_encoder(
        n_in, 64, 4, 128, 2, n_out, jax.random.PRNGKey(0), args.capacity, causal=True
    )
    stream = jax.random.normal(jax.random.PRNGKey(1), (args.steps, n_in))
    live = Stream(model, args.capacity)

    outputs, latencies = [], []
    for x_t in stream:
        start = time.perf_counter()
        y_t = live.step(x_t)
        y_t.block_until_ready()
        latencies.append(time.perf_counter() - start)
        outputs.append(np.asarray(y_t))

    forward = jax.jit(lambda m, x: m(x))
    checked = range(0, args.steps, max(1, args.check_every))
    error = max(float(np.abs(outputs[t] - forward(model, stream[: t + 1])).max()) for t in checked)
    steady = np.asarray(latencies[1:] or latencies) * 1e6
    report = {
        "first_step_ms": latencies[0] * 1e3,
        "median_step_us": float(np.median(steady)),
        "p99_step_us": float(np.percentile(steady, 99)),
        "max_error": error,
    }
    print(f"streamed {args.steps} samples through a causal encoder (capacity {args.capacity})")
    print(f"first step (compiles): {report['first_step_ms']:.1f} ms")
    print(f"per step: median {report['median_step_us']:.0f} us, p99 {report['p99_step_us']:.0f} us")
    print(f"max |step - forward| over {len(checked)} prefixes: {error:.2e}")
    if error > 1e-4:
        raise SystemExit(f"streamed outputs differ from forward by {error:.2e}")
    return report


if __name__ == "__main__":
    main()
