"""The output directory both cache kinds check and prepare the same way, before anything is written.

In: ``cache_output_dir``, the manifest it holds (if any, read by the kind) and this run's. Out: refusals that touch
nothing (a cache of another identity, foreign files in a directory without a manifest), then, holding the
directory's lock, the directory created, stale ``.tmp`` files cleared and the shards already done.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

from ds_capture.cache.common.names import BOOKKEEPING_DIR, CHECKSUMS_DIR, MANIFEST_NAME
from ds_capture.cache.common.rerun_check import shard_is_done
from ds_capture.durable import TMP_SUFFIX
from ds_capture.errors import CaptureError

_MAX_LISTED = 5


def refuse_identity_mismatch(out_dir: Path, existing: Any, manifest: Any, *, what: str = "cache",
                             skip: Collection[str] = ()) -> None:
    """A manifest already in ``out_dir`` whose identity differs from this run's (``skip`` fields aside) is refused,
    field by field; nothing in the directory is changed."""
    differing = [name for name in existing.identity_diff(manifest) if name not in skip]
    if not differing:
        return
    details = "; ".join(f"{name} is {_show(getattr(existing, name))} there, {_show(getattr(manifest, name))} in "
                        "this run" for name in differing)
    raise CaptureError(f"{out_dir} holds a different {what}: {details}. Use a new cache_output_dir or delete "
                       f"{out_dir} to recompute it (nothing in it was changed).")


def _show(value: object) -> str:
    if isinstance(value, tuple):
        text = str(list(value))
        return text if len(text) <= 80 else text[:77] + "...]"  # EAGLE-3's selected_token_ids: Vd ids
    return repr(value) if isinstance(value, str) or value is None else str(value)


def refuse_foreign_entries(out_dir: Path, own: Collection[str]) -> None:
    """Only the kind's own pre-manifest files (``own``, ``.ds_capture/``, ``.tmp`` files) may sit in a directory
    that has no manifest yet."""
    if not out_dir.is_dir():
        raise CaptureError(f"cache_output_dir {out_dir} exists and is not a directory; choose another path.")
    own = {*own, BOOKKEEPING_DIR}
    foreign = sorted(e.name for e in out_dir.iterdir() if e.name not in own and not e.name.endswith(TMP_SUFFIX))
    if foreign:
        listed = ", ".join(foreign[:_MAX_LISTED])
        if len(foreign) > _MAX_LISTED:
            listed += f" (and {len(foreign) - _MAX_LISTED} more)"
        raise CaptureError(
            f"cache_output_dir {out_dir} is not empty and holds no ds_capture/NeMo cache manifest "
            f"({MANIFEST_NAME}): it contains {listed}. Use a new or empty cache_output_dir."
        )


def prepare_shards(out_dir: Path, manifest: Any, existing: Any | None, *, restart: bool,
                   is_complete: Callable[[], bool]) -> set[int]:
    """Create ``out_dir``, clear stale ``.tmp`` files, and return the shards already done: none for a new cache or
    with ``restart``, all of them when ``is_complete()``, otherwise each whose header and checksum check out.

    Call it holding the directory's lock: the ``.tmp`` files of a running job are not stale."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for directory in (out_dir, out_dir / BOOKKEEPING_DIR, out_dir / BOOKKEEPING_DIR / CHECKSUMS_DIR):
        if directory.is_dir():  # a .tmp is never final data: it is what a killed run was writing when it died
            for entry in directory.iterdir():
                if entry.name.endswith(TMP_SUFFIX) and entry.is_file():
                    entry.unlink()
    if existing is None or restart:
        return set()
    if is_complete():
        return set(range(manifest.num_shards))
    return {index for index in range(manifest.num_shards) if shard_is_done(out_dir, index, manifest)}
