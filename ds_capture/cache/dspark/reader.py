"""Cache reader: verify and inspect a DSpark v1 cache directory (DESIGN.md §3); EAGLE-3 v2 caches are
handed to :mod:`ds_capture.cache.eagle3.reader` (same reports).

In: a cache directory. Out: its ``Manifest`` (``read_manifest``); a ``VerifyReport`` listing every
way the directory breaks the contract (``verify_cache``); a summary dict and its human text
(``inspect_cache``, ``format_inspect``). Shards are read one at a time, so memory stays at one
shard whatever the cache size.

Padding rule. The pad id is not in the manifest, so it is inferred: among rows whose last two
tokens are equal, the most common last token is the pad id (rows truncated to S end in content,
so "the row's last token" alone would call their final token padding). A row's padding is then
the trailing run of that id. Limits: a cache in which no row ends in two equal tokens is taken to
have no padding; a row whose content really ends in the pad id has that token counted as padding.
Because NeMo keeps the first pad as content when pad == eos (and the manifest does not say
whether it is), ``loss_mask`` = 1 is allowed on the first position of the run and refused after.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from ds_capture.cache.common.files import describe_numerics, read_numerics
from ds_capture.cache.common.names import MANIFEST_NAME, shard_name
from ds_capture.cache.common.verify import (
    NEW_CACHE,
    RERUN,
    RESTART,
    VerifyReport,
    finish_report,
    new_report,
    human_bytes,
    layout_mismatch,
    load_checked_shard,
    load_tensors,
    load_whole_file,
    padding_lengths,
    read_manifest_text,
    shard_indices,
    value_problem_repair,
    verify_shards,
)
from ds_capture.cache.dspark.format import IDENTITY_FIELDS, TARGET_WEIGHTS_NAME, Manifest
from ds_capture.errors import CaptureError

_MAX_LISTED = 10


def read_manifest(cache_dir: Path) -> Manifest:
    """Parse ``cache_dir/manifest.json``; CaptureError naming the path if missing or unreadable."""
    text, path = read_manifest_text(cache_dir, f"{cache_dir} is not a ds_capture/NeMo DSpark cache, or the run "
                                    "that writes it has not started. Check the path (cache_output_dir of the run).")
    return Manifest.from_json(text, path)


def verify_dspark_cache(cache_dir: Path, *, checksums: bool = False) -> VerifyReport:
    """Check every contract rule on the DSpark cache ``cache_dir``; ``checksums`` also re-hashes each shard."""
    cache_dir = Path(cache_dir)
    report = new_report(cache_dir, checksums=checksums)
    try:
        manifest = read_manifest(cache_dir)
    except CaptureError as err:
        # No manifest: the run never started (a run writes it); one that does not parse ties nothing to a run.
        report.add(str(err), RERUN if not (cache_dir / MANIFEST_NAME).exists() else NEW_CACHE)
        return finish_report(report)
    report.num_samples, report.num_shards = manifest.num_samples, manifest.num_shards
    if not manifest.complete:
        report.add(
            f"{MANIFEST_NAME} has complete: false: the run writing this cache has not finished (or was killed); "
            "re-run it with the same config to complete it", RERUN
        )
    consistency = manifest.consistency_problems()
    for problem in consistency:
        report.add(f"{MANIFEST_NAME}: {problem}", NEW_CACHE)
    if consistency:
        return finish_report(report)

    def infer_pad_id(indices: list[int]) -> None:
        report.pad_id = _infer_pad_id(cache_dir, indices)

    verify_shards(cache_dir, manifest.num_shards, report,
                  lambda index: _verify_shard(cache_dir, index, manifest, report), checksums=checksums,
                  before=infer_pad_id)
    _verify_weights(cache_dir, manifest, report)
    return finish_report(report)


def _infer_pad_id(cache_dir: Path, indices: list[int]) -> int | None:
    """The most common last token among rows ending in two equal tokens (see module docstring)."""
    votes: Counter[int] = Counter()
    for index in indices:
        try:
            input_ids = load_tensors(cache_dir / shard_name(index), ["input_ids"])["input_ids"]
        except (OSError, ValueError, KeyError):  # an unreadable shard is reported by _verify_shard; it just does not vote
            continue
        if input_ids.dim() != 2 or input_ids.shape[1] < 2:
            continue
        padded = input_ids[:, -1] == input_ids[:, -2]
        votes.update(input_ids[padded, -1].tolist())
    return votes.most_common(1)[0][0] if votes else None


def _verify_shard(cache_dir: Path, index: int, manifest: Manifest, report: VerifyReport) -> None:
    """Value rules: a shard that breaks one was written so (or changed since: its checksum says which), and a
    rerun's header check keeps it, so the repair deletes it first."""
    name = shard_name(index)
    tensors = load_checked_shard(cache_dir, index, manifest, report)
    if tensors is None:
        return

    repair: list[str] = []  # decided at the first problem (it reads the shard's checksum)

    def fail(problem: str) -> None:
        repair[:] = repair or [value_problem_repair(cache_dir, index)]
        report.add(f"{name}: {problem}", repair[0], (name,))

    input_ids, loss_mask = tensors["input_ids"], tensors["loss_mask"]
    hidden, last = tensors["target_hidden_states"], tensors["target_last_hidden_states"]

    for key in ("target_hidden_states", "target_last_hidden_states"):
        bad = ~torch.isfinite(tensors[key])
        if bad.any():
            row, pos = bad.nonzero()[0][:2].tolist()
            fail(f"{key} holds {int(bad.sum())} non-finite values (NaN/inf), first at row {row} position {pos}")
    if not ((loss_mask == 0) | (loss_mask == 1)).all():
        values = sorted(set(loss_mask.unique().tolist()) - {0, 1})
        fail(f"loss_mask holds values other than 0/1: {values[:_MAX_LISTED]}")

    num_pad = padding_lengths(input_ids, report.pad_id)
    S = manifest.seq_length
    positions = torch.arange(S).expand_as(input_ids)
    # The first pad stays allowed: NeMo keeps it as content (eos) when pad == eos.
    strict_pad = positions > (S - num_pad).unsqueeze(-1)
    on_pad = (loss_mask != 0) & strict_pad
    if on_pad.any():
        row, pos = on_pad.nonzero()[0].tolist()
        fail(f"loss_mask is 1 on {int(on_pad.sum())} padding positions (pad id {report.pad_id}), "
             f"first at row {row} position {pos}")
    report.num_tokens += int((S - num_pad).sum())
    report.num_supervised_tokens += int(loss_mask.sum())

    if manifest.target_layer_ids[-1] == manifest.num_hidden_layers - 1:
        H = manifest.hidden_size
        if not torch.equal(hidden[..., -H:], last):
            fail(f"the last feature slice of target_hidden_states (layer {manifest.target_layer_ids[-1]}, "
                 "the post-norm output) differs from target_last_hidden_states")


