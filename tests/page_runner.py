"""Run the listings of one documentation page in order, in this one fresh interpreter.

    python page_runner.py RESULTS_JSON < LISTINGS_JSON

LISTINGS_JSON is a list of `{"name": ..., "code": ...}`. Each listing runs as its own program
would (`__name__ == "__main__"`, its own globals), in the current directory, so a later listing
reads the files an earlier one wrote; only the interpreter and the modules it imported are
shared. What each listing prints is captured apart. After the first listing that raises, the
rest are not run. RESULTS_JSON receives, per listing, `{"name", "status", "stdout", "error"}`
with status "ok", "failed" or "not run".

Imports nothing from the project, so the page sees the interpreter a reader would start.
"""

import contextlib
import io
import json
import sys
import traceback


def run(listings: list[dict[str, str]]) -> list[dict[str, str | None]]:
    results: list[dict[str, str | None]] = []
    failed = None
    for listing in listings:
        name = listing["name"]
        if failed is not None:
            results.append(
                {"name": name, "status": "not run", "stdout": "", "error": f"{failed} failed"}
            )
            continue
        captured = io.StringIO()
        error = None
        try:
            code = compile(listing["code"], f"<{name}>", "exec")
            with contextlib.redirect_stdout(captured):
                exec(code, {"__name__": "__main__", "__builtins__": __builtins__})
        except BaseException:  # a listing's SystemExit or KeyboardInterrupt is its failure too
            error = traceback.format_exc()
            failed = name
        results.append(
            {
                "name": name,
                "status": "ok" if error is None else "failed",
                "stdout": captured.getvalue(),
                "error": error,
            }
        )
    return results


if __name__ == "__main__":
    output = sys.argv[1]
    results = run(json.load(sys.stdin))
    with open(output, "w") as handle:
        json.dump(results, handle)
