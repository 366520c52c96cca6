"""The cache kinds by name, and ``verify`` / ``inspect`` / ``compare`` of any cache directory, dispatched by what
the directory holds (an EAGLE-3 v2 manifest, else DSpark v1).

In: a ``cache_kind`` name, or cache directories. Out: the kind class the runner drives; the kind's own report.
The one place that knows every kind: the kinds themselves never import each other.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ds_capture.cache.common.verify import CompareReport, VerifyReport
from ds_capture.cache.dspark import compare as dspark_compare
from ds_capture.cache.dspark import reader as dspark_reader
from ds_capture.cache.eagle3 import reader as eagle3_reader
from ds_capture.errors import CaptureError


def kind_class(name: str) -> type:
    """The kind the runner drives for ``cache_kind: name`` (the config has already checked the name)."""
    if name == "eagle3":
        from ds_capture.cache.eagle3.kind import Eagle3Kind

        return Eagle3Kind
    from ds_capture.cache.dspark.kind import DSparkKind

    return DSparkKind


def verify_cache(cache_dir: Path, *, checksums: bool = False) -> VerifyReport:
    """Check every contract rule of ``cache_dir``'s kind; ``checksums`` also re-hashes each shard."""
    cache_dir = Path(cache_dir)
    if eagle3_reader.is_eagle3_cache(cache_dir):
        return eagle3_reader.verify_eagle3_cache(cache_dir, checksums=checksums)
    return dspark_reader.verify_dspark_cache(cache_dir, checksums=checksums)


def inspect_cache(cache_dir: Path) -> dict[str, Any]:
    """Counts, sizes and identity of a cache of either kind (its ``kind`` key says which, for EAGLE-3)."""
    cache_dir = Path(cache_dir)
    if eagle3_reader.is_eagle3_cache(cache_dir):
        return eagle3_reader.inspect_eagle3_cache(cache_dir)
    return dspark_reader.inspect_dspark_cache(cache_dir)


def format_inspect(info: dict[str, Any]) -> str:
    """Human text for :func:`inspect_cache`'s dict."""
    if info.get("kind") == "eagle3":
        return eagle3_reader.format_eagle3_inspect(info)
    return dspark_reader.format_dspark_inspect(info)


def compare_caches(a: Path, b: Path, *, atol: float | None, rtol: float | None) -> CompareReport:
    """Compare cache ``a`` with cache ``b`` (the reference for the relative tolerance); both of one kind.

    ``atol`` / ``rtol`` of None take the default of the caches' dtype. Raises ``CaptureError`` when either
    directory is not a complete cache, or the two are of different kinds.
    """
    a, b = Path(a), Path(b)
    if eagle3_reader.is_eagle3_cache(a) or eagle3_reader.is_eagle3_cache(b):
        if not (eagle3_reader.is_eagle3_cache(a) and eagle3_reader.is_eagle3_cache(b)):
            raise CaptureError(f"{a} and {b} are caches of different kinds (one EAGLE-3 v2, one not); compare "
                               "needs two caches of the same kind.")
        return eagle3_reader.compare_eagle3_caches(a, b, atol=atol, rtol=rtol)
    return dspark_compare.compare_dspark_caches(a, b, atol=atol, rtol=rtol)
