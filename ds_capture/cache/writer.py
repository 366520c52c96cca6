"""Cache writer: atomic, staged, resumable writes of the DSpark v1 cache (DESIGN.md §3).

In: an output directory, the run's ``Manifest`` and CPU tensors. Out: files under their final
names only once complete (``<name>.tmp`` + fsync + ``os.replace``), in the contract's order:
``write_target_weights``, ``write_manifest`` (complete false), ``write_shard`` per shard, then
``write_manifest`` (complete true) after every rank has finished.

``prepare_output_dir`` runs first, on rank 0 only: it refuses a directory that holds another
run's cache or foreign files (touching nothing), and otherwise returns the shards a killed run
already finished. A shard counts as finished only if its sha256 matches the sidecar recorded in
``.ds_capture/checksums/`` right after it was renamed into place.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors import SafetensorError
from safetensors.torch import save_file as _save_file

from ds_capture.cache.format import (
    BOOKKEEPING_DIR,
    CHECKSUMS_DIR,
    DTYPES,
    MANIFEST_NAME,
    TARGET_WEIGHTS_NAME,
    Manifest,
    checksum_name,
    shard_name,
)
from ds_capture.errors import CaptureError

TMP_SUFFIX = ".tmp"
_MAX_LISTED = 5


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
    """Call ``write(tmp)`` on ``<name>.tmp``, fsync it, rename it over ``path``; never a partial ``path``."""
    tmp = path.with_name(path.name + TMP_SUFFIX)
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    # The rename itself is durable only once the directory entry is flushed.
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def sha256_file(path: Path, chunk_bytes: int = 1 << 24) -> str:
    """Hex sha256 of a file, read in chunks (memory bounded for multi-GB shards)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


def checksum_path(out_dir: Path, index: int) -> Path:
    return out_dir / BOOKKEEPING_DIR / CHECKSUMS_DIR / checksum_name(index)


def read_recorded_checksum(out_dir: Path, index: int) -> str | None:
    """The sha256 recorded when shard ``index`` was written, or None if there is no record."""
    try:
        text = checksum_path(out_dir, index).read_text(encoding="utf-8")
    except (FileNotFoundError, NotADirectoryError):
        return None
    return text.split()[0] if text.split() else None


def check_output_dir(out_dir: Path, manifest: Manifest) -> Manifest | None:
    """Read-only check of ``out_dir``; returns its existing manifest (same identity) or None.

    Refuses (CaptureError, nothing written or deleted) a manifest of a different identity and a
    non-empty directory without a manifest that holds files this writer could not have made.
    """
    out_dir = Path(out_dir)
    manifest_path = out_dir / MANIFEST_NAME
    if manifest_path.is_file():
        existing = Manifest.from_json(manifest_path.read_text(encoding="utf-8"), str(manifest_path))
        _refuse_identity_mismatch(out_dir, existing, manifest)
        return existing
    if out_dir.exists():
        _refuse_foreign_entries(out_dir)
    return None


def prepare_output_dir(out_dir: Path, manifest: Manifest, *, restart: bool = False) -> set[int]:
    """Check ``out_dir`` (``check_output_dir``), then clear stale ``.tmp`` files; return the shards already done.

    Call it holding the directory's lock: the ``.tmp`` files of a running job are not stale.
    ``restart`` keeps the checks but returns an empty set, so every shard is recomputed.
    """
    out_dir = Path(out_dir)
    existing = check_output_dir(out_dir, manifest)
    out_dir.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmp(out_dir)
    if existing is None or restart:
        return set()
    if existing.complete:
        return set(range(manifest.num_shards))
    return {i for i in range(manifest.num_shards) if _shard_is_done(out_dir, i, manifest)}


def _refuse_identity_mismatch(out_dir: Path, existing: Manifest, manifest: Manifest) -> None:
    differing = existing.identity_diff(manifest)
    if not differing:
        return
    details = "; ".join(
        f"{name} is {_show(getattr(existing, name))} there, {_show(getattr(manifest, name))} in this run"
        for name in differing
    )
    raise CaptureError(
        f"{out_dir} holds a different cache: {details}. Use a new cache_output_dir or delete "
        f"{out_dir} to recompute it (nothing in it was changed)."
    )


def _show(value: object) -> str:
    if isinstance(value, tuple):
        return str(list(value))
    return repr(value) if isinstance(value, str) or value is None else str(value)


def _refuse_foreign_entries(out_dir: Path) -> None:
    """Only our own pre-manifest files may sit in a directory that has no manifest yet."""
    if not out_dir.is_dir():
        raise CaptureError(f"cache_output_dir {out_dir} exists and is not a directory; choose another path.")
    own = {TARGET_WEIGHTS_NAME, BOOKKEEPING_DIR}
    foreign = sorted(e.name for e in out_dir.iterdir() if e.name not in own and not e.name.endswith(TMP_SUFFIX))
    if foreign:
        listed = ", ".join(foreign[:_MAX_LISTED])
        if len(foreign) > _MAX_LISTED:
            listed += f" (and {len(foreign) - _MAX_LISTED} more)"
        raise CaptureError(
            f"cache_output_dir {out_dir} is not empty and holds no ds_capture/NeMo cache manifest "
            f"({MANIFEST_NAME}): it contains {listed}. Use a new or empty cache_output_dir."
        )


