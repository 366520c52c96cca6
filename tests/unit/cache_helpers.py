"""Shared helpers for the cache tests: a tiny manifest, consistent shard tensors, fixture copies.

In: overrides and a seed. Out: Manifests, shard tensor dicts that satisfy every contract rule
(padding with pad id ``PAD_ID``, loss_mask 0 on padding, last feature slice == last hidden
state), caches written with the real writer, and writable copies of the NeMo reference caches.
"""

from __future__ import annotations

import hashlib
import shutil
import stat
from pathlib import Path

import torch

from ds_capture.cache.common.names import DTYPES
from ds_capture.cache.dspark.format import Manifest
from ds_capture.cache.dspark.writer import write_manifest, write_shard, write_target_weights

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "nemo_dspark_v1"
PAD_ID = 7


def make_manifest(**overrides) -> Manifest:
    values = dict(
        target_model="tiny/target",
        target_model_type="qwen3",
        target_vocab_size=50,
        hidden_size=8,
        num_hidden_layers=4,
        seq_length=12,
        dtype="fp32",
        num_samples=10,
        shard_size=4,
        target_hidden_dim=24,
        target_last_hidden_dim=8,
        target_layer_ids=(1, 2, 3),
        train_data_path="data.jsonl",
        train_split=None,
        shuffle_seed=42,
        mask_reasoning_content=False,
        mask_generation_prompt=False,
        chat_template_sha256="ab" * 32,
    )
    values.update(overrides)
    return Manifest(**values)


def make_shard_tensors(manifest: Manifest, index: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Rows with content lengths S, S-1, S-3, S-5, ... padded with PAD_ID; loss on the content's second half."""
    n, S, H = manifest.shard_rows(index), manifest.seq_length, manifest.hidden_size
    gen = torch.Generator().manual_seed(seed * 1000 + index)
    input_ids = torch.randint(PAD_ID + 1, manifest.target_vocab_size, (n, S), generator=gen)
    loss_mask = torch.zeros(n, S, dtype=torch.int64)
    for row in range(n):
        length = S - (0 if row == 0 else 2 * row - 1) % (S - 2)
        input_ids[row, length:] = PAD_ID
        loss_mask[row, length // 2 : length] = 1
    dtype = DTYPES[manifest.dtype]
    hidden = torch.randn(n, S, manifest.target_hidden_dim, generator=gen).to(dtype)
    return {
        "input_ids": input_ids,
        "loss_mask": loss_mask,
        "target_hidden_states": hidden,
        "target_last_hidden_states": hidden[..., -H:].clone(),
    }


def write_cache(out_dir: Path, manifest: Manifest, *, complete: bool = True, seed: int = 0) -> None:
    """A whole cache in the contract's order, through the real writer."""
    out_dir.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    weights = torch.randn(manifest.target_vocab_size, manifest.hidden_size, generator=gen)
    write_target_weights(out_dir, weights, weights * 2, manifest.dtype)
    write_manifest(out_dir, manifest.with_complete(False))
    for index in range(manifest.num_shards):
        write_shard(out_dir, index, make_shard_tensors(manifest, index, seed), manifest)
    if complete:
        write_manifest(out_dir, manifest.with_complete(True))


def fixture_dir(name: str) -> Path:
    path = FIXTURES / name
    assert path.is_dir(), f"reference cache {name} missing from {FIXTURES} (tests/fixtures/README.md)"
    return path


def copy_fixture(name: str, tmp_path: Path) -> Path:
    """A writable copy of a reference cache (the originals are read-only)."""
    dest = tmp_path / name
    shutil.copytree(fixture_dir(name), dest)
    for path in [dest, *dest.rglob("*")]:
        path.chmod(path.stat().st_mode | stat.S_IWUSR)
    return dest


def hash_tree(root: Path) -> dict[str, str]:
    """relative path -> sha256 of every file under root (directories as "dir")."""
    return {
        str(p.relative_to(root)): "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
    }
