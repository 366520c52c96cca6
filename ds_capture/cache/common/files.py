"""Files both cache kinds write the same way: atomic writes (``<name>.tmp`` renamed over the name), checksum
sidecars, and the manifest-driven shard writer the kinds specialise (a finished shard's test is
:func:`ds_capture.cache.common.rerun_check.shard_is_done`).

In: paths, tensors, a kind's manifest (its ``shard_layout``). Out: files on disk, fsynced.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file as _save_file

from ds_capture.cache.common.names import (
    BOOKKEEPING_DIR,
    CHECKSUMS_DIR,
    NUMERICS_NAME,
    RUN_COMMAND_NAME,
    SKIPPED_ROWS_NAME,
    checksum_name,
    legacy_checksum_name,
    shard_name,
)
from ds_capture.cache.common.shard_file import ROWS_DIGEST, SafetensorsLayout, ShardFile, file_digest
from ds_capture import durable
from ds_capture.capture.liveness import refuse_if_frozen


def save_file(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """``safetensors.torch.save_file`` whose I/O failures surface as ``OSError`` (with errno and path).

    safetensors reports a full disk as ``SafetensorError("... No space left on device (os error 28)")``;
    the runner turns an ``OSError`` into a clear message, so the errno is recovered here.
    """
    try:
        _save_file(tensors, path)
    except SafetensorError as error:
        found = re.search(r"\(os error (\d+)\)", str(error))
        if found is None:
            raise
        code = int(found.group(1))
        raise OSError(code, os.strerror(code), str(path)) from error


def write_atomic(path: Path, write: Callable[[Path], None]) -> None:
    """Call ``write(tmp)`` on ``<name>.tmp``, fsync it, rename it over ``path``; never a partial ``path``.

    A rank woken after its peers gave up (a writer thread frozen mid-shard resumes on SIGCONT) neither starts a
    file nor renames one into place (:func:`~ds_capture.capture.liveness.refuse_if_frozen`)."""
    durable.write_atomic(path, write, check=refuse_if_frozen)


def sha256_file(path: Path, chunk_bytes: int = 1 << 24) -> str:
    """Hex sha256 of a file, read in chunks (memory bounded for multi-GB shards)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


def checksum_path(out_dir: Path, index: int) -> Path:
    return Path(out_dir) / BOOKKEEPING_DIR / CHECKSUMS_DIR / checksum_name(index)


def read_recorded_checksum(out_dir: Path, index: int) -> str | None:
    """The tagged checksum recorded when shard ``index`` was written (``algorithm:hex``), or None.

    A sidecar of an earlier version (``shard-NNNNNN.sha256`` in sha256sum's format) reads as ``sha256:<hex>``.
    """
    checksums = Path(out_dir) / BOOKKEEPING_DIR / CHECKSUMS_DIR
    for name, legacy in ((checksum_name(index), False), (legacy_checksum_name(index), True)):
        try:
            words = (checksums / name).read_text(encoding="utf-8").split()
        except (FileNotFoundError, NotADirectoryError):
            continue
        if not words:
            return None
        return f"sha256:{words[0]}" if legacy else words[0]
    return None


def file_checksum(path: Path, algorithm: str) -> str:
    """The tagged checksum of the file at ``path`` under ``algorithm`` (``xxh3-128-rows`` or ``sha256``)."""
    if algorithm == "sha256":
        return f"sha256:{sha256_file(path)}"
    if algorithm == ROWS_DIGEST:
        return file_digest(path)
    raise ValueError(f"unknown checksum algorithm {algorithm!r}")


def checksum_matches(path: Path, recorded: str) -> bool:
    """Whether the file at ``path`` still has the ``recorded`` tagged checksum (any known algorithm)."""
    try:
        return file_checksum(path, recorded.partition(":")[0]) == recorded
    except ValueError:  # a damaged header or an unknown algorithm: not the file that was recorded
        return False


def write_checksum_sidecar(out_dir: Path, index: int, checksum: str) -> None:
    """Record shard ``index``'s tagged checksum (atomically); drops an earlier version's sha256 sidecar."""
    sidecar = checksum_path(out_dir, index)
    refuse_if_frozen()  # a rank woken after its peers gave up creates nothing, not even the directory
    sidecar.parent.mkdir(parents=True, exist_ok=True)
    line = f"{checksum}  {shard_name(index)}\n"
    write_atomic(sidecar, lambda tmp: tmp.write_text(line, encoding="utf-8"))
    (sidecar.parent / legacy_checksum_name(index)).unlink(missing_ok=True)


