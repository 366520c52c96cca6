"""The writer: NeMo-identical bytes, atomic writes, refusing foreign dirs, resuming a killed run."""

from __future__ import annotations

import os

import pytest
import torch
from cache_helpers import PAD_ID, copy_fixture, fixture_dir, hash_tree, make_manifest, make_shard_tensors, write_cache
from safetensors.torch import load_file

import ds_capture.cache.dspark.writer as writer
from ds_capture.cache.common.files import read_recorded_checksum, sha256_file, write_atomic
from ds_capture.cache.common.names import shard_name
from ds_capture.cache.common.shard_file import file_digest
from ds_capture.cache.dspark.format import IDENTITY_FIELDS, Manifest
from ds_capture.cache.dspark.writer import prepare_output_dir, write_manifest, write_shard, write_target_weights
from ds_capture.errors import CaptureError


@pytest.mark.parametrize("name", ["cache_fp32", "cache_bf16_plain_masked"])
def test_writes_byte_identical_files_from_nemo_values(name, tmp_path):
    ref = fixture_dir(name)
    manifest = Manifest.from_json((ref / "manifest.json").read_text(), name)
    weights = load_file(ref / "target_weights.safetensors")
    write_target_weights(tmp_path, weights["embed_tokens.weight"].float(), weights["lm_head.weight"].float(), manifest.dtype)
    write_manifest(tmp_path, manifest)
    for index in range(manifest.num_shards):
        size = write_shard(tmp_path, index, load_file(ref / shard_name(index)), manifest)
        assert size == (ref / shard_name(index)).stat().st_size
    for file in ["manifest.json", "target_weights.safetensors", *(shard_name(i) for i in range(3))]:
        assert (tmp_path / file).read_bytes() == (ref / file).read_bytes(), file


def test_write_shard_records_tagged_checksum_sidecar(tmp_path):
    manifest = make_manifest()
    write_shard(tmp_path, 1, make_shard_tensors(manifest, 1), manifest)
    digest = file_digest(tmp_path / "shard-000001.safetensors")
    assert digest.startswith("xxh3-128-rows:") and len(digest) == len("xxh3-128-rows:") + 32
    sidecar = tmp_path / ".ds_capture" / "checksums" / "shard-000001.checksum"
    assert sidecar.read_text() == f"{digest}  shard-000001.safetensors\n"
    assert read_recorded_checksum(tmp_path, 1) == digest and read_recorded_checksum(tmp_path, 0) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == [".ds_capture", "shard-000001.safetensors"]


def test_an_earlier_versions_sha256_sidecar_still_counts_and_is_replaced_on_rewrite(tmp_path):
    manifest = make_manifest()
    write_cache(tmp_path, manifest, complete=False)
    checksums = tmp_path / ".ds_capture" / "checksums"
    # What the previous writer left: sha256sum lines under shard-NNNNNN.sha256.
    for i in range(3):
        (checksums / f"shard-00000{i}.checksum").unlink()
        (checksums / f"shard-00000{i}.sha256").write_text(f"{sha256_file(tmp_path / shard_name(i))}  {shard_name(i)}\n")
    assert read_recorded_checksum(tmp_path, 0) == f"sha256:{sha256_file(tmp_path / shard_name(0))}"
    assert prepare_output_dir(tmp_path, manifest) == {0, 1, 2}
    (checksums / "shard-000001.sha256").write_text("0" * 64 + "  shard-000001.safetensors\n")
    assert prepare_output_dir(tmp_path, manifest) == {0, 2}
    write_shard(tmp_path, 1, make_shard_tensors(manifest, 1), manifest)
    assert sorted(p.name for p in checksums.iterdir()) == ["shard-000000.sha256", "shard-000001.checksum",
                                                            "shard-000002.sha256"]


def test_write_shard_leaves_nothing_under_final_name_when_write_fails(tmp_path, monkeypatch):
    manifest = make_manifest()
    real_pwrite, calls = os.pwrite, []

    def dying_pwrite(fd, data, offset):
        calls.append(offset)
        if len(calls) == 3:  # the header and two rows are written, then the disk is full
            raise OSError(28, "No space left on device")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", dying_pwrite)
    with pytest.raises(OSError, match="No space left"):
        write_shard(tmp_path, 0, make_shard_tensors(manifest, 0), manifest)
    assert list(tmp_path.iterdir()) == [] and len(calls) == 3