def _remove_stale_tmp(out_dir: Path) -> None:
    # A .tmp is never final data: it is what a killed run was writing when it died.
    checksums = out_dir / BOOKKEEPING_DIR / CHECKSUMS_DIR
    for directory in (out_dir, checksums):
        if directory.is_dir():
            for entry in directory.iterdir():
                if entry.name.endswith(TMP_SUFFIX) and entry.is_file():
                    entry.unlink()


def _shard_is_done(out_dir: Path, index: int, manifest: Manifest) -> bool:
    """Final name, readable header with exactly the expected tensors, and the recorded sha256."""
    path = out_dir / shard_name(index)
    recorded = read_recorded_checksum(out_dir, index)
    if not path.is_file() or recorded is None:
        return False
    try:
        with safe_open(path, framework="pt") as f:
            found = {key: (tuple(f.get_slice(key).get_shape()), f.get_slice(key).get_dtype()) for key in f.keys()}
    except Exception:  # any unreadable header means "recompute", whatever safetensors raises
        return False
    expected_tensors = manifest.expected_shard_tensors(index).items()
    expected = {key: (shape, _SAFETENSORS_DTYPE[dtype]) for key, (shape, dtype) in expected_tensors}
    return found == expected and sha256_file(path) == recorded


# safetensors' header names for the dtypes a cache may hold.
_SAFETENSORS_DTYPE = {torch.int64: "I64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}


def write_target_weights(out_dir: Path, embed_tokens: torch.Tensor, lm_head: torch.Tensor, dtype: str) -> None:
    """Write ``target_weights.safetensors``: both [V, H] full tensors in the cache dtype."""
    if embed_tokens.dim() != 2 or embed_tokens.shape != lm_head.shape:
        raise ValueError(
            f"embed_tokens {tuple(embed_tokens.shape)} and lm_head {tuple(lm_head.shape)} must both be [vocab, hidden]"
        )
    # clone(): tied embeddings share storage, which safetensors refuses to save.
    tensors = {
        "embed_tokens.weight": embed_tokens.detach().to("cpu", DTYPES[dtype]).contiguous().clone(),
        "lm_head.weight": lm_head.detach().to("cpu", DTYPES[dtype]).contiguous().clone(),
    }
    write_atomic(Path(out_dir) / TARGET_WEIGHTS_NAME, lambda tmp: save_file(tensors, tmp))


def write_manifest(out_dir: Path, manifest: Manifest) -> None:
    """Write ``manifest.json`` atomically (NeMo's formatting: sorted keys, indent 2, no newline)."""
    text = manifest.to_json()
    write_atomic(Path(out_dir) / MANIFEST_NAME, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def write_shard(out_dir: Path, index: int, tensors: dict[str, torch.Tensor], manifest: Manifest) -> int:
    """Write shard ``index`` atomically, then its sha256 sidecar; return the shard's size in bytes.

    A tensor with the wrong name, shape, dtype, device or layout is a program bug: ValueError.
    """
    out_dir = Path(out_dir)
    _check_shard_tensors(index, tensors, manifest)
    path = out_dir / shard_name(index)
    digest: list[str] = []

    def write(tmp: Path) -> None:
        save_file(tensors, tmp)
        # Hash the bytes that will be renamed into place, before anything can replace them.
        digest.append(sha256_file(tmp))

    write_atomic(path, write)
    sidecar = checksum_path(out_dir, index)
    sidecar.parent.mkdir(parents=True, exist_ok=True)
    line = f"{digest[0]}  {shard_name(index)}\n"  # sha256sum's format, so `sha256sum -c` can check it
    write_atomic(sidecar, lambda tmp: tmp.write_text(line, encoding="utf-8"))
    return path.stat().st_size


def _check_shard_tensors(index: int, tensors: dict[str, torch.Tensor], manifest: Manifest) -> None:
    expected = manifest.expected_shard_tensors(index)
    if set(tensors) != set(expected):
        raise ValueError(f"shard {index}: tensors {sorted(tensors)}, expected exactly {sorted(expected)}")
    for key, (shape, dtype) in expected.items():
        t = tensors[key]
        if tuple(t.shape) != shape or t.dtype != dtype:
            raise ValueError(
                f"shard {index}: {key} is {tuple(t.shape)} {t.dtype}, the manifest expects {shape} {dtype}"
            )
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(
                f"shard {index}: {key} must be a contiguous CPU tensor (is {t.device}, contiguous={t.is_contiguous()})"
            )
