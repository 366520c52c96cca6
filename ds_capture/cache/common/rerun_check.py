"""Rerun check: which shards of a cache marked complete must be recomputed, found without reading their data.

In: a cache directory, its manifest (either cache kind: ``num_shards`` and ``expected_shard_tensors``), and
whether to re-hash every shard. Out: a :class:`RerunCheck` holding ``{index: problem}`` for each shard a
rerun recomputes, and the line that says what was found and what is redone; and :func:`shard_is_done`, the
same checks with the checksum, which a resume applies to each shard it keeps.

A complete manifest (DSpark ``complete: true``, EAGLE-3 ``.ds_capture/complete.json``) says the shards were
all written; files on a shared filesystem still go missing or get truncated afterwards. So before a rerun
declares "nothing to do" it checks each shard cheaply, from metadata and the header only (a few hundred
bytes per shard, never the tensor data):

- the file exists under its final name;
- its size is the one its own safetensors header implies (8 + header length + the last data offset);
- its header is the one the manifest's layout gives (names, shapes, dtypes; bytes as safetensors writes them);
- its checksum sidecar (``.ds_capture/checksums/``) exists, as a resume requires of every shard it keeps.

``checksums=True`` (``ds-capture run --verify-checksums``) also re-hashes every shard against its sidecar,
which finds a flipped byte inside the data at the cost of reading the whole cache.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ds_capture.cache.common.files import checksum_matches, read_recorded_checksum
from ds_capture.cache.common.names import BOOKKEEPING_DIR, CHECKSUMS_DIR, checksum_name, shard_name
from ds_capture.cache.common.shard_file import SafetensorsLayout

_MAX_LISTED = 10
_MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit on the header's JSON


@dataclass(frozen=True)
class RerunCheck:
    """What :func:`check_complete_cache` found in ``num_shards`` shards (``damaged``: index -> problem)."""

    num_shards: int
    damaged: dict[int, str]
    checksums: bool

    @property
    def ok(self) -> bool:
        return not self.damaged

    def describe(self) -> str:
        """The verdict for a user: what was checked, or each damaged shard and what the rerun recomputes."""
        if self.ok:
            checked = ("checksums match their sidecars" if self.checksums
                       else "sized as their headers say, with checksum sidecars")
            return f"all {self.num_shards} shards checked: present, {checked}"
        indices = sorted(self.damaged)
        listed = "; ".join(f"{shard_name(i)}: {self.damaged[i]}" for i in indices[:_MAX_LISTED])
        if len(indices) > _MAX_LISTED:
            listed += f"; (and {len(indices) - _MAX_LISTED} more)"
        return f"{listed}: recomputing {len(indices)} of {self.num_shards} shards"


def check_complete_cache(out_dir: Path, manifest: Any, *, checksums: bool = False) -> RerunCheck:
    """Check every shard of a cache whose manifest says complete (see the module docstring)."""
    out_dir = Path(out_dir)
    damaged = {}
    for index in range(manifest.num_shards):
        problem = shard_problem(out_dir, index, manifest, checksums=checksums)
        if problem is not None:
            damaged[index] = problem
    return RerunCheck(num_shards=manifest.num_shards, damaged=damaged, checksums=checksums)


def shard_problem(out_dir: Path, index: int, manifest: Any, *, checksums: bool = False) -> str | None:
    """Why shard ``index`` must be recomputed, or None when it passes (only its header is read unless
    ``checksums``)."""
    path = Path(out_dir) / shard_name(index)
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return "missing"
    expected = SafetensorsLayout.build(manifest.expected_shard_tensors(index))
    try:
        header, implied_size = read_header(path)
    except ValueError as error:
        return f"unreadable safetensors header ({error})"
    if size != implied_size:
        return f"size {size} != {implied_size} from its header"
    if header != expected.header:
        return "its header does not describe the manifest's tensors (names, shapes or dtypes differ)"
    recorded = read_recorded_checksum(out_dir, index)
    if recorded is None:
        return f"no checksum sidecar ({BOOKKEEPING_DIR}/{CHECKSUMS_DIR}/{checksum_name(index)})"
    if checksums and not checksum_matches(path, recorded):
        return f"its {recorded.partition(':')[0]} checksum differs from its sidecar (the file changed after it was written)"
    return None


def shard_is_done(out_dir: Path, index: int, manifest: Any) -> bool:
    """A resume keeps shard ``index``: it passes every check above, its checksum included (any cache kind)."""
    return shard_problem(out_dir, index, manifest, checksums=True) is None


def read_header(path: Path) -> tuple[bytes, int]:
    """A safetensors file's header bytes (length prefix included) and the file size they imply.

    Reads ``8 + header length`` bytes, nothing of the tensor data. ValueError for a header that cannot be
    parsed (too short, absurd length, not JSON, no data offsets)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        prefix = os.pread(fd, 8, 0)
        if len(prefix) != 8:
            raise ValueError(f"{len(prefix)} bytes, shorter than the 8-byte length prefix")
        (length,) = struct.unpack("<Q", prefix)
        if length > _MAX_HEADER_BYTES:
            raise ValueError(f"header length {length} is not plausible")
        text = os.pread(fd, length, 8)
    finally:
        os.close(fd)
    if len(text) != length:
        raise ValueError(f"the header is cut short: {len(text)} of {length} bytes")
    try:
        entries = json.loads(text)
        ends = [int(entry["data_offsets"][1]) for name, entry in entries.items() if name != "__metadata__"]
    except (ValueError, KeyError, TypeError, IndexError, AttributeError) as error:
        raise ValueError(f"not a safetensors header: {error}") from None
    return prefix + text, 8 + length + max(ends, default=0)
