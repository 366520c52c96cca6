"""``compare_caches`` at its earlier import path (``ds_capture.cache.compare``); it lives in
:mod:`ds_capture.cache.registry` (either kind)."""

from ds_capture.cache.common.verify import CompareReport
from ds_capture.cache.registry import compare_caches

__all__ = ["CompareReport", "compare_caches"]