@dataclass(frozen=True)
class WrittenShard:
    """What writing one shard cost: its logical size, the bytes actually written, its blocks on disk."""

    index: int
    logical_bytes: int
    bytes_written: int
    disk_bytes: int
    """``st_blocks * 512`` of the final file: below ``logical_bytes`` where the padding tails are holes."""


class ManifestShards:
    """Shards laid out from a manifest's ``expected_shard_tensors`` / ``shard_rows``, as the capture loop drives
    them (``async_writer.ShardKind``): ``open``, rows, ``finish``.

    ``open(index)`` returns a :class:`ShardFile`; its ``zero_tail`` tensors are written up to each row's real
    length only (the padded tail stays a hole). ``finish`` renames the shard into place and records its
    checksum sidecar. Each cache kind names its zero-tail tensors (:class:`DSparkShards`, ``Eagle3Shards``).
    """

    zero_tail: frozenset[str] = frozenset()

    def __init__(self, out_dir: Path, manifest: Any) -> None:
        self.out_dir = Path(out_dir)
        self.manifest = manifest

    def rows(self, index: int) -> int:
        return self.manifest.shard_rows(index)

    def open(self, index: int) -> ShardFile:
        layout = SafetensorsLayout.build(self.manifest.expected_shard_tensors(index))
        return ShardFile(self.out_dir / shard_name(index), layout, zero_tail=self.zero_tail)

    def finish(self, index: int, shard: ShardFile) -> WrittenShard:
        checksum = shard.finish()
        write_checksum_sidecar(self.out_dir, index, checksum)
        stat = shard.path.stat()
        return WrittenShard(index=index, logical_bytes=stat.st_size, bytes_written=shard.bytes_written,
                            disk_bytes=stat.st_blocks * 512)


def write_run_command(out_dir: Path, argv: list[str]) -> None:
    """``.ds_capture/run_command.json``: the ``ds-capture run`` command line that writes this cache and the
    directory it was given, from which ``verify`` builds each problem's repair."""
    record = {"argv": list(argv), "cache_output_dir": str(Path(out_dir).resolve())}
    _write_bookkeeping_json(out_dir, RUN_COMMAND_NAME, record)


def write_numerics(out_dir: Path, numerics: dict) -> None:
    """``.ds_capture/numerics.json``: the numerics the cache's shards are computed with (:func:`run_numerics`);
    a rerun over the cache continues with them (``ds_capture.cache.common.identity.continue_numerics``)."""
    _write_bookkeeping_json(out_dir, NUMERICS_NAME, dict(numerics))


def read_numerics(out_dir: Path) -> dict | None:
    """The record :func:`write_numerics` left in ``out_dir``, or None (none yet, a cache of an earlier version, one
    NeMo wrote, or an unreadable record)."""
    try:
        record = json.loads((Path(out_dir) / BOOKKEEPING_DIR / NUMERICS_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def run_numerics(*, compute_dtype: str, device: str, engine: str, cpu_threads: int | None,
                 chunk_tokens: int | None = None) -> dict:
    """The numerics record of a run: ``cpu_threads`` None where the forward runs on a GPU (it changes no bit);
    ``chunk_tokens`` the chunked prefill's chunk (None: whole rows, as every cache recorded before it existed)."""
    return {"compute_dtype": compute_dtype, "device": device, "engine": engine, "cpu_threads": cpu_threads,
            "chunk_tokens": chunk_tokens}


def describe_numerics(numerics: dict | None) -> str:
    """One phrase for verify and inspect: ``compute fp32 on cpu, 2 CPU threads per rank, engine deepspeed``."""
    if not numerics:
        return f"not recorded (no {BOOKKEEPING_DIR}/{NUMERICS_NAME}: a cache of an earlier version, or NeMo's own)"
    threads = numerics.get("cpu_threads")
    where = (f"{threads} CPU thread{'s' * (threads != 1)} per rank" if isinstance(threads, int)
             else "CPU threads not part of them (GPU forward)")
    chunk = numerics.get("chunk_tokens")
    return (f"compute {numerics.get('compute_dtype', '?')} on {numerics.get('device', '?')}, {where}, "
            f"engine {numerics.get('engine', '?')}" + (f", rows in chunks of {chunk} tokens" if chunk else ""))


def write_skipped_rows(out_dir: Path, rows: list[dict]) -> None:
    """``.ds_capture/skipped_rows.json``: the dataset rows ``capture.invalid_rows: skip`` left out, and why."""
    _write_bookkeeping_json(out_dir, SKIPPED_ROWS_NAME, {"num_rows_skipped": len(rows), "rows": rows})


def _write_bookkeeping_json(out_dir: Path, name: str, record: dict) -> None:
    path = Path(out_dir) / BOOKKEEPING_DIR / name
    refuse_if_frozen()
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(record, indent=1) + "\n"
    write_atomic(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))
