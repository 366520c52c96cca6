"""Durable writes: a file written under ``<name>.tmp`` and renamed into place, a directory fsync'd, so that a
new file or a rename in it survives a power loss.

In: a path and what to write there, or a directory. Out: nothing; the file (or the entry) is on disk. Shared by the
cache writers (cache/common, which add the frozen-rank checks) and ``ds-capture regenerate``'s journal, which sit
on different floors of the import graph.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

TMP_SUFFIX = ".tmp"


def write_atomic(path: Path, write: Callable[[Path], None], *, check: Callable[[], None] = lambda: None) -> None:
    """Call ``write(tmp)`` on ``<name>.tmp``, fsync it, rename it over ``path``; never a partial ``path``, and no
    ``.tmp`` left behind when anything fails. ``check()`` runs before the file is started and before the rename
    (the cache writers' refusal of a rank that was frozen)."""
    tmp = path.with_name(path.name + TMP_SUFFIX)
    check()
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        check()
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def fsync_dir(directory: Path) -> None:
    """A rename (or a new file) in ``directory`` is durable only once the directory entry is flushed."""
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
