"""The reader functions at their earlier import path (``ds_capture.cache.reader``), for code that imports them
from there. They live in :mod:`ds_capture.cache.registry` (either kind) and :mod:`ds_capture.cache.dspark.reader`.
"""

from ds_capture.cache.common.verify import VerifyReport
from ds_capture.cache.dspark.reader import read_manifest
from ds_capture.cache.registry import format_inspect, inspect_cache, verify_cache

__all__ = ["VerifyReport", "format_inspect", "inspect_cache", "read_manifest", "verify_cache"]
