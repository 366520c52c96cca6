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

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from ds_capture.cache.dspark.format import (
    IDENTITY_FIELDS,
    SHARD_KEYS,
    TARGET_WEIGHTS_NAME,
    WEIGHT_KEYS,
    Manifest,
    shard_name,
)
from ds_capture.cache.dspark.reader import read_manifest
from ds_capture.errors import CaptureError

# dtype -> (atol, rtol); see the module docstring for the reasoning.
DEFAULT_TOLERANCES: dict[str, tuple[float, float]] = {
    "fp32": (1e-5, 1.3e-6),
    "bf16": (1e-5, 1.6e-2),
    "fp16": (1e-5, 1e-3),
}
# Fields that fix tensor shapes: when one differs the tensors cannot be compared at all.
_SHAPE_FIELDS = ("num_samples", "shard_size", "seq_length", "hidden_size", "target_hidden_dim",
                 "target_last_hidden_dim", "target_vocab_size", "dtype")


@dataclass
class KeyDiff:
    """Differences of one tensor key (over one shard, or accumulated over all of them)."""

    max_abs: float = 0.0
    max_rel: float = 0.0
    """max |a - b| / max(|a|, |b|) (0 where both are 0)."""
    num_mismatched: int = 0
    """Elements outside the tolerance (for integers: elements that differ at all)."""
    numel: int = 0

    @property
    def ok(self) -> bool:
        return self.num_mismatched == 0

    def add(self, other: KeyDiff) -> None:
        self.max_abs = max(self.max_abs, other.max_abs)
        self.max_rel = max(self.max_rel, other.max_rel)
        self.num_mismatched += other.num_mismatched
        self.numel += other.numel


@dataclass
class ShardDiff:
    """One shard (or ``target_weights``) of the two caches, key by key."""

    name: str
    keys: dict[str, KeyDiff]

    @property
    def ok(self) -> bool:
        return all(diff.ok for diff in self.keys.values())


@dataclass
class CompareReport:
    """Everything ``ds-capture compare`` prints; ``equal`` is the verdict."""

    a: str
    b: str
    identity: dict[str, tuple[Any, Any]]
    """Every identity field, (value in A, value in B)."""
    bookkeeping: dict[str, tuple[Any, Any]]
    """Non-identity manifest fields (producer, layout), shown, never compared."""
    identity_diff: list[str]
    atol: float
    rtol: float
    keys: dict[str, KeyDiff] = field(default_factory=dict)
    shards: list[ShardDiff] = field(default_factory=list)
    compared_tensors: bool = False
    """False when a shape-defining identity field differs (nothing tensor-wise to compare)."""

    @property
    def equal(self) -> bool:
        return not self.identity_diff and self.compared_tensors and all(d.ok for d in self.keys.values())

    @property
    def failing_shards(self) -> list[str]:
        return [shard.name for shard in self.shards if not shard.ok]

    def to_dict(self) -> dict[str, Any]:
        return {
            "a": self.a, "b": self.b, "equal": self.equal, "atol": self.atol, "rtol": self.rtol,
            "identity": {k: list(v) for k, v in self.identity.items()},
            "bookkeeping": {k: list(v) for k, v in self.bookkeeping.items()},
            "identity_diff": self.identity_diff, "compared_tensors": self.compared_tensors,
            "keys": {k: {**asdict(v), "ok": v.ok} for k, v in self.keys.items()},
            "shards": [{"name": s.name, "ok": s.ok, "keys": {k: asdict(v) for k, v in s.keys.items()}}
                       for s in self.shards],
            "failing_shards": self.failing_shards,
        }

    def format(self) -> str:
        lines = [f"A: {self.a}", f"B: {self.b}"]
        for name, (a, b) in self.bookkeeping.items():
            lines.append(f"  {name}: A {a!r} | B {b!r}")
        if self.identity_diff:
            lines.append(f"identity: {len(self.identity_diff)} field(s) differ:")
            lines += [f"  {name}: A {self.identity[name][0]!r} | B {self.identity[name][1]!r}"
                      for name in self.identity_diff]
        else:
            lines.append(f"identity: all {len(self.identity)} fields equal")
        if not self.compared_tensors:
            lines.append("tensors: not compared (the caches have different shapes)")
        else:
            lines.append(f"tolerance: |a-b| <= {self.atol:g}*max(1, max|b|) + {self.rtol:g}*|b| (floats); "
                         "integers exact")
            lines.append(f"  {'key':<30} {'max_abs':>11} {'max_rel':>11} {'mismatched':>14}")
            for key, diff in self.keys.items():
                lines.append(f"  {key:<30} {diff.max_abs:>11.3e} {diff.max_rel:>11.3e} "
                             f"{diff.num_mismatched:>6}/{diff.numel:<7} {'ok' if diff.ok else 'DIFFERENT'}")
            num_ok = sum(shard.ok for shard in self.shards)
            lines.append(f"shards: {num_ok}/{len(self.shards)} within tolerance")
            for shard in self.shards:
                if not shard.ok:
                    bad = ", ".join(f"{k} (max_abs {d.max_abs:.3e}, {d.num_mismatched} elements)"
                                    for k, d in shard.keys.items() if not d.ok)
                    lines.append(f"  {shard.name}: {bad}")
        lines.append("verdict: EQUAL within tolerance" if self.equal else "verdict: DIFFERENT")
        return "\n".join(lines)


