"""Train the digits example over a device mesh, on one host or several.

Every device holds a slice of each batch and a replica of the model, or, with --model-axis k,
1/k of each attention layer's heads and feed-forward units (a data x model mesh), and with
--shard-params also a slice of every other parameter; XLA inserts the collectives. The losses are
those of the single-device run. --orbax writes sharded checkpoints (each process its own shards).

    python examples/data_parallel.py --cpu-devices 4 --steps 600      # 4 CPU devices, one host
    python examples/data_parallel.py --cpu-devices 4 --model-axis 2   # 2 x 2: data x model
    python examples/data_parallel.py --steps 600                      # every GPU/TPU of the host

Several hosts: on each, set DENSE_ARMOR_COORDINATOR=host0:port, DENSE_ARMOR_NUM_PROCESSES and
DENSE_ARMOR_PROCESS_ID (or rely on SLURM / Cloud TPU detection) and add --distributed.
"""

import argparse
import importlib.util
import os
import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--cpu-devices", type=int, help="split the CPU into this many devices")
    parser.add_argument(
        "--model-axis", type=int, default=1, help="devices that split each model's heads"
    )
    parser.add_argument("--shard-params", action="store_true", help="FSDP-style parameters")
    parser.add_argument("--orbax", action="store_true", help="sharded checkpoints with Orbax")
    parser.add_argument("--distributed", action="store_true", help="join a multi-host run first")
    parser.add_argument("--out", type=pathlib.Path, default=HERE / "runs" / "data_parallel")
    args = parser.parse_args(argv)
    if args.cpu_devices:
        if "jax" in sys.modules:
            parser.error("--cpu-devices must be set before JAX starts; run this file as a script")
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "")
            + f" --xla_force_host_platform_device_count={args.cpu_devices}"
        )
    if args.distributed:
        from dense_armor.distributed import initialize

        initialize()

    import jax
    import optax

    from dense_armor.distributed import device_mesh
    from dense_armor.training import evaluate, fit

    spec = importlib.util.spec_from_file_location("digits", HERE / "digits.py")
    digits = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(digits)

    mesh = device_mesh(model=args.model_axis)
    data = digits.digits_splits(0)
    config = digits.model_config()
    data_axis, model_axis = mesh.shape["data"], mesh.shape["model"]
    if jax.process_index() == 0:
        print(
            f"mesh: {mesh.size} devices ({data_axis} data x {model_axis} model; "
            f"{jax.process_count()} processes, {jax.default_backend()}), batch {args.batch_size} "
            f"split {args.batch_size // data_axis} per data row"
        )
    with jax.numpy_dtype_promotion("standard"):
        result = fit(
            config.build(jax.random.PRNGKey(0)),
            optax.adamw(1e-3, weight_decay=1e-4),
            data["train"],
            steps=args.steps,
            batch_size=args.batch_size,
            valid=data["valid"],
            eval_every=max(1, args.steps // 10),
            checkpoint_dir=args.out,
            config=config,
            mesh=mesh,
            shard_params=args.shard_params,
            checkpoint_format="orbax" if args.orbax else "safetensors",
        )
    test = evaluate(result.model, *data["test"], mesh=mesh)
    if jax.process_index() == 0:
        print(
            f"test accuracy {test['accuracy']:.4f} after {args.steps} steps on {mesh.size} devices"
        )
    return {"test": test, "devices": mesh.size, "mesh": dict(mesh.shape), "history": result.history}


if __name__ == "__main__":
    main()
