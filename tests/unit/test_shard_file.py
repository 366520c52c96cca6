"""Shards written in place: safetensors' own bytes, padding tails as holes, a checksum from the rows as
written (never a read of the finished shard), and a writer whose host memory is a bounded set of slots."""

from __future__ import annotations

import builtins
import dataclasses
import os
import threading
import time

import pytest
import torch
from cache_helpers import make_manifest, make_shard_tensors
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ds_capture.cache.common.async_writer import AsyncShardWriter, MicroBatch
from ds_capture.cache.common.files import checksum_matches, read_recorded_checksum, sha256_file
from ds_capture.cache.common.names import shard_name
from ds_capture.cache.common.shard_file import SafetensorsLayout, ShardFile, file_digest, read_tensors
from ds_capture.cache.common.staging import HostStaging
from ds_capture.cache.dspark.writer import DSparkShards, write_manifest
from ds_capture.cache.registry import verify_cache

LAYOUTS = {
    "dspark_bf16": {"input_ids": ((3, 5), torch.int64), "loss_mask": ((3, 5), torch.int64),
                    "target_hidden_states": ((3, 5, 12), torch.bfloat16),
                    "target_last_hidden_states": ((3, 5, 4), torch.bfloat16)},
    "names_against_dtype_order": {"a": ((2,), torch.float16), "b": ((3, 1), torch.bfloat16), "c": ((1,), torch.float32),
                                  "d": ((0, 4), torch.int64), "e": ((2, 2), torch.int32), "f": ((), torch.float64),
                                  "g": ((5,), torch.uint8), "h": ((1,), torch.bool)},
    "one_tensor_odd_header": {"x" * 13: ((7,), torch.float32)},
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_layout_is_exactly_what_safetensors_writes(name, tmp_path):
    specs = LAYOUTS[name]
    tensors = {key: torch.ones(shape, dtype=dtype) for key, (shape, dtype) in specs.items()}
    save_file(tensors, tmp_path / "ref.safetensors")
    ref = (tmp_path / "ref.safetensors").read_bytes()
    layout = SafetensorsLayout.build(specs)
    assert layout.header == ref[:len(layout.header)] and len(layout.header) % 8 == 0
    assert layout.total_bytes == len(ref)
    # Each slot's rows are where safetensors put that tensor's data.
    for slot in layout.slots:
        raw = tensors[slot.name].contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        assert ref[slot.offset:slot.offset + len(raw)] == raw and slot.num_rows * slot.row_bytes == len(raw)


def _wide_manifest():
    # Rows of 256 positions x (3 + 1) x 64 fp32 = 256 KiB: a padded tail spans whole 4 KiB blocks.
    return make_manifest(seq_length=256, hidden_size=64, target_hidden_dim=192, target_last_hidden_dim=64,
                         num_samples=6, shard_size=6)


def _rows_with_garbage_tails(manifest, lengths):
    """Dense reference tensors (zeros past each row's length) and the same rows as a capture produces them:
    computed at T > length with non-zero values on the padding positions (which must never be written)."""
    dense = make_shard_tensors(manifest, 0)
    for key in ("target_hidden_states", "target_last_hidden_states"):
        for row, length in enumerate(lengths):
            dense[key][row, length:] = 0
    captured = {key: dense[key].clone() for key in dense}
    for key in ("target_hidden_states", "target_last_hidden_states"):
        for row, length in enumerate(lengths):
            captured[key][row, length:] = 5.0
    return dense, captured


def test_sparse_shard_reads_back_byte_identical_to_the_dense_one_with_holes(tmp_path):
    manifest = _wide_manifest()
    lengths = [256, 17, 200, 1, 64, 90]
    dense, captured = _rows_with_garbage_tails(manifest, lengths)
    save_file(dense, tmp_path / "dense.safetensors")
    kind = DSparkShards(tmp_path, manifest)
    shard = kind.open(0)
    # Rows arrive out of order (sorted by length), each micro-batch computed at its own length T.
    for rows in ([0, 2], [5, 4], [1, 3]):
        T = max(lengths[r] for r in rows) + 3
        picked = torch.tensor(rows)
        batch = {key: value[picked].contiguous() if value.dim() == 2 else value[picked, :T].contiguous()
                 for key, value in captured.items()}
        shard.write_rows(picked, batch, torch.tensor([lengths[r] for r in rows]))
    written = kind.finish(0, shard)
    path = tmp_path / shard_name(0)
    assert path.read_bytes() == (tmp_path / "dense.safetensors").read_bytes()
    assert not shard.tmp.exists()
    stat = path.stat()
    assert written.logical_bytes == stat.st_size and written.disk_bytes == stat.st_blocks * 512
    real = sum(lengths) * (192 + 64) * 4 + 2 * 6 * 256 * 8 + len(shard.layout.header)
    assert written.bytes_written == real and real < 0.6 * stat.st_size
    assert stat.st_blocks * 512 < 0.7 * stat.st_size, "no holes: padding tails were allocated on disk"
    # safetensors' own readers (what NeMo's cache dataset uses): load_file and a lazily mmapped safe_open.
    loaded = load_file(path)
    assert all(torch.equal(loaded[key], dense[key]) for key in dense)
    with safe_open(path, framework="pt") as f:
        assert torch.equal(f.get_slice("target_hidden_states")[1, 10:20], dense["target_hidden_states"][1, 10:20])
        assert torch.equal(f.get_tensor("input_ids"), dense["input_ids"])
    # The checksum computed from the rows as written equals the one computed from the file.
    assert read_recorded_checksum(tmp_path, 0) == file_digest(path)


def test_rows_digest_changes_with_any_byte_and_with_the_length(tmp_path):
    manifest = make_manifest()
    tensors = make_shard_tensors(manifest, 0)
    path = tmp_path / "a.safetensors"
    save_file(tensors, path)
    digest = file_digest(path)
    data = bytearray(path.read_bytes())
    for position in (3, 60, 400, len(data) - 1):  # header length, header JSON, input_ids, last hidden state
        changed = bytearray(data)
        changed[position] ^= 0x10
        path.write_bytes(bytes(changed))
        assert not checksum_matches(path, digest), position
    path.write_bytes(bytes(data) + b"\0")
    assert file_digest(path) != digest
    path.write_bytes(bytes(data)[:-1])
    assert not checksum_matches(path, digest)
    path.write_bytes(bytes(data))
    assert file_digest(path) == digest and checksum_matches(path, digest)


def test_an_earlier_versions_sha256_sidecar_still_verifies(tmp_path):
    from cache_helpers import write_cache

    manifest = make_manifest()
    write_cache(tmp_path, manifest)
    checksums = tmp_path / ".ds_capture" / "checksums"
    for i in range(manifest.num_shards):
        (checksums / f"shard-00000{i}.checksum").unlink()
        (checksums / f"shard-00000{i}.sha256").write_text(f"{sha256_file(tmp_path / shard_name(i))}  {shard_name(i)}\n")
    assert verify_cache(tmp_path, checksums=True).problems == []
    (checksums / "shard-000002.sha256").write_text("ab" * 32 + "  shard-000002.safetensors\n")
    assert verify_cache(tmp_path, checksums=True).problems == [
        f"shard-000002.safetensors: sha256 {sha256_file(tmp_path / shard_name(2))} differs from the recorded "
        f"{'ab' * 32}: the file changed after it was written"]


def _micro_batches(manifest, index, lengths, batch_size=2):
    dense, captured = _rows_with_garbage_tails(manifest, lengths)
    order = sorted(range(len(lengths)), key=lambda r: -lengths[r])
    for lo in range(0, len(order), batch_size):
        rows = torch.tensor(order[lo:lo + batch_size])
        T = int(max(lengths[r] for r in rows.tolist()))
        yield MicroBatch(shard_index=index, rows=rows, num_tokens=torch.tensor([lengths[r] for r in rows.tolist()]),
                         tensors={key: v[rows].contiguous() if v.dim() == 2 else v[rows, :T].contiguous()
                                  for key, v in captured.items()})
    yield dense


def _read_bytes_so_far() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


def test_no_read_of_a_shard_after_writing_it(tmp_path, monkeypatch):
    manifest = dataclasses.replace(_wide_manifest(), num_samples=12)  # two shards
    write_manifest(tmp_path, manifest)
    lengths = [256, 17, 200, 1, 64, 90]
    opened_for_reading = []
    real_open, real_os_open = builtins.open, os.open

    def watched_open(file, mode="r", *args, **kwargs):
        if ".safetensors" in str(file) and not any(flag in mode for flag in "wax"):
            opened_for_reading.append(str(file))
        return real_open(file, mode, *args, **kwargs)

    def watched_os_open(path, flags, *args, **kwargs):
        if ".safetensors" in str(path) and (flags & os.O_ACCMODE) != os.O_WRONLY:
            opened_for_reading.append(str(path))
        return real_os_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", watched_open)
    monkeypatch.setattr(os, "open", watched_os_open)
    staging = HostStaging(max_in_flight=2, buffer_bytes=1, device=torch.device("cpu"))
    references = {}
    before = _read_bytes_so_far()
    with AsyncShardWriter(DSparkShards(tmp_path, manifest), staging) as writer:
        for index in range(2):
            *batches, references[index] = _micro_batches(manifest, index, lengths)
            for batch in batches:
                writer.put(batch)
    read = _read_bytes_so_far() - before  # every read(2) of this process, whatever library made it
    monkeypatch.undo()
    shard_bytes = sum((tmp_path / shard_name(i)).stat().st_size for i in range(2))
    assert opened_for_reading == [] and read < 0.01 * shard_bytes, (opened_for_reading, read, shard_bytes)
    assert writer.shards_written == 2 and writer.logical_bytes == shard_bytes
    for index in range(2):
        loaded = load_file(tmp_path / shard_name(index))
        assert all(torch.equal(loaded[key], references[index][key]) for key in loaded)
        assert read_recorded_checksum(tmp_path, index) == file_digest(tmp_path / shard_name(index))


def test_the_forward_loop_waits_while_every_host_slot_is_held(tmp_path, monkeypatch):
    manifest = _wide_manifest()
    gate, started = threading.Event(), threading.Event()
    real_write_rows = ShardFile.write_rows

    def gated_write_rows(self, *args):
        started.set()
        gate.wait(timeout=30)
        return real_write_rows(self, *args)

    monkeypatch.setattr(ShardFile, "write_rows", gated_write_rows)
    staging = HostStaging(max_in_flight=2, buffer_bytes=1, device=torch.device("cpu"))
    *batches, dense = _micro_batches(manifest, 0, [256, 17, 200, 1, 64, 90])
    with AsyncShardWriter(DSparkShards(tmp_path, manifest), staging) as writer:
        writer.put(batches[0])
        writer.put(batches[1])
        assert started.wait(timeout=30)  # the writer holds batch 0 (its slot), batch 1 is queued
        third = threading.Thread(target=writer.put, args=(batches[2],))
        third.start()
        time.sleep(0.3)
        assert third.is_alive(), "put returned with both slots held: host memory is not bounded"
        gate.set()
        third.join(timeout=30)
        assert not third.is_alive()
    loaded = load_file(tmp_path / shard_name(0))
    assert all(torch.equal(loaded[key], dense[key]) for key in loaded)


def test_a_failed_shard_leaves_no_tmp_and_no_final_file(tmp_path, monkeypatch):
    manifest = _wide_manifest()
    *batches, _ = _micro_batches(manifest, 0, [256, 17, 200, 1, 64, 90])
    real_write_rows, calls = ShardFile.write_rows, []

    def failing(self, *args):
        calls.append(1)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real_write_rows(self, *args)

    monkeypatch.setattr(ShardFile, "write_rows", failing)
    staging = HostStaging(max_in_flight=1, buffer_bytes=1, device=torch.device("cpu"))
    with pytest.raises(OSError, match="No space left"):
        with AsyncShardWriter(DSparkShards(tmp_path, manifest), staging, synchronous=True) as writer:
            for batch in batches:
                writer.put(batch)
    assert sorted(p.name for p in tmp_path.iterdir()) == [] and len(calls) == 2
    calls.clear()
    with pytest.raises(RuntimeError, match=r"the shard writer failed: \[Errno 28\] No space left") as caught:
        with AsyncShardWriter(DSparkShards(tmp_path, manifest), staging) as writer:
            for batch in batches:
                writer.put(batch)
    assert isinstance(caught.value.__cause__, OSError)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_queued_states_hold_no_device_memory(tmp_path):
    """Captured states leave the device at put: pinned slots, a side-stream copy, nothing queued on the GPU."""
    from ds_capture.cache.common.staging import slot_bytes

    device = torch.device("cuda", torch.cuda.current_device())
    manifest = _wide_manifest()
    *batches, dense = _micro_batches(manifest, 0, [256, 17, 200, 1, 64, 90])
    shapes = {key: ((2, 256, manifest.target_hidden_dim if key == "target_hidden_states" else 64), torch.float32)
              for key in DSparkShards.zero_tail}
    staging = HostStaging(max_in_flight=2, buffer_bytes=slot_bytes(shapes), device=device)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    with AsyncShardWriter(DSparkShards(tmp_path, manifest), staging) as writer:
        for batch in batches:
            on_device = {key: v.to(device) if key in DSparkShards.zero_tail else v for key, v in batch.tensors.items()}
            writer.put(MicroBatch(batch.shard_index, batch.rows, batch.num_tokens, on_device))
            del on_device
            assert all(t.device.type == "cpu" and t.is_pinned() for t in staging._free) if staging._free else True
    torch.cuda.synchronize()
    torch.empty(1, device=device)  # lets the allocator retire blocks whose side-stream copies have finished
    one_batch = max(sum(v.numel() * v.element_size() for k, v in b.tensors.items() if k in DSparkShards.zero_tail)
                    for b in batches)
    assert torch.cuda.memory_allocated(device) - base <= 512  # the 1-element tensor above
    assert torch.cuda.max_memory_allocated(device) - base <= 2 * one_batch + 4096
    loaded = load_file(tmp_path / shard_name(0))
    assert all(torch.equal(loaded[key], dense[key]) for key in loaded)


def test_demo_capture_stores_fewer_bytes_than_its_logical_size_and_verifies(tmp_path):
    """The demo recipe (its first 16 rows, one shard): padding tails are holes on disk; NeMo's reader path
    (safetensors' mmap) sees the zeros; the recorded checksums verify."""
    from pathlib import Path

    from ds_capture.cache.registry import inspect_cache
    from ds_capture.recipe.config import load_config
    from ds_capture.runner import run_capture

    recipe = Path(__file__).resolve().parents[2] / "configs" / "demo.yaml"
    out = tmp_path / "demo"
    overrides = [f"recipe_args.cache_output_dir={out}", "recipe_args.train_split=train[:16]",
                 "recipe_args.cache_shard_size=16"]
    summary = run_capture(load_config(recipe, overrides=overrides), show_progress=False)
    shard = out / shard_name(0)
    assert summary.logical_bytes == shard.stat().st_size and summary.disk_bytes == shard.stat().st_blocks * 512
    assert summary.disk_bytes < 0.6 * summary.logical_bytes, (summary.disk_bytes, summary.logical_bytes)
    assert summary.bytes_written < 0.6 * summary.logical_bytes and 0.4 < summary.padding_fraction < 1
    info = inspect_cache(out)
    assert info["bytes_on_disk"] < info["logical_bytes"] and info["padding_fraction"] > 0.5
    assert verify_cache(out, checksums=True).problems == []
    with safe_open(shard, framework="pt") as f:
        ids, hidden = f.get_tensor("input_ids"), f.get_slice("target_hidden_states")
        real = int((ids[0] != ids[0, -1]).sum())  # row 0 ends in padding in the demo data
        assert real < ids.shape[1] and not hidden[0, real:].any() and hidden[0, :real].abs().sum() > 0


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_read_tensors_without_a_map_equals_safetensors_own_reader(tmp_path, layout):
    gen = torch.Generator().manual_seed(3)
    tensors = {name: (torch.randn(shape, generator=gen) * 50).to(dtype) for name, (shape, dtype) in LAYOUTS[layout].items()}
    save_file(tensors, tmp_path / "a.safetensors")
    loaded, reference = read_tensors(tmp_path / "a.safetensors"), load_file(tmp_path / "a.safetensors")
    assert set(loaded) == set(reference)
    for name in reference:
        assert loaded[name].dtype == reference[name].dtype and torch.equal(loaded[name], reference[name]), name
    some = sorted(reference)[:1]
    assert set(read_tensors(tmp_path / "a.safetensors", some)) == set(some)


def test_read_tensors_refuses_what_safetensors_refuses(tmp_path):
    path = tmp_path / "a.safetensors"
    save_file({"x": torch.arange(6.0), "y": torch.ones(2, dtype=torch.int64)}, path)
    data = path.read_bytes()
    path.write_bytes(data[:-1])
    with pytest.raises(ValueError, match=rf"the data section ends at byte {len(data)}, the file at {len(data) - 1}"):
        read_tensors(path)
    path.write_bytes(data[:5])
    with pytest.raises(ValueError, match="5 bytes, shorter than the 8-byte length prefix"):
        read_tensors(path)
    # file_digest reads the header through the same reader and names the file.
    with pytest.raises(ValueError, match=rf"^{path}: 5 bytes, shorter than the 8-byte length prefix$"):
        file_digest(path)
    path.write_bytes(data[:8] + b"{}")
    with pytest.raises(ValueError, match=rf"^{path}: header length \d+ exceeds the file size 10$"):
        file_digest(path)