def default_tolerance(dtype: str) -> tuple[float, float]:
    """(atol, rtol) for a cache dtype (``fp32``, ``bf16``, ``fp16``)."""
    return DEFAULT_TOLERANCES[dtype]


def compare_caches(a: Path, b: Path, *, atol: float | None, rtol: float | None) -> CompareReport:
    """Compare cache ``a`` with cache ``b`` (``b`` is the reference for the relative tolerance).

    ``atol`` / ``rtol`` of None take the default of the caches' dtype. Raises ``CaptureError`` when
    either directory is not a complete cache (no or unreadable manifest, ``complete: false``, a shard
    or the weights file missing or holding the wrong tensors).
    """
    a, b = Path(a), Path(b)
    from ds_capture.cache.eagle3 import reader as eagle3_reader

    if eagle3_reader.is_eagle3_cache(a) or eagle3_reader.is_eagle3_cache(b):
        if not (eagle3_reader.is_eagle3_cache(a) and eagle3_reader.is_eagle3_cache(b)):
            raise CaptureError(f"{a} and {b} are caches of different kinds (one EAGLE-3 v2, one not); compare "
                               "needs two caches of the same kind.")
        return eagle3_reader.compare_eagle3_caches(a, b, atol=atol, rtol=rtol)
    manifest_a, manifest_b = _read_complete(a), _read_complete(b)
    default_atol, default_rtol = default_tolerance(manifest_b.dtype)
    report = CompareReport(
        a=str(a), b=str(b),
        identity={name: (_plain(getattr(manifest_a, name)), _plain(getattr(manifest_b, name)))
                  for name in IDENTITY_FIELDS},
        bookkeeping={name: (manifest_a.bookkeeping.get(name), manifest_b.bookkeeping.get(name))
                     for name in sorted(set(manifest_a.bookkeeping) | set(manifest_b.bookkeeping))},
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
        with safe_open(path, framework="pt") as handle:
            found = set(handle.keys())
            if found != set(keys):
                raise CaptureError(f"{path} holds {sorted(found)}, expected {sorted(keys)}: not a DSpark v1 file.")
            return {key: handle.get_tensor(key) for key in keys}
    except CaptureError:
        raise
    except Exception as error:  # noqa: BLE001 - whatever safetensors raises for a damaged file
        raise CaptureError(f"{path} cannot be read as safetensors ({error}).") from None


def _compare_files(path_a: Path, path_b: Path, keys: tuple[str, ...], atol: float, rtol: float) -> ShardDiff:
    tensors_a, tensors_b = _load(path_a, keys), _load(path_b, keys)
    diffs = {}
    for key in keys:
        x, y = tensors_a[key], tensors_b[key]
        if x.shape != y.shape or x.dtype != y.dtype:
            # Same manifest identity but different layouts: one side breaks its own manifest.
            raise CaptureError(f"{path_a.name}: {key} is {tuple(x.shape)} {x.dtype} in A but {tuple(y.shape)} "
                               f"{y.dtype} in B; run `ds-capture verify` on both caches.")
        diffs[key] = _diff(x, y, atol, rtol)
    return ShardDiff(name=path_a.name, keys=diffs)


def _diff(x: torch.Tensor, y: torch.Tensor, atol: float, rtol: float) -> KeyDiff:
    """Element-wise comparison of two same-shape tensors (``y`` the reference)."""
    if x.numel() == 0:
        return KeyDiff()
    if not x.is_floating_point():
        diff = (x - y).abs()
        scale = torch.maximum(x.abs(), y.abs()).clamp_min(1)
        return KeyDiff(max_abs=float(diff.max()), max_rel=float((diff.double() / scale).max()),
                       num_mismatched=int((diff != 0).sum()), numel=x.numel())
    x, y = x.float(), y.float()  # bf16 / fp16 -> fp32 is exact
    magnitude = float(torch.nan_to_num(y.abs(), nan=0.0, posinf=0.0).max())
    close = torch.isclose(x, y, atol=atol * max(1.0, magnitude), rtol=rtol, equal_nan=True)
    diff = (x - y).abs()
    both_nan = x.isnan() & y.isnan()
    diff = torch.where(both_nan, torch.zeros_like(diff), torch.nan_to_num(diff, nan=float("inf")))
    scale = torch.nan_to_num(torch.maximum(x.abs(), y.abs()), nan=0.0)  # NaN vs number: rel inf
    rel = torch.where(diff == 0, torch.zeros_like(diff), diff / scale.clamp_min(torch.finfo(torch.float32).tiny))
    return KeyDiff(max_abs=float(diff.max()), max_rel=float(rel.max()), num_mismatched=int((~close).sum()),
                   numel=x.numel())
