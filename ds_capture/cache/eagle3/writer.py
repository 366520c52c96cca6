"""EAGLE-3 cache writer: NeMo's format v2 files, written atomically, resumable, with our completion record.

In: an output directory, the run's ``Eagle3Manifest`` and CPU tensors. Out, in NeMo's order:
``write_target_embeddings`` (fp32 ``weight``), ``write_eagle3_manifest`` (once, before any shard),
shards (``Eagle3Shards``: rows written in place by the shared ``AsyncShardWriter``),
then ``write_complete`` (``.ds_capture/complete.json``) after every rank has finished. Every file goes
through the DSpark writer's ``write_atomic`` / ``save_file`` or its in-place ``ShardFile``, and each shard
gets the same tagged checksum sidecar under ``.ds_capture/checksums/`` right after its rename.

``check_eagle3_output_dir`` (read-only) refuses a foreign directory, a DSpark cache, or a manifest of
another identity; ``prepare_eagle3_output_dir`` (holding the lock) clears stale ``.tmp`` files and
returns the shards already done: all of them when ``complete.json`` names this manifest, otherwise
each shard whose header and recorded sha256 check out.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from ds_capture.cache.common.files import ManifestShards, save_file, write_atomic
from ds_capture.durable import TMP_SUFFIX
from ds_capture.cache.common.names import BOOKKEEPING_DIR, CHECKSUMS_DIR, MANIFEST_NAME
from ds_capture.cache.common.rerun_check import shard_is_done
from ds_capture.cache.eagle3.format import (
    COMPLETE_NAME,
    EAGLE3_FORMAT_VERSION,
    EMBEDDINGS_NAME,
    Eagle3Manifest,
)
from ds_capture.errors import CaptureError

_MAX_LISTED = 5
VOCAB_FIELDS = ("draft_vocab_size", "selected_token_ids")
"""Known only after the counting pass: compared in the second identity check."""


def read_eagle3_manifest(out_dir: Path) -> Eagle3Manifest | None:
    path = Path(out_dir) / MANIFEST_NAME
    if not path.is_file():
        return None
    return Eagle3Manifest.from_json(path.read_text(encoding="utf-8"), str(path))


def check_eagle3_output_dir(out_dir: Path, manifest: Eagle3Manifest, *, skip: tuple[str, ...] = ()) -> Eagle3Manifest | None:
    """Read-only check; returns the existing manifest (same identity, ``skip`` fields aside) or None."""
    out_dir = Path(out_dir)
    existing = read_eagle3_manifest(out_dir)
    if existing is not None:
        differing = [name for name in existing.identity_diff(manifest) if name not in skip]
        if differing:
            details = "; ".join(f"{name} is {_show(getattr(existing, name))} there, "
                                f"{_show(getattr(manifest, name))} in this run" for name in differing)
            raise CaptureError(
                f"{out_dir} holds a different EAGLE-3 cache: {details}. Use a new cache_output_dir or delete "
                f"{out_dir} to recompute it (nothing in it was changed).")
        return existing
    if out_dir.exists():
        _refuse_foreign_entries(out_dir)
    return None


def prepare_eagle3_output_dir(out_dir: Path, manifest: Eagle3Manifest, *, restart: bool,
                              skip: tuple[str, ...] = ()) -> set[int]:
    """Check (``skip`` aside), create the directory, clear stale ``.tmp`` files; the shards already done.

    Call it holding the directory's lock. ``restart`` keeps the checks but returns an empty set.
    """
    out_dir = Path(out_dir)
    existing = check_eagle3_output_dir(out_dir, manifest, skip=skip)
    out_dir.mkdir(parents=True, exist_ok=True)
    for directory in (out_dir, out_dir / BOOKKEEPING_DIR, out_dir / BOOKKEEPING_DIR / CHECKSUMS_DIR):
        if directory.is_dir():  # a .tmp is what a killed run was writing when it died
            for entry in directory.iterdir():
                if entry.name.endswith(TMP_SUFFIX) and entry.is_file():
                    entry.unlink()
    if existing is None or restart:
        return set()
    if is_complete(out_dir, manifest):
        return set(range(manifest.num_shards))
    return {index for index in range(manifest.num_shards) if shard_is_done(out_dir, index, manifest)}


def _show(value: object) -> str:
    if isinstance(value, tuple):
        text = str(list(value))
        return text if len(text) <= 80 else text[:77] + "...]"
    return repr(value) if isinstance(value, str) or value is None else str(value)


def _refuse_foreign_entries(out_dir: Path) -> None:
    if not out_dir.is_dir():
        raise CaptureError(f"cache_output_dir {out_dir} exists and is not a directory; choose another path.")
    own = {EMBEDDINGS_NAME, BOOKKEEPING_DIR}
    foreign = sorted(e.name for e in out_dir.iterdir() if e.name not in own and not e.name.endswith(TMP_SUFFIX))
    if foreign:
        listed = ", ".join(foreign[:_MAX_LISTED]) + (f" (and {len(foreign) - _MAX_LISTED} more)"
                                                     if len(foreign) > _MAX_LISTED else "")
        raise CaptureError(
            f"cache_output_dir {out_dir} is not empty and holds no cache manifest ({MANIFEST_NAME}): it contains "
            f"{listed}. Use a new or empty cache_output_dir.")


# -- files ------------------------------------------------------------------------------------


def write_target_embeddings(out_dir: Path, weight: torch.Tensor) -> None:
    """``target_embeddings.safetensors``: the input embedding table [V, H] as fp32 ``weight`` (NeMo's file)."""
    tensors = {"weight": weight.detach().to("cpu", torch.float32).contiguous().clone()}
    write_atomic(Path(out_dir) / EMBEDDINGS_NAME, lambda tmp: save_file(tensors, tmp))


def write_eagle3_manifest(out_dir: Path, manifest: Eagle3Manifest) -> None:
    text = manifest.to_json()
    write_atomic(Path(out_dir) / MANIFEST_NAME, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def write_bookkeeping(out_dir: Path, name: str, record: dict) -> None:
    """A JSON record under ``.ds_capture/`` (``run.json``: producer and inputs; never in NeMo's manifest)."""
    path = Path(out_dir) / BOOKKEEPING_DIR / name
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(record, indent=2, sort_keys=True)
    write_atomic(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def read_bookkeeping(out_dir: Path, name: str) -> dict | None:
    path = Path(out_dir) / BOOKKEEPING_DIR / name
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (FileNotFoundError, NotADirectoryError, json.JSONDecodeError):
        return None


def _manifest_sha256(out_dir: Path) -> str:
    return hashlib.sha256((Path(out_dir) / MANIFEST_NAME).read_bytes()).hexdigest()


def write_complete(out_dir: Path, manifest: Eagle3Manifest) -> None:
    """Our completion record: every shard is written and checked in; names the manifest's bytes."""
    write_bookkeeping(out_dir, COMPLETE_NAME, {"format_version": EAGLE3_FORMAT_VERSION,
                                               "manifest_sha256": _manifest_sha256(out_dir),
                                               "num_shards": manifest.num_shards})


def is_complete(out_dir: Path, manifest: Eagle3Manifest) -> bool:
    """``complete.json`` exists and names exactly this manifest file and shard count."""
    record = read_bookkeeping(out_dir, COMPLETE_NAME)
    return (record is not None and (Path(out_dir) / MANIFEST_NAME).is_file()
            and record.get("manifest_sha256") == _manifest_sha256(out_dir)
            and record.get("num_shards") == manifest.num_shards)


class Eagle3Shards(ManifestShards):
    """The EAGLE-3 v2 shards: ``aux_hidden_states`` is written up to each row's real length only (0 on padding,
    as a hole); every other tensor row is written whole (``target_probs`` holds the uniform filler past the
    content, ``attention_mask`` / ``input_ids`` their own values)."""

    zero_tail = frozenset({"aux_hidden_states"})