def _verify_weights(cache_dir: Path, manifest: Manifest, report: VerifyReport) -> None:
    """A rerun writes the weights file again unless the cache is complete; ``--restart`` always does."""
    repair = RESTART if manifest.complete else RERUN
    tensors = load_whole_file(cache_dir, TARGET_WEIGHTS_NAME, report, repair)
    if tensors is None:
        return
    expected = manifest.expected_weight_tensors()
    if set(tensors) != set(expected):
        report.add(f"{TARGET_WEIGHTS_NAME}: holds tensors {sorted(tensors)}, expected exactly {sorted(expected)}",
                   repair)
        return
    for key, (shape, dtype) in expected.items():
        t = tensors[key]
        if tuple(t.shape) != shape or t.dtype != dtype:
            report.add(f"{TARGET_WEIGHTS_NAME}: {layout_mismatch(key, t, shape, dtype)}", repair)
        elif not torch.isfinite(t).all():
            report.add(f"{TARGET_WEIGHTS_NAME}: {key} holds non-finite values (NaN/inf)", repair)


def inspect_dspark_cache(cache_dir: Path) -> dict[str, Any]:
    """Counts, sizes (logical, on disk, padding fraction) and identity of a DSpark cache, reading only input_ids
    and loss_mask of each shard."""
    cache_dir = Path(cache_dir)
    manifest = read_manifest(cache_dir)
    present = sorted(shard_indices(cache_dir))
    pad_id = _infer_pad_id(cache_dir, present)
    num_tokens = num_supervised = 0
    for index in present:
        tensors = load_tensors(cache_dir / shard_name(index), ["input_ids", "loss_mask"])
        input_ids, loss_mask = tensors["input_ids"], tensors["loss_mask"]
        num_tokens += int((input_ids.shape[1] - padding_lengths(input_ids, pad_id)).sum())
        num_supervised += int(loss_mask.sum())
    files = [p for p in cache_dir.rglob("*") if p.is_file()]
    return {
        "cache_dir": str(cache_dir),
        "complete": manifest.complete,
        "format_version": manifest.format_version,
        "samples": manifest.num_samples,
        "shards": len(present),
        "expected_shards": manifest.num_shards,
        "shard_size": manifest.shard_size,
        "seq_length": manifest.seq_length,
        "tokens": num_tokens,
        "supervised_tokens": num_supervised,
        "pad_id": pad_id,
        "layers": list(manifest.target_layer_ids),
        "dtype": manifest.dtype,
        "logical_bytes": sum(p.stat().st_size for p in files),
        # Blocks actually allocated: shards' padding tails are holes (read as zeros, not stored).
        "bytes_on_disk": sum(p.stat().st_blocks * 512 for p in files),
        "padding_fraction": _padding_fraction(num_tokens, present, manifest),
        "identity": {
            name: list(v) if isinstance(v := getattr(manifest, name), tuple) else v for name in IDENTITY_FIELDS
        },
        "bookkeeping": dict(manifest.bookkeeping),
        "numerics": read_numerics(cache_dir),
    }


def _padding_fraction(num_tokens: int, present: list[int], manifest: Manifest) -> float:
    positions = sum(manifest.shard_rows(i) for i in present if i < manifest.num_shards) * manifest.seq_length
    return round(1 - num_tokens / positions, 6) if positions else 0.0


def format_dspark_inspect(info: dict[str, Any]) -> str:
    """Human text for ``inspect_dspark_cache``'s dict."""
    samples, tokens = info["samples"], info["tokens"]
    state = "complete" if info["complete"] else "INCOMPLETE"
    lines = [
        f"cache        {info['cache_dir']} ({state}, format v{info['format_version']})",
        f"samples      {samples} in {info['shards']}/{info['expected_shards']} shards of {info['shard_size']}",
        f"seq_length   {info['seq_length']}",
        f"tokens       {tokens} non-padding ({tokens / max(samples, 1):.1f} per sample), pad id {info['pad_id']}",
        f"supervised   {info['supervised_tokens']} ({info['supervised_tokens'] / max(tokens, 1):.1%} of tokens)",
        f"layers       {info['layers']} ({info['dtype']})",
        f"on disk      {human_bytes(info['bytes_on_disk'])} of {human_bytes(info['logical_bytes'])} logical "
        f"({info['padding_fraction']:.1%} of row positions are padding)",
        f"numerics     {describe_numerics(info.get('numerics'))}",
        "identity:",
    ]
    width = max(len(k) for k in info["identity"])
    lines += [f"  {k.ljust(width)}  {json.dumps(v)}" for k, v in info["identity"].items()]
    return "\n".join(lines)