def test_write_atomic_keeps_old_file_on_failure(tmp_path):
    path = tmp_path / "manifest.json"
    path.write_text("old")

    def fail(tmp):
        tmp.write_text("new, partial")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_atomic(path, fail)
    assert path.read_text() == "old" and sorted(os.listdir(tmp_path)) == ["manifest.json"]
    write_atomic(path, lambda tmp: tmp.write_text("new"))
    assert path.read_text() == "new" and sorted(os.listdir(tmp_path)) == ["manifest.json"]


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda t: t.pop("loss_mask"),
         "shard 0: tensors ['input_ids', 'target_hidden_states', 'target_last_hidden_states'], expected exactly "
         "['input_ids', 'loss_mask', 'target_hidden_states', 'target_last_hidden_states']"),
        (lambda t: t.update(loss_mask=t["loss_mask"].int()),
         "shard 0: loss_mask is (4, 12) torch.int32, the manifest expects (4, 12) torch.int64"),
        (lambda t: t.update(target_hidden_states=t["target_hidden_states"][:3]),
         "shard 0: target_hidden_states is (3, 12, 24) torch.float32, the manifest expects (4, 12, 24) torch.float32"),
        (lambda t: t.update(input_ids=t["input_ids"].t().contiguous().t()),
         "shard 0: input_ids must be a contiguous CPU tensor (is cpu, contiguous=False)"),
    ],
)
def test_write_shard_refuses_tensors_the_manifest_does_not_describe(tmp_path, change, message):
    manifest = make_manifest()
    tensors = make_shard_tensors(manifest, 0)
    change(tensors)
    with pytest.raises(ValueError) as err:
        write_shard(tmp_path, 0, tensors, manifest)
    assert str(err.value) == message
    assert list(tmp_path.iterdir()) == []


def test_write_target_weights_casts_and_unties(tmp_path):
    tied = torch.randn(50, 8)
    write_target_weights(tmp_path, tied, tied, "bf16")  # tied storage must not trip safetensors
    loaded = load_file(tmp_path / "target_weights.safetensors")
    assert sorted(loaded) == ["embed_tokens.weight", "lm_head.weight"]
    assert loaded["lm_head.weight"].dtype == torch.bfloat16
    assert torch.equal(loaded["embed_tokens.weight"], tied.bfloat16())
    with pytest.raises(ValueError, match=r"embed_tokens \(50, 8\) and lm_head \(8, 50\) must both be"):
        write_target_weights(tmp_path, tied, tied.t(), "fp32")


# -- prepare_output_dir ---------------------------------------------------------------------


def test_prepare_creates_missing_dir_and_accepts_own_pre_manifest_files(tmp_path):
    out = tmp_path / "a" / "cache"
    assert prepare_output_dir(out, make_manifest()) == set() and out.is_dir()
    write_target_weights(out, torch.zeros(50, 8), torch.zeros(50, 8), "fp32")
    (out / "manifest.json.tmp").write_text("{")
    (out / ".ds_capture").mkdir()
    assert prepare_output_dir(out, make_manifest()) == set()
    assert sorted(p.name for p in out.iterdir()) == [".ds_capture", "target_weights.safetensors"]


def test_prepare_refuses_foreign_manifest_and_changes_nothing(tmp_path):
    write_cache(tmp_path, make_manifest(), complete=False)
    (tmp_path / "shard-000001.safetensors.tmp").write_bytes(b"partial")
    before = hash_tree(tmp_path)
    run = make_manifest(seq_length=1024, target_layer_ids=(1, 3), target_hidden_dim=16, train_split="train")
    with pytest.raises(CaptureError) as err:
        prepare_output_dir(tmp_path, run)
    assert str(err.value) == (
        f"{tmp_path} holds a different cache: seq_length is 12 there, 1024 in this run; "
        "target_hidden_dim is 24 there, 16 in this run; target_layer_ids is [1, 2, 3] there, [1, 3] in this run; "
        "train_split is None there, 'train' in this run. "
        f"Use a new cache_output_dir or delete {tmp_path} to recompute it (nothing in it was changed)."
    )
    with pytest.raises(CaptureError):
        prepare_output_dir(tmp_path, run, restart=True)
    assert hash_tree(tmp_path) == before


