"""Save checkpoints and SIGKILL the writer at chosen steps, for tests/test_bad_inputs.py.

    python checkpoint_killer.py SOURCE RUNS PAIRS_JSON

SOURCE holds three complete checkpoints, v0, v1 and v2. For the n-th pair `(first, second)` of
PAIRS_JSON (steps of `dense_armor.checkpoints.atomic.WRITE_STEPS`, or "never"), RUNS/n/ckpt
starts as a copy of v0; a forked writer saves v1 there and is killed with SIGKILL as the save
completes step `first`, then another writer saves v2 and is killed at `second`. Prints the
writers' exit statuses (-9 when killed) as JSON. The writers fork before any JAX computation and
only write files.
"""

import json
import os
import pathlib
import shutil
import signal
import sys
import traceback

from safetensors.numpy import load_file

from dense_armor.checkpoints import atomic as _atomic
from dense_armor.checkpoints import single as checkpoint


def write(source: pathlib.Path, target: pathlib.Path, version: int, kill_at: str) -> int:
    pid = os.fork()
    if pid == 0:  # the writer
        try:

            def reached(step: str) -> None:
                if step == kill_at:
                    os.kill(os.getpid(), signal.SIGKILL)

            _atomic.reached = reached
            saved = source / f"v{version}"
            weights = load_file(str(saved / "weights.safetensors"))
            config = checkpoint.ModelConfig.from_json(
                json.loads((saved / "config.json").read_text())
            )
            checkpoint._write_checkpoint(target, weights, config, None, None)
        except BaseException:
            traceback.print_exc()
            os._exit(1)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def main() -> None:
    source, runs, pairs = (
        pathlib.Path(sys.argv[1]),
        pathlib.Path(sys.argv[2]),
        json.loads(sys.argv[3]),
    )
    statuses = []
    for n, (first, second) in enumerate(pairs):
        target = runs / str(n) / "ckpt"
        target.parent.mkdir(parents=True)
        shutil.copytree(source / "v0", target)
        statuses.append([write(source, target, 1, first), write(source, target, 2, second)])
    print(json.dumps(statuses))


if __name__ == "__main__":
    main()
