"""Durable renames: a directory fsync'd, so that a new file or a rename in it survives a power loss.

In: a directory. Out: nothing; its entries are on disk. Shared by the cache writers (cache/common) and
``ds-capture regenerate``'s journal, which sit on different floors of the import graph.
"""

from __future__ import annotations

import os
from pathlib import Path


def fsync_dir(directory: Path) -> None:
    """A rename (or a new file) in ``directory`` is durable only once the directory entry is flushed."""
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
