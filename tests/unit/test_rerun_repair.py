"""Rerun repair, single process: a rerun over a cache marked complete checks its shards (header and sidecar,
never the data; ``--verify-checksums`` re-hashes them) and recomputes only a deleted, truncated or changed
shard, back to the original bytes, for both cache kinds.

How "only that shard" is counted, three ways: the shard kind's ``finish`` (where each shard is published) is
wrapped and must see exactly the damaged indices; the last ``metrics.jsonl`` record says how many rows this
run forwarded; the other shards keep their inode and mtime (``os.replace`` gives a rewritten file a new inode).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import pytest

import ds_capture.runner as runner
from ds_capture.cache.common.rerun_check import check_complete_cache
from ds_capture.cache.dspark.format import Manifest
from ds_capture.cache.registry import verify_cache
from ds_capture.cli import main
from ds_capture.runner import run_capture
from tests.unit.test_eagle3_cache import _config as eagle3_config, _digests, qwen3  # noqa: F401 - qwen3 is a fixture
from tests.unit.test_runner import base_run, capture, hash_cache, patch_finish_shard  # noqa: F401 - base_run too

SHARDS = [f"shard-{i:06d}.safetensors" for i in range(3)]  # 10 samples, shard_size 4: rows 4, 4, 2


def file_ids(cache: Path) -> dict[str, tuple[int, int]]:
    """(inode, mtime_ns) of each shard and sidecar: both change when a file is rewritten."""
    paths = [*cache.glob("shard-*.safetensors"), *(cache / ".ds_capture" / "checksums").glob("*")]
    return {str(p.relative_to(cache)): (p.stat().st_ino, p.stat().st_mtime_ns) for p in sorted(paths)}


def untouched(before: dict, after: dict, recomputed: list[int]) -> dict:
    """``before`` without the recomputed shards' files, and what ``after`` has for the same files."""
    keep = {name for name in before if not any(f"shard-{i:06d}." in name for i in recomputed)}
    return {name: after.get(name) for name in sorted(keep)}


def rows_forwarded(cache: Path) -> int:
    """Rows this (the latest) run forwarded, from its final metrics record."""
    return json.loads((cache / ".ds_capture" / "metrics.jsonl").read_text().splitlines()[-1])["samples_done"]


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as handle:
        handle.seek(offset)
        byte = handle.read(1)
        handle.seek(offset)
        handle.write(bytes([byte[0] ^ 0xFF]))


def warnings(caplog) -> list[str]:
    """The runner's own warnings (the data reader's train_split note has a logger of its own)."""
    return [r.getMessage() for r in caplog.records if r.name == "ds_capture" and r.levelno == logging.WARNING]


def read_counter(name: str) -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        key, _, value = line.partition(": ")
        if key == name:
            return int(value)
    raise AssertionError(f"/proc/self/io has no {name}")


# ---------------------------------------------------------------------------------------------- the check itself


def test_the_cheap_check_reads_headers_and_sidecars_only(base_run):
    cache, _args = base_run
    manifest = Manifest.from_json((cache / "manifest.json").read_text(), "manifest.json")
    shard_bytes = sum((cache / name).stat().st_size for name in SHARDS)
    before = read_counter("rchar")
    check = check_complete_cache(cache, manifest)
    cheap_read = read_counter("rchar") - before
    assert check.ok and check.describe() == (
        "all 3 shards checked: present, sized as their headers say, with checksum sidecars")
    # Three headers (under 1 KiB each) and three one-line sidecars; the shards hold far more.
    assert cheap_read < 4096 < shard_bytes, (cheap_read, shard_bytes)
    before = read_counter("rchar")
    full = check_complete_cache(cache, manifest, checksums=True)
    assert full.ok and full.describe() == "all 3 shards checked: present, checksums match their sidecars"
    assert read_counter("rchar") - before >= shard_bytes


