"""Compare two DSpark v1 caches: are they the same capture, within a float tolerance? (Two EAGLE-3 v2
caches are compared by :mod:`ds_capture.cache.eagle3.reader` into the same report.)

In:  two cache directories (each with a complete ``manifest.json``), optional ``atol`` / ``rtol``.
Out: a :class:`CompareReport`: the identity fields side by side, per tensor key the max absolute and
     max relative difference over all shards (and the target weights), a per-shard summary, and the
     verdict. Integer tensors (``input_ids``, ``loss_mask``) must match exactly; floats pass when
     ``|a - b| <= atol * max(1, max|b|) + rtol * |b|`` element-wise (``torch.isclose``; NaN only matches
     NaN). ``atol`` is scaled by the tensor's magnitude: a hidden state that sums values near 20 carries
     rounding of that size into elements near 0, so a fixed absolute bound would flag ulp-level noise
     (tensor-parallel partial sums, a different BLAS blocking) as a difference.
     A directory that is not a complete cache is a ``CaptureError`` (the CLI's exit 2).

Shards are read one pair at a time, so memory stays at two shards whatever the cache size.

Default tolerances by cache dtype (torch.testing's defaults, chosen per format precision):
  fp32  atol 1e-5, rtol 1.3e-6   DESIGN §8's 1e-5 for fp32; rtol ~ 11 ulp of the 24-bit significand.
  bf16  atol 1e-5, rtol 1.6e-2   ~2 ulp of bf16's 8-bit significand (ulp(x) <= 2^-7 |x|, 2^-6 = 0.0156):
                                 one rounding on each side of a 1-ulp difference in the fp32 accumulator.
  fp16  atol 1e-5, rtol 1e-3     ~1 ulp of fp16's 11-bit significand (2^-10 = 0.00098).

    report = compare_caches(Path("cache_ds"), Path("cache_fsdp2"), atol=None, rtol=None)
    print(report.format()); sys.exit(0 if report.equal else 1)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ds_capture.cache.common.files import read_numerics
from ds_capture.cache.common.names import shard_name
from ds_capture.cache.common.verify import (
    CompareReport,
    KeyDiff,
    ShardDiff,
    default_tolerance,
    diff_tensors,
    load_tensors,
)
from ds_capture.cache.dspark.format import IDENTITY_FIELDS, SHARD_KEYS, TARGET_WEIGHTS_NAME, WEIGHT_KEYS, Manifest
from ds_capture.cache.dspark.reader import read_manifest
from ds_capture.errors import CaptureError

# Fields that fix tensor shapes: when one differs the tensors cannot be compared at all.
_SHAPE_FIELDS = ("num_samples", "shard_size", "seq_length", "hidden_size", "target_hidden_dim",
                 "target_last_hidden_dim", "target_vocab_size", "dtype")


def compare_dspark_caches(a: Path, b: Path, *, atol: float | None, rtol: float | None) -> CompareReport:
    """Compare cache ``a`` with cache ``b`` (``b`` is the reference for the relative tolerance).

    ``atol`` / ``rtol`` of None take the default of the caches' dtype. Raises ``CaptureError`` when
    either directory is not a complete cache (no or unreadable manifest, ``complete: false``, a shard
    or the weights file missing or holding the wrong tensors).
    """
    a, b = Path(a), Path(b)
    manifest_a, manifest_b = _read_complete(a), _read_complete(b)
    default_atol, default_rtol = default_tolerance(manifest_b.dtype)
    report = CompareReport(
        a=str(a), b=str(b),
        identity={name: (_plain(getattr(manifest_a, name)), _plain(getattr(manifest_b, name)))
                  for name in IDENTITY_FIELDS},
        bookkeeping={**{name: (manifest_a.bookkeeping.get(name), manifest_b.bookkeeping.get(name))
                        for name in sorted(set(manifest_a.bookkeeping) | set(manifest_b.bookkeeping))},
                     "numerics": (read_numerics(a), read_numerics(b))},  # what the shards were computed with
        identity_diff=manifest_a.identity_diff(manifest_b),
        atol=default_atol if atol is None else atol,
        rtol=default_rtol if rtol is None else rtol,
    )
    if any(name in report.identity_diff for name in _SHAPE_FIELDS):
        return report
    report.compared_tensors = True
    pairs = [(TARGET_WEIGHTS_NAME, WEIGHT_KEYS)] + [(shard_name(i), SHARD_KEYS) for i in range(manifest_b.num_shards)]
    for name, keys in pairs:
        shard = _compare_files(a / name, b / name, keys, report.atol, report.rtol)
        report.shards.append(shard)
        for key, diff in shard.keys.items():
            report.keys.setdefault(key, KeyDiff()).add(diff)
    return report


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def _read_complete(cache_dir: Path) -> Manifest:
    if not cache_dir.is_dir():
        raise CaptureError(f"{cache_dir} is not a directory; compare needs two cache directories.")
    manifest = read_manifest(cache_dir)
    if not manifest.complete:
        raise CaptureError(
            f"{cache_dir}/manifest.json has complete: false: the run that writes this cache has not finished "
            "(or died). Re-run it to completion before comparing."
        )
    return manifest


def _load(path: Path, keys: tuple[str, ...]) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise CaptureError(f"{path} is missing: the cache is incomplete (run `ds-capture verify` on it).")
    try:
        tensors = load_tensors(path)
    except (OSError, ValueError) as error:
        raise CaptureError(f"{path} cannot be read as safetensors ({error}).") from None
    if set(tensors) != set(keys):
        raise CaptureError(f"{path} holds {sorted(tensors)}, expected {sorted(keys)}: not a DSpark v1 file.")
    return tensors


def _compare_files(path_a: Path, path_b: Path, keys: tuple[str, ...], atol: float, rtol: float) -> ShardDiff:
    tensors_a, tensors_b = _load(path_a, keys), _load(path_b, keys)
    diffs = {}
    for key in keys:
        x, y = tensors_a[key], tensors_b[key]
        if x.shape != y.shape or x.dtype != y.dtype:
            # Same manifest identity but different layouts: one side breaks its own manifest.
            raise CaptureError(f"{path_a.name}: {key} is {tuple(x.shape)} {x.dtype} in A but {tuple(y.shape)} "
                               f"{y.dtype} in B; run `ds-capture verify` on both caches.")
        diffs[key] = diff_tensors(x, y, atol, rtol)
    return ShardDiff(name=path_a.name, keys=diffs)


