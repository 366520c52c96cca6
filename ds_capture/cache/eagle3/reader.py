"""Verify, inspect and compare EAGLE-3 v2 caches (ours or NeMo's own), one shard at a time.

In: cache directories whose manifest has ``format_version`` 2 (``reader`` and ``compare`` dispatch here).
Out: the DSpark reader's ``VerifyReport`` / inspect dict / ``CompareReport`` for the EAGLE-3 layout.

Completion: a directory our producer wrote (it has ``.ds_capture/``) is complete only with a
``complete.json`` naming its manifest; a NeMo-written one (no ``.ds_capture/``) is complete, as NeMo's
reader sees it, when every shard is present. Value rules checked per shard: 0/1 masks, ``attention_mask``
a prefix, ``position_mask`` implies ``loss_mask``, the zero-filled slot S-1, finite states, and
``target_probs`` rows that are distributions (top-k: sorted values, distinct draft-vocab indices).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from ds_capture.cache.common.files import describe_numerics, read_numerics
from ds_capture.cache.common.names import BOOKKEEPING_DIR, MANIFEST_NAME, shard_name
from ds_capture.cache.common.verify import (
    NEW_CACHE,
    RERUN,
    RESTART,
    CompareReport,
    KeyDiff,
    ShardDiff,
    VerifyReport,
    default_tolerance,
    diff_tensors,
    finish_report,
    human_bytes,
    load_checked_shard,
    load_tensors,
    load_whole_file,
    new_report,
    read_manifest_text,
    shard_indices,
    value_problem_repair,
    verify_shards,
)
from ds_capture.cache.eagle3.format import (
    COMPLETE_NAME,
    EMBEDDINGS_NAME,
    FIELD_NAMES,
    RUN_RECORD_NAME,
    Eagle3Manifest,
)
from ds_capture.cache.eagle3.writer import is_complete, read_bookkeeping
from ds_capture.errors import CaptureError

_SUM_TOLERANCE = {"fp32": 1e-4, "bf16": 3e-2, "fp16": 1e-2}
"""How far a stored row of target_probs(_values) may sum from 1 (rounding of Vd values to the cache dtype)."""
_SHAPE_FIELDS = ("num_samples", "shard_size", "seq_length", "dtype", "draft_vocab_size", "target_probs_topk",
                 "aux_hidden_dim", "target_vocab_size")


def is_eagle3_cache(cache_dir: Path) -> bool:
    """Whether ``cache_dir``'s manifest says format 2 (anything unreadable is left to the DSpark reader's errors)."""
    try:
        return json.loads((Path(cache_dir) / MANIFEST_NAME).read_text(encoding="utf-8")).get("format_version") == 2
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
        return False


def read_eagle3(cache_dir: Path) -> Eagle3Manifest:
    text, path = read_manifest_text(cache_dir, f"{cache_dir} is not an EAGLE-3 cache.")
    return Eagle3Manifest.from_json(text, path)


def completion(cache_dir: Path, manifest: Eagle3Manifest) -> tuple[bool, str]:
    """(complete, how that was decided)."""
    cache_dir = Path(cache_dir)
    if (cache_dir / BOOKKEEPING_DIR).is_dir():
        return is_complete(cache_dir, manifest), f"{BOOKKEEPING_DIR}/{COMPLETE_NAME}"
    present = shard_indices(cache_dir)
    return present >= set(range(manifest.num_shards)), "every shard present (NeMo's rule: no ds_capture records)"


def verify_eagle3_cache(cache_dir: Path, *, checksums: bool = False) -> VerifyReport:
    cache_dir = Path(cache_dir)
    report = new_report(cache_dir, checksums=checksums)
    try:
        manifest = read_eagle3(cache_dir)
    except (CaptureError, OSError, UnicodeDecodeError) as err:
        report.add(str(err), NEW_CACHE)
        return finish_report(report)
    report.num_samples, report.num_shards = manifest.num_samples, manifest.num_shards
    if consistency := manifest.consistency_problems():
        for problem in consistency:
            report.add(f"{MANIFEST_NAME}: {problem}", NEW_CACHE)
        return finish_report(report)
    complete, rule = completion(cache_dir, manifest)
    if not complete and (cache_dir / BOOKKEEPING_DIR).is_dir():
        report.add(f"{BOOKKEEPING_DIR}/{COMPLETE_NAME} is missing or names another manifest: the ds_capture run "
                   "writing this cache has not finished (or was killed); re-run it with the same config", RERUN)
    verify_shards(cache_dir, manifest.num_shards, report,
                  lambda index: _verify_shard(cache_dir, index, manifest, report), checksums=checksums)
    _verify_embeddings(cache_dir, manifest, report, complete=complete)
    return finish_report(report)


def _verify_shard(cache_dir: Path, index: int, manifest: Eagle3Manifest, report) -> None:
    """Value rules (a shard that breaks one keeps its header and size: the repair deletes it, a rerun
    recomputes it)."""
    name = shard_name(index)
    tensors = load_checked_shard(cache_dir, index, manifest, report)
    if tensors is None:
        return

    repair: list[str] = []  # decided at the first problem (it reads the shard's checksum)

    def fail(what: str, bad: torch.Tensor) -> None:
        if bad.any():
            row, pos = bad.nonzero()[0][:2].tolist()
            repair[:] = repair or [value_problem_repair(cache_dir, index)]
            report.add(f"{name}: {what} at {int(bad.sum())} positions, first at row {row} position {pos}",
                       repair[0], (name,))

    attention, loss, position = tensors["attention_mask"], tensors["loss_mask"], tensors["position_mask"][..., 0]
    for key in ("attention_mask", "loss_mask"):
        fail(f"{key} is not 0/1", (tensors[key] != 0) & (tensors[key] != 1))
    fail("attention_mask is not a prefix of ones (1 after a 0)", attention[:, 1:] > attention[:, :-1])
    fail("position_mask is set where loss_mask is 0", position & (loss == 0))
    fail("loss_mask is 1 where the next position has attention_mask 0",
         (loss[:, :-1] == 1) & (attention[:, 1:] == 0))
    fail("the last slot (S-1) is not zero-filled (input_ids, loss_mask, position_mask)",
         ((tensors["input_ids"][:, -1] != 0) | (loss[:, -1] != 0) | position[:, -1])[:, None])
    fail("aux_hidden_states holds NaN/inf", ~torch.isfinite(tensors["aux_hidden_states"]).all(dim=-1))
    tolerance = _SUM_TOLERANCE[manifest.dtype]
    probs = tensors["target_probs_values" if manifest.compressed else "target_probs"].float()
    fail("target_probs holds values outside [0, 1] or NaN",
         ~((probs >= 0) & (probs <= 1)).all(dim=-1))
    fail(f"target_probs rows do not sum to 1 (tolerance {tolerance:g})", (probs.sum(dim=-1) - 1).abs() > tolerance)
    if manifest.compressed:
        indices = tensors["target_probs_indices"]
        fail("target_probs_values are not sorted descending", (probs[..., 1:] > probs[..., :-1]).any(dim=-1))
        fail(f"target_probs_indices outside 0..{manifest.draft_vocab_size - 1}",
             ((indices < 0) | (indices >= manifest.draft_vocab_size)).any(dim=-1))
        ordered = indices.sort(dim=-1).values
        fail("target_probs_indices repeat a column", (ordered[..., 1:] == ordered[..., :-1]).any(dim=-1))
    report.num_tokens += int(attention.sum())
    report.num_supervised_tokens += int(loss.sum())


def _verify_embeddings(cache_dir: Path, manifest: Eagle3Manifest, report, *, complete: bool) -> None:
    """A rerun writes the embeddings again unless the cache is complete; ``--restart`` always does."""
    repair = RESTART if complete else RERUN
    tensors = load_whole_file(cache_dir, EMBEDDINGS_NAME, report, repair,
                              " (NeMo's trainer seeds the draft's embed_tokens from it)")
    if tensors is None:
        return
    weight = tensors.get("weight")
    shape = (manifest.target_vocab_size, manifest.hidden_size)
    if set(tensors) != {"weight"} or tuple(weight.shape) != shape or weight.dtype != torch.float32:
        found = {k: (list(t.shape), str(t.dtype)) for k, t in tensors.items()}
        report.add(f"{EMBEDDINGS_NAME}: holds {found}, expected exactly weight {list(shape)} float32", repair)
    elif not torch.isfinite(weight).all():
        report.add(f"{EMBEDDINGS_NAME}: weight holds non-finite values (NaN/inf)", repair)


def inspect_eagle3_cache(cache_dir: Path) -> dict[str, Any]:
    cache_dir = Path(cache_dir)
    manifest = read_eagle3(cache_dir)
    present = sorted(shard_indices(cache_dir))
    tokens = supervised = positions = 0
    for index in present:
        masks = load_tensors(cache_dir / shard_name(index), ["attention_mask", "loss_mask", "position_mask"])
        tokens += int(masks["attention_mask"].sum())
        supervised += int(masks["loss_mask"].sum())
        positions += int(masks["position_mask"].sum())
    complete, rule = completion(cache_dir, manifest)
    identity = {name: list(v) if isinstance(v := getattr(manifest, name), tuple) else v for name in FIELD_NAMES}
    return {
        "kind": "eagle3", "cache_dir": str(cache_dir), "complete": complete, "completion_rule": rule,
        "format_version": 2, "samples": manifest.num_samples, "shards": len(present),
        "expected_shards": manifest.num_shards, "shard_size": manifest.shard_size, "seq_length": manifest.seq_length,
        "tokens": tokens, "supervised_tokens": supervised, "supervised_positions": positions,
        "layers": list(manifest.aux_layer_ids), "dtype": manifest.dtype,
        "draft_vocab_size": manifest.draft_vocab_size,
        "target_probs": f"top-{manifest.target_probs_topk}" if manifest.compressed else "full",
        "bytes_on_disk": sum(p.stat().st_size for p in cache_dir.rglob("*") if p.is_file()),
        "identity": identity, "bookkeeping": read_bookkeeping(cache_dir, RUN_RECORD_NAME) or {},
        "numerics": read_numerics(cache_dir),
    }


def format_eagle3_inspect(info: dict[str, Any]) -> str:
    samples, tokens = info["samples"], info["tokens"]
    lines = [
        f"cache        {info['cache_dir']} (EAGLE-3, {'complete' if info['complete'] else 'INCOMPLETE'} by "
        f"{info['completion_rule']}, format v2)",
        f"samples      {samples} in {info['shards']}/{info['expected_shards']} shards of {info['shard_size']}",
        f"seq_length   {info['seq_length']}",
        f"tokens       {tokens} with attention ({tokens / max(samples, 1):.1f} per sample)",
        f"supervised   {info['supervised_tokens']} loss_mask, {info['supervised_positions']} position_mask",
        f"aux layers   {info['layers']} ({info['dtype']})",
        f"target_probs {info['target_probs']} over a draft vocabulary of {info['draft_vocab_size']}",
        f"on disk      {human_bytes(info['bytes_on_disk'])}",
        f"numerics     {describe_numerics(info.get('numerics'))}",
        "identity:",
    ]
    width = max(len(k) for k in info["identity"])
    for key, value in info["identity"].items():
        text = json.dumps(value)
        lines.append(f"  {key.ljust(width)}  {text if len(text) <= 100 else text[:96] + ' ...'}")
    return "\n".join(lines)


def compare_eagle3_caches(a: Path, b: Path, *, atol: float | None, rtol: float | None) -> CompareReport:
    """As ``compare.compare_caches``, for two EAGLE-3 caches (bool position_mask compared as 0/1)."""
    a, b = Path(a), Path(b)
    manifest_a, manifest_b = _read_complete(a), _read_complete(b)
    default_atol, default_rtol = default_tolerance(manifest_b.dtype)

    def plain(value: Any) -> Any:
        return list(value) if isinstance(value, tuple) else value

    report = CompareReport(
        a=str(a), b=str(b),
        identity={name: (plain(getattr(manifest_a, name)), plain(getattr(manifest_b, name))) for name in FIELD_NAMES},
        bookkeeping={"producer": ((read_bookkeeping(a, RUN_RECORD_NAME) or {}).get("producer"),
                                  (read_bookkeeping(b, RUN_RECORD_NAME) or {}).get("producer")),
                     "numerics": (read_numerics(a), read_numerics(b))},
        identity_diff=manifest_a.identity_diff(manifest_b),
        atol=default_atol if atol is None else atol, rtol=default_rtol if rtol is None else rtol)
    if any(name in report.identity_diff for name in _SHAPE_FIELDS):
        return report
    report.compared_tensors = True
    for name in [EMBEDDINGS_NAME] + [shard_name(i) for i in range(manifest_b.num_shards)]:
        shard = _compare_files(a / name, b / name, report.atol, report.rtol)
        report.shards.append(shard)
        for key, diff in shard.keys.items():
            report.keys.setdefault(key, KeyDiff()).add(diff)
    return report


def _read_complete(cache_dir: Path) -> Eagle3Manifest:
    if not cache_dir.is_dir():
        raise CaptureError(f"{cache_dir} is not a directory; compare needs two cache directories.")
    manifest = read_eagle3(cache_dir)
    complete, rule = completion(cache_dir, manifest)
    if not complete:
        raise CaptureError(f"{cache_dir} is not a complete EAGLE-3 cache ({rule}): the run that writes it has not "
                           "finished (or died). Re-run it to completion before comparing.")
    return manifest


def _compare_files(path_a: Path, path_b: Path, atol: float, rtol: float) -> ShardDiff:
    loaded = []
    for path in (path_a, path_b):
        if not path.is_file():
            raise CaptureError(f"{path} is missing: the cache is incomplete (run `ds-capture verify` on it).")
        try:
            loaded.append(load_tensors(path))
        except (OSError, ValueError) as error:
            raise CaptureError(f"{path} cannot be read as safetensors ({error}).") from None
    tensors_a, tensors_b = loaded
    if set(tensors_a) != set(tensors_b):
        raise CaptureError(f"{path_a.name}: tensors {sorted(tensors_a)} in A but {sorted(tensors_b)} in B; run "
                           "`ds-capture verify` on both caches.")
    diffs = {}
    for key in sorted(tensors_b):
        x, y = tensors_a[key], tensors_b[key]
        if x.shape != y.shape or x.dtype != y.dtype:
            raise CaptureError(f"{path_a.name}: {key} is {tuple(x.shape)} {x.dtype} in A but {tuple(y.shape)} "
                               f"{y.dtype} in B; run `ds-capture verify` on both caches.")
        if x.dtype == torch.bool:
            x, y = x.to(torch.int64), y.to(torch.int64)
        diffs[key] = diff_tensors(x, y, atol, rtol)
    return ShardDiff(name=path_a.name, keys=diffs)
