"""Cache writer: atomic, staged, resumable writes of the DSpark v1 cache (DESIGN.md §3).

In: an output directory, the run's ``Manifest`` and CPU tensors. Out: files under their final
names only once complete (``<name>.tmp`` + fsync + ``os.replace``), in the contract's order:
``write_target_weights``, ``write_manifest`` (complete false), ``write_shard`` per shard, then
``write_manifest`` (complete true) after every rank has finished.

Shards are written in place (:mod:`ds_capture.cache.common.shard_file`): :class:`DSparkShards` is the DSpark
shard kind the capture loop drives (``open`` a shard, ``write_rows`` as micro-batches complete,
``finish``); its hidden-state tensors are sparse (each row's padded tail is a hole). ``write_shard``
writes a whole in-memory shard through the same path.

``prepare_output_dir`` runs first, on rank 0 only: it refuses a directory that holds another
run's cache or foreign files (touching nothing), and otherwise returns the shards a killed run
already finished. A shard counts as finished only if its checksum matches the sidecar recorded in
``.ds_capture/checksums/`` right after it was renamed into place. A sidecar names its algorithm
(``xxh3-128-rows:<hex>``, computed from the rows as written); sidecars of earlier versions
(``shard-NNNNNN.sha256``: the file's plain sha256) still verify.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

import torch

from ds_capture.cache.common.files import ManifestShards, save_file, write_atomic
from ds_capture.cache.common.names import DTYPES, MANIFEST_NAME, shard_name
from ds_capture.cache.common.output_dir import prepare_shards, refuse_foreign_entries, refuse_identity_mismatch
from ds_capture.cache.common.shard_file import SafetensorsLayout, ShardFile
from ds_capture.cache.dspark.format import TARGET_WEIGHTS_NAME, Manifest



def check_output_dir(out_dir: Path, manifest: Manifest) -> Manifest | None:
    """Read-only check of ``out_dir``; returns its existing manifest (same identity) or None.

    Refuses (CaptureError, nothing written or deleted) a manifest of a different identity and a
    non-empty directory without a manifest that holds files this writer could not have made.
    """
    out_dir = Path(out_dir)
    manifest_path = out_dir / MANIFEST_NAME
    if manifest_path.is_file():
        existing = Manifest.from_json(manifest_path.read_text(encoding="utf-8"), str(manifest_path))
        refuse_identity_mismatch(out_dir, existing, manifest)
        return existing
    if out_dir.exists():
        refuse_foreign_entries(out_dir, {TARGET_WEIGHTS_NAME})
    return None


def prepare_output_dir(out_dir: Path, manifest: Manifest, *, restart: bool = False) -> set[int]:
    """Check ``out_dir`` (``check_output_dir``), then clear stale ``.tmp`` files; return the shards already done.

    Call it holding the directory's lock: the ``.tmp`` files of a running job are not stale.
    ``restart`` keeps the checks but returns an empty set, so every shard is recomputed.
    """
    out_dir = Path(out_dir)
    existing = check_output_dir(out_dir, manifest)
    return prepare_shards(out_dir, manifest, existing, restart=restart,
                          is_complete=lambda: existing is not None and existing.complete)


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


class DSparkShards(ManifestShards):
    """The DSpark v1 shards (DESIGN §3): both hidden-state tensors are zero on padding, so their tails are holes."""

    zero_tail = frozenset({"target_hidden_states", "target_last_hidden_states"})


def write_shard(out_dir: Path, index: int, tensors: Mapping[str, torch.Tensor], manifest: Manifest) -> int:
    """Write a whole in-memory shard ``index`` (atomically, dense), then its sidecar; return its size in bytes.

    A tensor with the wrong name, shape, dtype, device or layout is a program bug: ValueError.
    """
    _check_shard_tensors(index, tensors, manifest)
    kind = DSparkShards(out_dir, manifest)
    shard = ShardFile(Path(out_dir) / shard_name(index),
                      SafetensorsLayout.build(manifest.expected_shard_tensors(index)))
    try:
        n, S = manifest.shard_rows(index), manifest.seq_length
        shard.write_rows(torch.arange(n), tensors, torch.full((n,), S))
    except BaseException:
        shard.abort()
        raise
    return kind.finish(index, shard).logical_bytes


def _check_shard_tensors(index: int, tensors: Mapping[str, torch.Tensor], manifest: Manifest) -> None:
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