def test_what_the_check_finds(base_run, tmp_path):
    cache, _args = base_run
    work = tmp_path / "cache"
    shutil.copytree(cache, work)
    manifest = Manifest.from_json((work / "manifest.json").read_text(), "manifest.json")
    size = (work / SHARDS[0]).stat().st_size
    os.truncate(work / SHARDS[0], size - 100)
    (work / SHARDS[1]).write_bytes(b"\x05")
    (work / ".ds_capture" / "checksums" / "shard-000002.checksum").unlink()
    check = check_complete_cache(work, manifest)
    assert check.describe() == (
        f"shard-000000.safetensors: size {size - 100} != {size} from its header; "
        "shard-000001.safetensors: unreadable safetensors header (1 bytes, shorter than the 8-byte length prefix); "
        "shard-000002.safetensors: no checksum sidecar (.ds_capture/checksums/shard-000002.checksum): "
        "recomputing 3 of 3 shards")


# ---------------------------------------------------------------------------------------------- DSpark


def damage(work: Path, how: str) -> int:
    """Damage shard 1 of the cache in ``work``; returns its size before."""
    path = work / SHARDS[1]
    size = path.stat().st_size
    if how == "deleted":
        path.unlink()
    elif how == "truncated":
        os.truncate(path, size // 2)
    elif how == "flipped":
        flip_byte(path, size // 2)  # inside target_hidden_states: only a checksum sees it
    elif how == "no sidecar":
        (work / ".ds_capture" / "checksums" / "shard-000001.checksum").unlink()
    return size


@pytest.mark.parametrize("how, found", [
    ("deleted", "missing"),
    ("truncated", "size {half} != {size} from its header"),
    ("flipped", "its xxh3-128-rows checksum differs from its sidecar (the file changed after it was written)"),
    ("no sidecar", "no checksum sidecar (.ds_capture/checksums/shard-000001.checksum)"),
])
def test_a_damaged_shard_of_a_complete_cache_is_recomputed_alone(base_run, tmp_path, monkeypatch, caplog, how, found):
    cache, args = base_run
    work = tmp_path / "cache"
    shutil.copytree(cache, work)
    size = damage(work, how)
    before = file_ids(work)
    finished = []  # (shard index, the manifest's complete flag while it is written)

    def record(self, index, shard, real_finish):
        finished.append((index, json.loads((work / "manifest.json").read_text())["complete"]))
        return real_finish(self, index, shard)

    patch_finish_shard(monkeypatch, record)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(json.dumps({"recipe_args": {**args, "cache_output_dir": str(work)}}))
    argv = ["run", "-c", str(recipe), "--no-progress"] + (["--verify-checksums"] if how == "flipped" else [])
    with caplog.at_level(logging.WARNING, logger="ds_capture"):
        assert main(argv) == 0

    expected = found.format(half=size // 2, size=size)
    assert warnings(caplog) == [
        f"{work} is marked complete, but shard-000001.safetensors: {expected}: recomputing 1 of 3 shards; its "
        "manifest says complete: false until they are written"]
    assert finished == [(1, False)]  # only shard 1, written while the manifest said complete: false
    assert rows_forwarded(work) == 4  # shard 1's rows, nothing else forwarded
    assert untouched(before, file_ids(work), [1]) == untouched(before, before, [1])
    assert hash_cache(work) == hash_cache(cache)  # manifest (complete: true again), weights, shards, sidecars
    assert verify_cache(work, checksums=True).ok


def test_a_flipped_byte_needs_the_checksum_pass(base_run, tmp_path, monkeypatch):
    """Without --verify-checksums a rerun reads headers only, so a changed data byte goes unseen."""
    cache, args = base_run
    work = tmp_path / "cache"
    shutil.copytree(cache, work)
    damage(work, "flipped")
    before = hash_cache(work)
    builds = []
    real_build = runner.build_model
    monkeypatch.setattr(runner, "build_model", lambda *a, **k: builds.append(1) or real_build(*a, **k))
    summary = capture(tmp_path, **{**args, "cache_output_dir": str(work)})
    assert summary.format() == (
        f"{work} already holds this complete cache (10 samples; all 3 shards checked: present, sized as their "
        "headers say, with checksum sidecars); nothing to do")
    assert hash_cache(work) == before and builds == []
    assert not verify_cache(work, checksums=True).ok


def test_a_healthy_cache_passes_the_checksum_pass_without_loading_the_model(base_run, tmp_path, monkeypatch):
    cache, args = base_run
    work = tmp_path / "cache"
    shutil.copytree(cache, work)
    before = file_ids(work)
    builds = []
    real_build = runner.build_model
    monkeypatch.setattr(runner, "build_model", lambda *a, **k: builds.append(1) or real_build(*a, **k))
    path = tmp_path / "recipe.yaml"
    path.write_text(json.dumps({"recipe_args": {**args, "cache_output_dir": str(work)}}))
    from ds_capture.recipe.config import load_config

    summary = run_capture(load_config(path), verify_checksums=True, show_progress=False)
    assert summary.format() == (
        f"{work} already holds this complete cache (10 samples; all 3 shards checked: present, checksums match "
        "their sidecars); nothing to do")
    assert builds == [] and file_ids(work) == before and hash_cache(work) == hash_cache(cache)


def test_two_damaged_shards_are_named_and_recomputed(base_run, tmp_path, monkeypatch, caplog):
    cache, args = base_run
    work = tmp_path / "cache"
    shutil.copytree(cache, work)
    (work / SHARDS[2]).unlink()
    size = (work / SHARDS[0]).stat().st_size
    os.truncate(work / SHARDS[0], 1000)
    before = file_ids(work)
    calls = []
    patch_finish_shard(monkeypatch, lambda self, index, shard, real: calls.append(index) or real(self, index, shard))
    with caplog.at_level(logging.WARNING, logger="ds_capture"):
        summary = capture(tmp_path, **{**args, "cache_output_dir": str(work)})
    assert f"shard-000000.safetensors: size 1000 != {size} from its header; shard-000002.safetensors: missing: " \
           "recomputing 2 of 3 shards" in caplog.text
    assert calls == [0, 2] and (summary.shards_written, summary.shards_skipped) == (2, 1)
    assert rows_forwarded(work) == 4 + 2
    assert untouched(before, file_ids(work), [0, 2]) == untouched(before, before, [0, 2])
    assert hash_cache(work) == hash_cache(cache)


# ---------------------------------------------------------------------------------------------- EAGLE-3


@pytest.fixture(scope="module")
def eagle3_reference(qwen3, tmp_path_factory):  # noqa: F811 - qwen3 is the imported fixture
    out = tmp_path_factory.mktemp("eagle3_repair") / "reference"
    run_capture(eagle3_config(qwen3, out), show_progress=False)
    return out


@pytest.mark.timeout(300)
def test_eagle3_deleted_and_flipped_shards_are_recomputed_alone(qwen3, eagle3_reference, tmp_path, monkeypatch,  # noqa: F811
                                                                caplog):
    from ds_capture.cache.eagle3.writer import Eagle3Shards

    work = tmp_path / "cache"
    shutil.copytree(eagle3_reference, work)
    complete = work / ".ds_capture" / "complete.json"
    complete_bytes = complete.read_bytes()
    (work / SHARDS[1]).unlink()
    flip_byte(work / SHARDS[2], (work / SHARDS[2]).stat().st_size // 2)
    before = file_ids(work)
    finished = []
    real_finish = Eagle3Shards.finish

    def record(self, index, shard):
        finished.append((index, complete.exists()))
        return real_finish(self, index, shard)

    monkeypatch.setattr(Eagle3Shards, "finish", record)
    with caplog.at_level(logging.WARNING, logger="ds_capture"):
        summary = run_capture(eagle3_config(qwen3, work), verify_checksums=True, show_progress=False)
    assert warnings(caplog) == [
        f"{work} is marked complete, but shard-000001.safetensors: missing; shard-000002.safetensors: its "
        "xxh3-128-rows checksum differs from its sidecar (the file changed after it was written): recomputing 2 of 3 "
        "shards; .ds_capture/complete.json is removed until they are written"]
    # Only shards 1 and 2, written while the directory did not claim to be complete.
    assert finished == [(1, False), (2, False)]
    assert (summary.shards_written, summary.shards_skipped) == (2, 1) and rows_forwarded(work) == 4 + 2
    assert untouched(before, file_ids(work), [1, 2]) == untouched(before, before, [1, 2])
    assert _digests(work) == _digests(eagle3_reference) and complete.read_bytes() == complete_bytes
    assert verify_cache(work, checksums=True).ok

    again = run_capture(eagle3_config(qwen3, work), show_progress=False)
    assert not again.published and again.rerun_check == (
        "all 3 shards checked: present, sized as their headers say, with checksum sidecars")
