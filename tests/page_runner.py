"""Run the listings of documentation pages in order, in this one fresh interpreter.

    python page_runner.py RESULTS_JSON < LISTINGS_JSON

LISTINGS_JSON is a list of `{"name": ..., "code": ...}`, optionally with `"page"` (the page it
belongs to) and `"cwd"` (the directory it runs in; default the current one). Each listing runs
as its own program would (`__name__ == "__main__"`, its own globals), in its page's directory,
so a later listing reads the files an earlier one of its page wrote; only the interpreter and the
modules it imported are shared (pages with the same environment share one interpreter: an
interpreter and its imports of jax and dense_armor cost about 3 s, a dozen pages a minute of the
suite). What each listing prints is captured apart. After a listing that raises, the rest of its
page are not run. RESULTS_JSON receives, per listing,
`{"name", "status", "stdout", "error", "seconds"}` with status "ok", "failed" or "not run" (and
the seconds it ran, for the suite's timings).

Imports nothing from the project, so the page sees the interpreter a reader would start (only
the suite's garbage-collector setting, tests/environment.py, which changes no output).
"""

import contextlib
import io
import json
import os
import sys
import time
import traceback


def run(listings: list[dict[str, str]]) -> list[dict[str, str | None]]:
    results: list[dict[str, str | None]] = []
    failed: dict[str | None, str] = {}  # a page -> its listing that failed
    start = os.getcwd()
    for listing in listings:
        name, page = listing["name"], listing.get("page")
        if page in failed:
            results.append(
                {
                    "name": name,
                    "status": "not run",
                    "stdout": "",
                    "error": f"{failed[page]} failed",
                    "seconds": 0.0,
                }
            )
            continue
        os.chdir(os.path.join(start, listing.get("cwd", ".")))  # relative to where it started
        captured = io.StringIO()
        error = None
        began = time.perf_counter()
        try:
            code = compile(listing["code"], f"<{name}>", "exec")
            with contextlib.redirect_stdout(captured):
                exec(code, {"__name__": "__main__", "__builtins__": __builtins__})
        except BaseException:  # a listing's SystemExit or KeyboardInterrupt is its failure too
            error = traceback.format_exc()
            failed[page] = name
        results.append(
            {
                "name": name,
                "status": "ok" if error is None else "failed",
                "stdout": captured.getvalue(),
                "error": error,
                "seconds": round(time.perf_counter() - began, 2),
            }
        )
    return results


if __name__ == "__main__":
    # The suite's own helper, beside this file (not the project): the collector set as in the
    # suite's other processes, which changes no output.
    from environment import collect_garbage_less_often

    collect_garbage_less_often()
    output = sys.argv[1]
    results = run(json.load(sys.stdin))
    with open(output, "w") as handle:
        json.dump(results, handle)
