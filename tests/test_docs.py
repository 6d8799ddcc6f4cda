"""Every Python listing of the documentation prints exactly the output block shown under it.

A page is Markdown: a ```python block is a listing, and a ```text block right after it is what the
listing prints. A listing with no such block must still run without error. Each listing runs in a
fresh interpreter with JAX's default settings, as a reader would run it; the listings of one page
share a working directory and run in order, so a later listing may read what an earlier one wrote.
"""

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [*sorted((ROOT / "docs").glob("**/*.md")), ROOT / "README.md"]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


def listings(page: pathlib.Path) -> list[tuple[str, str | None]]:
    text = page.read_text()
    blocks = [(m.group(1), m.group(2), m.start(), m.end()) for m in FENCE.finditer(text)]
    found = []
    for i, (lang, body, _, end) in enumerate(blocks):
        if lang != "python":
            continue
        following = blocks[i + 1] if i + 1 < len(blocks) else None
        adjacent = following is not None and not text[end : following[2]].strip()
        is_output = adjacent and following is not None and following[0] == "text"
        found.append((body, following[1] if is_output and following else None))
    return found


CASES = [
    pytest.param(page, code, expected, id=f"{page.relative_to(ROOT)}:{n}")
    for page in PAGES
    for n, (code, expected) in enumerate(listings(page), 1)
]


def test_every_page_has_listings():
    assert len([c for c in CASES if c.id.startswith("docs/attention.md:")]) == 6
    for page in PAGES:
        if page.name != "api.md":
            assert listings(page), f"{page} has no listing"


@pytest.fixture(scope="module")
def page_dirs(tmp_path_factory):
    dirs: dict[pathlib.Path, pathlib.Path] = {}
    return lambda page: dirs.setdefault(page, tmp_path_factory.mktemp(page.stem))


@pytest.mark.parametrize("page, code, expected", CASES)
def test_listing_prints_what_the_page_shows(page, code, expected, page_dirs):
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=page_dirs(page),
        env=env,
    )
    assert result.returncode == 0, result.stderr
    if expected is not None:
        assert result.stdout.strip() == expected.strip()


CONTRACT_CHECKER = ROOT.parent / "shared" / "tools" / "check-spec-page"


@pytest.mark.skipif(
    not CONTRACT_CHECKER.exists(), reason="the contract page's checker is not beside this checkout"
)
def test_contract_page_checker_passes():
    result = subprocess.run(
        [sys.executable, str(CONTRACT_CHECKER), sys.executable],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "6 passed, 0 failed" in result.stdout
