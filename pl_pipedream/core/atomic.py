"""Directories that appear whole or not at all: staging, fsync, and the swap into place.

A sharded checkpoint is written by several ranks into one directory. It is first written into a
staging directory beside the target, every file fsynced, and only then put in the target's place
by one rename (``publish``). The staging and retired names start with ``.pipedream-`` and carry
a key made from the target's name (a hash, so that the target's name itself, ``last`` for
instance, never appears in them: ``ModelCheckpoint`` finds ``ckpt_path="last"`` by that word).
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import os
import shutil
from pathlib import Path

__all__ = [
    "fsync_dir",
    "leftovers",
    "publish",
    "remove",
    "retired_dir",
    "staging_dir",
    "write_file",
]

STAGING = ".pipedream-partial-"
RETIRED = ".pipedream-old-"
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def _key(path: Path) -> str:
    return hashlib.sha256(path.name.encode()).hexdigest()[:12]


def staging_dir(path: str | Path, token: str) -> Path:
    """Where a save of ``path`` with ``token`` (agreed by every writer) is written."""
    path = Path(path)
    return path.parent / f"{STAGING}{_key(path)}-{token}"


def retired_dir(path: str | Path, token: str) -> Path:
    """Where the previous checkpoint at ``path`` waits for deletion once replaced."""
    path = Path(path)
    return path.parent / f"{RETIRED}{_key(path)}-{token}"


def leftovers(path: str | Path) -> list[Path]:
    """Staging and retired directories of earlier saves of ``path`` (a crash left them)."""
    path = Path(path)
    if not path.parent.is_dir():
        return []
    key = _key(path)
    names = (f"{STAGING}{key}-", f"{RETIRED}{key}-")
    return sorted(p for p in path.parent.iterdir() if p.name.startswith(names))


def write_file(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` and fsync it, so that it is on disk before it is published."""
    with open(path, "wb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())


def fsync_dir(path: str | Path) -> None:
    """Make the entries of directory ``path`` (new files, renames) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _exchange(first: Path, second: Path) -> bool:
    """Swap two paths in one atomic step (Linux ``renameat2(RENAME_EXCHANGE)``); False where
    the system or the file system cannot."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    source, target = os.fsencode(first), os.fsencode(second)
    if renameat2(_AT_FDCWD, source, _AT_FDCWD, target, _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(first), None, str(second))


def publish(staged: Path, path: str | Path, token: str) -> None:
    """Put the complete directory ``staged`` at ``path``, replacing what is there.

    With nothing at ``path``: one rename; a crash before it leaves only a staging directory,
    which readers never look at and the next save of ``path`` deletes. With a previous
    checkpoint at ``path``: on Linux the two are swapped in one step (a crash before it leaves
    the previous checkpoint at ``path``, after it the new one), then the previous one, now under
    the staging name, is deleted. Where no swap exists the previous one is renamed aside first
    (``retired_dir``); a crash between the two renames leaves no checkpoint at ``path`` but both
    complete ones beside it, and ``read_shards`` names the retired one. Leftovers of earlier
    crashed saves of ``path`` are deleted last.
    """
    path = Path(path)
    parent = path.parent
    if not os.path.lexists(path):
        os.rename(staged, path)
    elif not _exchange(staged, path):
        os.rename(path, retired_dir(path, token))
        os.rename(staged, path)
    fsync_dir(parent)
    for leftover in leftovers(path):  # a symlink here is a swapped-out save_last="link"
        if leftover.is_symlink():
            leftover.unlink()
        else:
            shutil.rmtree(leftover, ignore_errors=True)


def remove(path: str | Path) -> None:
    """Delete the checkpoint at ``path`` (what ``ModelCheckpoint`` replaces): a symlink or file
    is unlinked; a directory is first renamed aside, so that it disappears in one step rather
    than file by file, then deleted."""
    path = Path(path)
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        aside = retired_dir(path, f"removed-{os.getpid()}")
        os.rename(path, aside)
        shutil.rmtree(aside)
