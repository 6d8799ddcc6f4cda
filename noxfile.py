"""Sessions: tests, coverage, lint, typecheck, doctest, export, bench. `nox -s tests` is the test
command."""

import os

import nox

# uv installs without compiling bytecode (pip compiles it); where PYTHONDONTWRITEBYTECODE is set
# nothing compiles it later either, so every process the suite starts (workers, pages, examples,
# distributed runs) compiled jax, numpy and the rest from source again: 1.4 s more per `import
# jax`, a minute over the suite. Compiled once at install instead.
os.environ.setdefault("UV_COMPILE_BYTECODE", "1")

nox.options.sessions = ["tests", "lint", "typecheck"]
# uv where it is installed (`pip install "nox[uv]"`: the environments build in seconds, from
# its cache), else the standard library's venv.
nox.options.default_venv_backend = "uv|venv"
nox.options.reuse_venv = "yes"

PYTHON = "3.11"
# Line and branch coverage of src/ by the suite, measured in its own process (2026-11-30: 93%).
COVERAGE_FLOOR = 93


# The suite's arguments: every core, a file's module fixtures (a docs page's run, an export)
# built once, the files handed out in the order tests/conftest.py gives (the longest first;
# xdist's own reordering would sort them by their number of tests), the slowest tests printed.
PYTEST = [
    "pytest",
    "tests",
    "--ignore=tests/benchmarks",
    "--numprocesses=auto",
    "--dist=loadfile",
    "--no-loadscope-reorder",
    "--durations=15",
]


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    """The test suite (without the benchmarks), on every core. Without coverage: its line tracer
    made the suite's Python-bound tracing a third slower (digits pipeline test 39 s -> 52 s);
    `nox -s coverage` runs the same suite with it."""
    session.install("-e", ".[test,examples,iree,scale,pjrt]")
    session.run(*PYTEST, *session.posargs)


@nox.session(python=PYTHON)
def quick(session: nox.Session) -> None:
    """The quick tier for the inner loop (at most 3 minutes warm on a 2-core machine): the suite
    less the files that make artifacts through IREE or C, start other processes or run the
    docs' listings (`--quick`, tests/conftest.py's NOT_QUICK); every module still imported. The
    README's command stays the whole gate."""
    session.install("-e", ".[test,examples,iree,scale,pjrt]")
    session.run(*PYTEST, "--quick", *session.posargs)


@nox.session(python=PYTHON)
def coverage(session: nox.Session) -> None:
    """The test suite with line and branch coverage of src/ (at least COVERAGE_FLOOR percent)."""
    session.install("-e", ".[test,examples,iree,scale,pjrt]")
    session.run(
        *PYTEST,
        "--cov=dense_armor",
        "--cov-branch",
        "--cov-report=term",
        f"--cov-fail-under={COVERAGE_FLOOR}",
        *session.posargs,
    )


@nox.session(python=PYTHON)
def doctest(session: nox.Session) -> None:
    """Only the documentation listings: each must print what its page shows."""
    session.install("-e", ".[test,scale,pjrt]")
    session.run("pytest", "tests/test_docs.py", *session.posargs)


@nox.session(python=PYTHON)
def pages_on_other_cpus(session: nox.Session) -> None:
    """Every page's listings with XLA's CPU code limited to AVX2 and to SSE4.2 (as on CPUs
    without AVX-512): lists each printed value whose digits or sign then differ from the page."""
    session.install("-e", ".[test,scale]")
    session.run("python", "tests/pages_on_other_cpus.py", *session.posargs)


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """ruff check, ruff format --check, and the import contracts (pyproject's
    `[tool.importlinter]`: the package's layers import only downwards)."""
    session.install("ruff>=0.6", "import-linter>=2.1")
    session.run("ruff", "check", "src", "tests", "examples", "export", "docs", "noxfile.py")
    session.run(
        "ruff", "format", "--check", "src", "tests", "examples", "export", "docs", "noxfile.py"
    )
    session.run("lint-imports", env={"PYTHONPATH": "src"})  # reads the source; imports nothing


@nox.session(python=PYTHON)
def typecheck(session: nox.Session) -> None:
    """mypy on src/."""
    session.install("-e", ".[typecheck,scale]")
    session.run("mypy")


@nox.session(python=PYTHON)
def bench(session: nox.Session) -> None:
    """Benchmarks against peer libraries (installed here only); prints tables, asserts nothing."""
    session.install("-e", ".[examples,iree,pjrt]", "flax>=0.10")
    peers = {"lm", "precision", "serve"}  # the language-model benchmarks' peer: transformers
    everything = not [a for a in session.posargs if a != "--record"]
    if peers & set(session.posargs) or everything:
        session.install("torch", "transformers")
    if "serve" in session.posargs or everything:  # both servers, and transformers serve's needs
        session.install("-e", ".[serve]", "openai", "fastapi", "pydantic", "accelerate")
    session.run("python", "-m", "tests.benchmarks.run", *session.posargs)


@nox.session(python=PYTHON)
def export(session: nox.Session) -> None:
    """The main job: train the digits example, export it to export/artifacts/, verify it."""
    session.install("-e", ".[examples,iree,pjrt]")
    session.run("python", "export/pipeline.py", *session.posargs)


@nox.session(python=PYTHON)
def docs(session: nox.Session) -> None:
    """Build the site strictly into site/, then check every page in headless Chromium.

    Needs a system Chromium (Debian: `apt-get install chromium`); screenshots go to
    build/screenshots/.
    """
    session.install("-e", ".[docs]")
    session.env["NO_MKDOCS_2_WARNING"] = "1"
    session.run("mkdocs", "build", "--strict")
    session.run("python", "docs/check_site.py", "site")
