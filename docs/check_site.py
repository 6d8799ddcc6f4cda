"""Open the built site in headless Chromium and check that every page renders cleanly.

    python docs/check_site.py [SITE_DIR] [--screenshots DIR]

Serves SITE_DIR (default site/) on 127.0.0.1 at a free port, opens each page with Playwright
driving the system's Chromium (Debian's `chromium` package), and fails if a page logs a console
error, raises a JavaScript error, answers an HTTP error, or lacks its heading and the skip link.
A screenshot of each page is written to --screenshots (default build/screenshots/).
"""

import argparse
import functools
import http.server
import pathlib
import shutil
import sys
import threading

from playwright.sync_api import sync_playwright

PAGES = [
    "",
    "attention/",
    "streaming/",
    "training/",
    "cross-attention/",
    "sequences/",
    "export/",
    "api/",
]
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


def chromium_path() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    raise SystemExit("no Chromium found: install it, e.g. `apt-get install chromium`.")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("site", nargs="?", type=pathlib.Path, default=pathlib.Path("site"))
    parser.add_argument(
        "--screenshots", type=pathlib.Path, default=pathlib.Path("build/screenshots")
    )
    args = parser.parse_args()
    if not (args.site / "index.html").is_file():
        raise SystemExit(f"{args.site} holds no built site: run `mkdocs build --strict` first.")
    args.screenshots.mkdir(parents=True, exist_ok=True)

    handler = functools.partial(QuietHandler, directory=str(args.site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}/"
    problems: list[str] = []
    try:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(
                executable_path=chromium_path(), args=CHROMIUM_FLAGS
            )
            for page_path in PAGES:
                page = browser.new_page(viewport={"width": 1280, "height": 900})
                errors: list[str] = []
                page.on(
                    "console", lambda m, e=errors: e.append(m.text) if m.type == "error" else None
                )
                page.on("pageerror", lambda exc, e=errors: e.append(str(exc)))
                response = page.goto(base + page_path, wait_until="networkidle", timeout=30_000)
                name = page_path.strip("/") or "index"
                if response is None or response.status != 200:
                    problems.append(
                        f"{name}: HTTP {response.status if response else 'no response'}"
                    )
                if page.locator("h1").count() == 0:
                    problems.append(f"{name}: no heading")
                if page.get_by_text("Skip to content").count() == 0:
                    problems.append(f"{name}: no skip link")
                problems += [f"{name}: console error: {e}" for e in errors]
                page.screenshot(path=str(args.screenshots / f"{name}.png"), full_page=False)
                print(f"{name:<10} rendered, {len(errors)} console errors")
                page.close()
            browser.close()
    finally:
        server.shutdown()
    for problem in problems:
        print(f"problem: {problem}", file=sys.stderr)
    print(
        f"{len(PAGES) - len({p.split(':')[0] for p in problems})} of {len(PAGES)} pages clean; "
        f"screenshots in {args.screenshots}"
    )
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
