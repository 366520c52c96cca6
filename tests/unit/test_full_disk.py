"""Our readers on a full or read-only filesystem: ``ds-capture verify`` answers, it is never killed by a signal.

A DSpark shard's padding tails are holes. Through a memory map, a page fault inside a hole on tmpfs allocates a
page, so on a full tmpfs the reader died of SIGBUS (exit 135, no message); plain reads return zeros and allocate
nothing. The test mounts a real small tmpfs (it needs root: skipped with the reason where ``mount`` fails),
writes a cache with holes through the real shard writer, fills the filesystem, and runs the CLI as a process.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ds_capture.cache.dspark.writer import DSparkShards, write_manifest, write_target_weights
from cache_helpers import PAD_ID, make_manifest, make_shard_tensors

REPO = Path(__file__).resolve().parents[2]
_REAL_TOKENS = 8  # of 512 positions per row: the rest of each hidden-state row is a hole


@pytest.fixture
def small_tmpfs(tmp_path: Path):
    """A 4 MiB tmpfs mounted on ``tmp_path / "fs"`` for the test, unmounted after it."""
    mount_point = tmp_path / "fs"
    mount_point.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount_point)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {mounted.stderr.strip() or mounted.returncode}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=True)


def _write_sparse_cache(out_dir: Path):
    """A complete DSpark cache whose shards' hidden-state tails are holes (8 MiB logical, 0.3 MiB stored)."""
    manifest = make_manifest(seq_length=512, hidden_size=128, target_hidden_dim=384, target_last_hidden_dim=128,
                             num_samples=8, shard_size=4)
    out_dir.mkdir()
    weights = torch.randn(manifest.target_vocab_size, manifest.hidden_size, generator=torch.Generator().manual_seed(0))
    write_target_weights(out_dir, weights, weights * 2, manifest.dtype)
    write_manifest(out_dir, manifest.with_complete(False))
    shards = DSparkShards(out_dir, manifest)
    for index in range(manifest.num_shards):
        tensors = make_shard_tensors(manifest, index)
        tensors["input_ids"][:, _REAL_TOKENS:] = PAD_ID
        tensors["loss_mask"][:, _REAL_TOKENS:] = 0
        for key in ("target_hidden_states", "target_last_hidden_states"):
            tensors[key][:, _REAL_TOKENS:] = 0
        shard = shards.open(index)
        rows = manifest.shard_rows(index)
        shard.write_rows(torch.arange(rows), tensors, torch.full((rows,), _REAL_TOKENS))
        shards.finish(index, shard)
    write_manifest(out_dir, manifest.with_complete(True))
    return manifest


def _fill(mount_point: Path) -> None:
    with open(mount_point / "filler", "wb") as f:
        try:
            while True:
                f.write(bytes(1 << 16))
                f.flush()
        except OSError:
            pass
    assert os.statvfs(mount_point).f_bavail == 0


def _verify(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ds_capture", "verify", *args], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=REPO, timeout=120)


def test_verify_answers_on_a_full_and_on_a_read_only_tmpfs(small_tmpfs):
    cache = small_tmpfs / "cache"
    _write_sparse_cache(cache)
    shard = cache / "shard-000000.safetensors"
    assert shard.stat().st_blocks * 512 < shard.stat().st_size // 4, "the shard has no holes: nothing is tested"
    _fill(small_tmpfs)
    expected = f"{cache}: OK: 8 samples in 2/2 shards checked, 64 tokens, 0 supervised, checksums verified\n"

    full = _verify(str(cache), "--checksums")
    assert (full.returncode, full.stdout, full.stderr) == (0, expected, "")

    (cache / "shard-000001.safetensors").unlink()  # frees a little; refill so the disk is full again
    _fill(small_tmpfs)
    damaged = _verify(str(cache))
    assert damaged.returncode == 1, damaged
    assert damaged.stdout.startswith(f"{cache}: INVALID cache, 1 problem(s):\n  - missing shards: "
                                     "shard-000001.safetensors (expected shard-000000 .. shard-000001.safetensors)")

    subprocess.run(["mount", "-o", "remount,ro", str(small_tmpfs)], check=True)
    read_only = _verify(str(cache))
    assert read_only.returncode == 1 and read_only.stdout == damaged.stdout, read_only
