"""Write a directory so that no sequence of kills loses the last complete copy: the one protocol
that checkpoints and exported artifacts share.

`write_directory(target, fill)` has `fill(tmp)` write every file into a temporary directory
beside `target` (`.<name>.XXXX`), fsyncs it, and renames it into place. Replacing moves the old
copy aside to `<name>.previous` first; a reader that finds no `<name>` reads `<name>.previous`,
and the next write puts it back before anything else. Temporary directories left by killed writes
are removed by the next write of the same target. One writer per target at a time.
"""

import hashlib
import os
import pathlib
import shutil
import tempfile
from collections.abc import Callable

__all__ = ["WRITE_STEPS", "previous_copy", "sha256", "write_directory"]

WRITE_STEPS = (
    "files written",  # the files in the temporary directory (a checkpoint's config.json not yet)
    "temporary complete",  # every file, fsynced
    "previous restored",  # a copy a killed write left only in <name>.previous is back
    "previous cleared",  # <name>.previous removed (<name> is complete)
    "moved aside",  # <name> renamed to <name>.previous
    "renamed",  # the temporary directory renamed to <name>: the new copy is in place
    "done",  # <name>.previous removed
)


def reached(step: str) -> None:
    """Called as each step of `WRITE_STEPS` completes; the kill tests replace it to SIGKILL the
    writer at a chosen step."""


def sha256(path: pathlib.Path) -> str:
    """The hex sha256 of a file's bytes, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def previous_copy(target: pathlib.Path) -> pathlib.Path:
    return target.with_name(target.name + ".previous")


def _fsync(path: pathlib.Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_directory(target: pathlib.Path, fill: Callable[[pathlib.Path], None]) -> pathlib.Path:
    """Write `target` through `fill(tmp)`, atomically (see the module's docstring)."""
    previous = previous_copy(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    for stale in target.parent.glob(f".{target.name}.*"):
        if stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        fill(tmp)
        # mkdtemp makes a private (0700) directory and some writers private files; the result
        # gets the usual permissions (the umask's), so a service running as another user can
        # read a checkpoint or an artifact.
        umask = os.umask(0)
        os.umask(umask)
        for path in [*sorted(tmp.rglob("*"), reverse=True), tmp]:  # files before their folders
            os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~umask)
            _fsync(path)
        reached("temporary complete")
        if previous.is_dir() and not target.exists():  # a killed replacement: put it back
            os.rename(previous, target)
            _fsync(target.parent)
        reached("previous restored")
        if previous.exists():  # <name> exists and is complete: the older copy can go
            shutil.rmtree(previous)
        reached("previous cleared")
        if target.exists():
            os.rename(target, previous)
        reached("moved aside")
        os.rename(tmp, target)
        _fsync(target.parent)
        reached("renamed")
        shutil.rmtree(previous, ignore_errors=True)
        reached("done")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target
