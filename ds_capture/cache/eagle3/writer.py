"""EAGLE-3 cache writer: NeMo's format v2 files, written atomically, resumable, with our completion record.

In: an output directory, the run's ``Eagle3Manifest`` and CPU tensors. Out, in NeMo's order:
``write_target_embeddings`` (fp32 ``weight``), ``write_eagle3_manifest`` (once, before any shard),
shards (``Eagle3Shards``: rows written in place by the shared ``AsyncShardWriter``),
then ``write_complete`` (``.ds_capture/complete.json``) after every rank has finished. Every file goes
through the common ``write_atomic`` / ``save_file`` or the in-place ``ShardFile``, and each shard
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
from ds_capture.cache.common.names import BOOKKEEPING_DIR, MANIFEST_NAME
from ds_capture.cache.common.output_dir import prepare_shards, refuse_foreign_entries, refuse_identity_mismatch
from ds_capture.cache.eagle3.format import (
    COMPLETE_NAME,
    EAGLE3_FORMAT_VERSION,
    EMBEDDINGS_NAME,
    Eagle3Manifest,
)

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
        refuse_identity_mismatch(out_dir, existing, manifest, what="EAGLE-3 cache", skip=skip)
        return existing
    if out_dir.exists():
        refuse_foreign_entries(out_dir, {EMBEDDINGS_NAME})
    return None


def prepare_eagle3_output_dir(out_dir: Path, manifest: Eagle3Manifest, *, restart: bool,
                              skip: tuple[str, ...] = ()) -> set[int]:
    """Check (``skip`` aside), create the directory, clear stale ``.tmp`` files; the shards already done.

    Call it holding the directory's lock. ``restart`` keeps the checks but returns an empty set.
    """
    out_dir = Path(out_dir)
    existing = check_eagle3_output_dir(out_dir, manifest, skip=skip)
    return prepare_shards(out_dir, manifest, existing, restart=restart,
                          is_complete=lambda: is_complete(out_dir, manifest))


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