def test_prepare_refuses_foreign_manifest_of_nemo_fixture(tmp_path):
    cache = copy_fixture("cache_fp32", tmp_path)
    before = hash_tree(cache)
    run = Manifest.from_json((cache / "manifest.json").read_text(), "m")
    with pytest.raises(CaptureError, match=r"holds a different cache: dtype is 'fp32' there, 'bf16' in this run\."):
        prepare_output_dir(cache, make_manifest(**{**_fields(run), "dtype": "bf16"}))
    assert hash_tree(cache) == before
    # Same identity as NeMo's own complete cache: nothing left to do.
    assert prepare_output_dir(cache, run.with_complete(False)) == {0, 1, 2}


def _fields(manifest):
    return {name: getattr(manifest, name) for name in IDENTITY_FIELDS}


def test_prepare_continues_incomplete_run_with_only_valid_shards(tmp_path):
    manifest = make_manifest(num_samples=22, shard_size=4)  # 6 shards, the last of 2 rows
    write_cache(tmp_path, manifest, complete=False)
    shard = lambda i: tmp_path / shard_name(i)  # noqa: E731
    # 1: truncated mid-data; 2: one data byte changed (header still valid, checksum differs);
    # 3: no checksum record (killed between rename and sidecar); 4: never written.
    shard(1).write_bytes(shard(1).read_bytes()[:-100])
    data = bytearray(shard(2).read_bytes())
    data[-1] ^= 0xFF
    shard(2).write_bytes(bytes(data))
    (tmp_path / ".ds_capture" / "checksums" / "shard-000003.checksum").unlink()
    shard(4).unlink()
    (tmp_path / "shard-000004.safetensors.tmp").write_bytes(b"partial")
    (tmp_path / ".ds_capture" / "checksums" / "shard-000004.checksum.tmp").write_text("x")

    assert prepare_output_dir(tmp_path, manifest) == {0, 5}
    assert not list(tmp_path.rglob("*.tmp"))
    # Bookkeeping is not identity: a different producer record still continues.
    assert prepare_output_dir(tmp_path, make_manifest(num_samples=22, shard_size=4, bookkeeping={"producer": 1})) == {0, 5}
    assert prepare_output_dir(tmp_path, manifest, restart=True) == set()


def test_prepare_rejects_shard_with_wrong_layout_even_if_checksum_matches(tmp_path):
    manifest = make_manifest()
    write_cache(tmp_path, manifest, complete=False)
    wrong = make_manifest(num_samples=12)  # shard 2 as if it had 4 rows
    tensors = make_shard_tensors(wrong, 2)
    writer.write_atomic(tmp_path / shard_name(2), lambda tmp: writer.save_file(tensors, tmp))
    digest = file_digest(tmp_path / shard_name(2))
    (tmp_path / ".ds_capture" / "checksums" / "shard-000002.checksum").write_text(f"{digest}  shard-000002.safetensors\n")
    assert prepare_output_dir(tmp_path, manifest) == {0, 1}


def test_prepare_complete_same_identity_returns_all(tmp_path):
    manifest = make_manifest()
    write_cache(tmp_path, manifest, complete=True)
    assert prepare_output_dir(tmp_path, manifest) == {0, 1, 2}


def test_prepare_refuses_non_empty_dir_without_manifest(tmp_path):
    for name in ["notes.txt", "a.bin", "b", "c", "d", "e", "shard-000000.safetensors"]:
        (tmp_path / name).write_text("mine")
    (tmp_path / "target_weights.safetensors").write_text("x")
    before = hash_tree(tmp_path)
    with pytest.raises(CaptureError) as err:
        prepare_output_dir(tmp_path, make_manifest())
    assert str(err.value) == (
        f"cache_output_dir {tmp_path} is not empty and holds no ds_capture/NeMo cache manifest (manifest.json): "
        "it contains a.bin, b, c, d, e (and 2 more). Use a new or empty cache_output_dir."
    )
    assert hash_tree(tmp_path) == before


def test_make_shard_tensors_pads_with_pad_id():
    tensors = make_shard_tensors(make_manifest(), 0)
    assert tensors["input_ids"][:, -1].tolist() == [tensors["input_ids"][0, -1].item(), PAD_ID, PAD_ID, PAD_ID]
