"""Run every documentation page's listings with XLA's CPU code limited to an older instruction
set, and report each printed output that then differs from its page.

    python tests/pages_on_other_cpus.py [ISA ...]      (default: AVX2 SSE4_2)

A printed float's last digit or sign may depend on the CPU: XLA's CPU compiler vectorises
reductions by the widest instructions it may use, and the order of a sum changes its round-off.
`--xla_cpu_max_isa=AVX2` computes as a CPU without AVX-512 does (an AMD EPYC before Zen 4), and
`SSE4_2` as an older one, on any x86 machine. The one difference the page comparison tolerates is
a printed negative zero (`unsigned_zeros` in test_docs.py); anything else this prints is a listing
whose output the page cannot promise. Each run compiles afresh (its own cache directory), so no
module compiled for another instruction set is read back. `nox -s pages_on_other_cpus` runs it.
"""

import json
import pathlib
import subprocess
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from environment import child_env
from test_docs import CASES, RUNNER, page_env, unsigned_zeros


def differences(isa: str) -> list[str]:
    pages: dict[pathlib.Path, list] = {}
    for case in CASES:
        pages.setdefault(case.values[0], []).append(case)
    found = []
    for page, cases in pages.items():
        listings = [{"name": c.id, "code": c.values[1]} for c in cases]
        work = pathlib.Path(tempfile.mkdtemp(prefix=f"pages-{isa}-"))
        env = child_env(as_users_run=True, **page_env(page))
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_cpu_max_isa={isa}".strip()
        env["JAX_COMPILATION_CACHE_DIR"] = str(work / "cache")
        subprocess.run(
            [sys.executable, str(RUNNER), str(work / "results.json")],
            input=json.dumps(listings),
            capture_output=True,
            text=True,
            cwd=work,
            env=env,
            timeout=1800,
            check=True,
        )
        results = {r["name"]: r for r in json.loads((work / "results.json").read_text())}
        for case in cases:
            result, expected = results[case.id], case.values[2]
            if result["status"] != "ok":
                found.append(f"{isa} {case.id}: {result['status']}: {result['error']}")
            elif expected is not None and unsigned_zeros(result["stdout"]) != unsigned_zeros(
                expected
            ):
                found.append(
                    f"{isa} {case.id}:\n  page: {expected.strip()}\n  got:  {result['stdout']}"
                )
        print(f"{isa}: {page.name} checked", flush=True)
    return found


def main(isas: list[str]) -> int:
    found = [line for isa in isas for line in differences(isa)]
    print("\n".join(found) or f"every listing prints what its page shows on {', '.join(isas)}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or ["AVX2", "SSE4_2"]))
