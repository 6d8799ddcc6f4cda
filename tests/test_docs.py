"""Every Python listing of the documentation prints exactly the output block shown under it.

A page is Markdown: a ```python block is a listing, and a ```text block right after it is what the
listing prints. A listing with no such block must still run without error. The listings of one
page run in order in one fresh interpreter (tests/page_runner.py) with JAX's default settings and
a working directory of their own, as a reader working through the page would run them: a later
listing may read what an earlier one wrote, and each listing has its own globals.
"""

import json
import pathlib
import re
import subprocess
import sys

import pytest

from environment import child_env

ROOT = pathlib.Path(__file__).resolve().parent.parent
# docs/devices/ holds the device lane's reports (data, made by tests/device_lane.py), not pages
PAGES = [
    *sorted(p for p in (ROOT / "docs").glob("**/*.md") if "devices" not in p.parts),
    ROOT / "README.md",
]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
# A page may name the environment its listings run with (the forced host devices of a page on
# meshes, which JAX reads once, at its start): <!-- listings run with: NAME=value ... -->
ENVIRONMENT = re.compile(r"<!-- listings run with: (.*?) -->")


def page_env(page: pathlib.Path) -> dict[str, str]:
    found = ENVIRONMENT.search(page.read_text())
    return dict(pair.split("=", 1) for pair in found.group(1).split()) if found else {}


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
    pytest.param(
        page,
        code,
        expected,
        id=f"{page.relative_to(ROOT)}:{n}",
    )
    for page in PAGES
    for n, (code, expected) in enumerate(listings(page), 1)
]


def test_every_page_has_listings():
    assert len([c for c in CASES if c.id.startswith("docs/attention.md:")]) == 6
    for page in PAGES:
        if page.name not in ("api.md", "performance.md", "development.md"):  # reference pages
            assert listings(page), f"{page} has no listing"


RUNNER = ROOT / "tests" / "page_runner.py"


@pytest.fixture(scope="module")
def page_results(tmp_path_factory):
    """Each page's listings, run once (the first test of a page runs them all): the pages of one
    environment together, in one interpreter, each page in a directory of its own."""
    results: dict[pathlib.Path, dict[str, dict]] = {}

    def run_page(page: pathlib.Path) -> dict[str, dict]:
        if page not in results:
            env = page_env(page)
            pages = [p for p in PAGES if page_env(p) == env and listings(p)]
            cwd = {p: tmp_path_factory.mktemp(p.stem) for p in pages}
            todo = [
                {"name": c.id, "code": c.values[1], "page": str(c.values[0]), "cwd": str(cwd[p])}
                for p in pages
                for c in CASES
                if c.values[0] == p
            ]
            report = tmp_path_factory.mktemp("results") / "results.json"
            ran = subprocess.run(
                [sys.executable, str(RUNNER), str(report)],
                input=json.dumps(todo),
                capture_output=True,
                text=True,
                timeout=1800,
                cwd=cwd[page],
                env=child_env(as_users_run=True, **env),
            )
            assert ran.returncode == 0 and report.exists(), ran.stderr
            ran_listings = json.loads(report.read_text())
            assert [r["name"] for r in ran_listings] == [t["name"] for t in todo]
            for p in pages:
                results[p] = {
                    r["name"]: {**r, "stderr": ran.stderr}
                    for r, t in zip(ran_listings, todo, strict=True)
                    if t["page"] == str(p)
                }
        return results[page]

    return run_page


@pytest.mark.parametrize("page, code, expected", CASES)
def test_listing_prints_what_the_page_shows(request, page, code, expected, page_results):
    result = page_results(page)[request.node.callspec.id]
    assert result["status"] == "ok", f"{result['error']}\n{result['stderr']}"
    if expected is not None:
        assert unsigned_zeros(result["stdout"]) == unsigned_zeros(expected)


# The one tolerance of the comparison, as in the contract page's checker: a printed negative zero
# equals the page's zero. A LayerNorm's output mean is zero up to float32 round-off whose sign
# depends on the CPU (AMD EPYC: -3.0e-09), and `round(..., 4)` keeps the sign.
NEGATIVE_ZERO = re.compile(r"(?<![\w.])-(0(?:\.0+)?)(?![\w.])")


def unsigned_zeros(text: str) -> str:
    return NEGATIVE_ZERO.sub(r"\1", text.strip())


@pytest.mark.parametrize(
    "printed, page, same",
    [
        ("-0.0 1.0", "0.0 1.0", True),
        ("-0 -0.000", "0 0.000", True),
        ("(4, 8) -0.0", "(4, 8) 0.0", True),
        ("-0.01 1.0", "0.01 1.0", False),  # a sign that is not a zero's still counts
        ("-0.5", "0.5", False),
        ("-1.0", "1.0", False),
        ("x-0.0", "x0.0", False),  # not a number of its own
        ("0.0", "-0.0", True),  # the page may print the negative zero itself
        ("-0.0e-3", "0.0e-3", False),
    ],
)
def test_only_a_negative_zero_equals_the_pages_zero(printed, page, same):
    assert (unsigned_zeros(printed) == unsigned_zeros(page)) is same


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
        env=child_env(as_users_run=True),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "6 passed, 0 failed" in result.stdout


def run_listings(listings: list[dict], where: pathlib.Path) -> list[dict]:
    """The page runner's results for `listings`, run from `where`."""
    report = where / "results.json"
    ran = subprocess.run(
        [sys.executable, str(RUNNER), str(report)],
        input=json.dumps(listings),
        capture_output=True,
        text=True,
        cwd=where,
    )
    assert ran.returncode == 0, ran.stderr
    return json.loads(report.read_text())


def test_page_runner_separates_outputs_and_stops_at_the_first_failure(tmp_path):
    listings = [
        {"name": "one", "code": "x = 1\nprint('one', x)"},
        {"name": "two", "code": "print('before'); print(x)"},  # globals are not shared
        {"name": "three", "code": "print('never')"},
    ]
    results = run_listings(listings, tmp_path)
    assert [r["status"] for r in results] == ["ok", "failed", "not run"]
    assert [r["stdout"] for r in results] == ["one 1\n", "before\n", ""]
    assert "NameError: name 'x' is not defined" in results[1]["error"]
    assert results[2]["error"] == "two failed"


def test_page_runner_runs_each_page_in_its_directory_and_a_failure_stops_only_its_page(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    listings = [
        {"name": "a1", "code": "open('made', 'w').write('a')", "page": "a", "cwd": "a"},
        {"name": "b1", "code": "raise ValueError('b1')", "page": "b", "cwd": "b"},
        {"name": "a2", "code": "import os; print(sorted(os.listdir()))", "page": "a", "cwd": "a"},
        {"name": "b2", "code": "print('never')", "page": "b", "cwd": "b"},
    ]
    results = {r["name"]: r for r in run_listings(listings, tmp_path)}
    assert [results[n]["status"] for n in ("a1", "b1", "a2", "b2")] == [
        "ok",
        "failed",
        "ok",
        "not run",
    ]
    assert results["a2"]["stdout"] == "['made']\n" and not (tmp_path / "b" / "made").exists()
