"""The reader: verify passes NeMo's own caches and names each way a damaged copy breaks the contract."""

from __future__ import annotations

import json

import pytest
import torch
from cache_helpers import PAD_ID, copy_fixture, fixture_dir, make_manifest, write_cache
from safetensors.torch import load_file, save_file

from ds_capture.cache.common.verify import padding_lengths
from ds_capture.cache.dspark.format import Manifest
from ds_capture.cache.dspark.reader import read_manifest
from ds_capture.cache.registry import format_inspect, inspect_cache, verify_cache
from ds_capture.errors import CaptureError

FIXTURES = ["cache_fp32", "cache_bf16_plain_masked"]


@pytest.mark.parametrize("name", FIXTURES)
def test_verify_passes_nemo_reference_caches(name):
    report = verify_cache(fixture_dir(name))
    assert report.problems == [] and report.ok
    assert (report.num_samples, report.num_shards, report.num_shards_checked) == (10, 3, 3)
    assert (report.num_tokens, report.num_supervised_tokens, report.pad_id) == (372, 177, 363)
    assert report.summary() == f"{fixture_dir(name)}: OK: 10 samples in 3/3 shards checked, 372 tokens, 177 supervised"
    assert json.loads(json.dumps(report.to_dict()))["cache_dir"] == str(fixture_dir(name))


def test_verify_with_checksums_needs_records():
    report = verify_cache(fixture_dir("cache_fp32"), checksums=True)
    assert not report.ok
    assert report.problems == [
        f"shard-00000{i}.safetensors: no recorded checksum (.ds_capture/checksums/shard-00000{i}.checksum) to check against"
        for i in range(3)
    ]


def test_verify_writer_cache_with_checksums_and_detects_changed_bytes(tmp_path):
    manifest = make_manifest()
    write_cache(tmp_path, manifest)
    report = verify_cache(tmp_path, checksums=True)
    assert report.problems == [] and report.pad_id == PAD_ID
    # rows: content lengths 12, 11, 9, 7 (and 12, 11 in the 2-row last shard)
    assert report.num_tokens == 2 * (12 + 11 + 9 + 7) + 12 + 11
    path = tmp_path / "shard-000001.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01  # a float's low bit: still finite, still loadable
    path.write_bytes(bytes(data))
    problems = verify_cache(tmp_path, checksums=True).problems
    assert len(problems) == 2 and "differs from target_last_hidden_states" in problems[0]
    assert problems[1].startswith("shard-000001.safetensors: xxh3-128-rows ") and problems[1].endswith(
        "the file changed after it was written"
    )


def _rewrite(cache, shard, change):
    path = cache / f"shard-00000{shard}.safetensors"
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path)


def _set(key, index, value):
    def change(tensors):
        tensors[key][index] = value

    return change


@pytest.mark.parametrize(
    "damage, problem",
    [
        (lambda c: _rewrite(c, 1, _set("target_hidden_states", (2, 5, 7), float("nan"))),
         "shard-000001.safetensors: target_hidden_states holds 1 non-finite values (NaN/inf), first at row 2 position 5"),
        # Row 0 of shard 0 is padded from position 28 on; 28 itself is allowed (pad == eos), 29 is not.
        (lambda c: _rewrite(c, 0, _set("loss_mask", (0, slice(29, 48)), 1)),
         "shard-000000.safetensors: loss_mask is 1 on 19 padding positions (pad id 363), first at row 0 position 29"),
        (lambda c: _rewrite(c, 2, _set("loss_mask", (1, 3), 2)),
         "shard-000002.safetensors: loss_mask holds values other than 0/1: [2]"),
        (lambda c: (c / "shard-000001.safetensors").unlink(),
         "missing shards: shard-000001.safetensors (expected shard-000000 .. shard-000002.safetensors)"),
        (lambda c: (c / "shard-000003.safetensors").write_bytes((c / "shard-000002.safetensors").read_bytes()),
         "extra shards beyond num_shards 3: shard-000003.safetensors"),
        (lambda c: _rewrite(c, 2, lambda t: t.update(input_ids=t["input_ids"].int())),
         "shard-000002.safetensors: input_ids is [2, 48] int32, expected [2, 48] int64"),
        (lambda c: _rewrite(c, 0, lambda t: t.update(target_hidden_states=t["target_hidden_states"].half())),
         "shard-000000.safetensors: target_hidden_states is [4, 48, 192] float16, expected [4, 48, 192] float32"),
        (lambda c: _rewrite(c, 0, lambda t: t.pop("loss_mask")),
         "shard-000000.safetensors: holds tensors ['input_ids', 'target_hidden_states', 'target_last_hidden_states'], "
         "expected exactly ['input_ids', 'loss_mask', 'target_hidden_states', 'target_last_hidden_states']"),
        (lambda c: (c / "shard-000001.safetensors").write_bytes(b"\x10\x00"),
         "shard-000001.safetensors: unreadable safetensors file ("),
        (lambda c: _rewrite(c, 1, _set("target_last_hidden_states", (0, 0, 0), 0.5)),
         "shard-000001.safetensors: the last feature slice of target_hidden_states (layer 3, the post-norm output) "
         "differs from target_last_hidden_states"),
        (lambda c: (c / "target_weights.safetensors").unlink(), "target_weights.safetensors is missing"),
        (lambda c: save_file({"embed_tokens.weight": torch.zeros(384, 64), "lm_head.weight": torch.zeros(384, 64,
                              dtype=torch.bfloat16)}, c / "target_weights.safetensors"),
         "target_weights.safetensors: lm_head.weight is [384, 64] bfloat16, expected [384, 64] float32"),
        (lambda c: (c / "manifest.json").write_text((c / "manifest.json").read_text().replace('"complete": true',
                                                                                                 '"complete": false')),
         "manifest.json has complete: false: the run writing this cache has not finished (or was killed); "
         "re-run it with the same config to complete it"),
    ],
)
def test_verify_names_each_problem(tmp_path, damage, problem):
    cache = copy_fixture("cache_fp32", tmp_path)
    damage(cache)
    report = verify_cache(cache)
    assert not report.ok
    assert len(report.problems) == 1, report.problems
    assert report.problems[0].startswith(problem)
    assert report.summary().startswith(f"{cache}: FAILED (1 problem): ")


def test_verify_inf_in_last_hidden_state_is_named_with_the_slice_mismatch(tmp_path):
    cache = copy_fixture("cache_bf16_plain_masked", tmp_path)
    _rewrite(cache, 0, _set("target_last_hidden_states", (3, 1, 0), float("inf")))
    assert verify_cache(cache).problems == [
        "shard-000000.safetensors: target_last_hidden_states holds 1 non-finite values (NaN/inf), first at row 3 position 1",
        "shard-000000.safetensors: the last feature slice of target_hidden_states (layer 3, the post-norm output) "
        "differs from target_last_hidden_states",
    ]


def test_loss_on_first_pad_is_allowed_as_eos(tmp_path):
    cache = copy_fixture("cache_fp32", tmp_path)
    _rewrite(cache, 0, _set("loss_mask", (0, 28), 1))
    report = verify_cache(cache)
    assert report.problems == [] and report.num_supervised_tokens == 178


def test_verify_inconsistent_manifest_stops_before_shards(tmp_path):
    cache = copy_fixture("cache_bf16_plain_masked", tmp_path)
    text = (cache / "manifest.json").read_text().replace('"target_hidden_dim": 192', '"target_hidden_dim": 128')
    (cache / "manifest.json").write_text(text)
    report = verify_cache(cache)
    assert report.problems == ["manifest.json: target_hidden_dim 128 != hidden_size 64 x 3 layer ids"]
    assert report.num_shards_checked == 0


def test_verify_and_read_manifest_without_manifest(tmp_path):
    with pytest.raises(CaptureError) as err:
        read_manifest(tmp_path)
    message = (
        f"{tmp_path / 'manifest.json'} does not exist: {tmp_path} is not a ds_capture/NeMo DSpark cache, or the run "
        "that writes it has not started. Check the path (cache_output_dir of the run)."
    )
    assert str(err.value) == message
    assert verify_cache(tmp_path).problems == [message]


def test_read_manifest_of_fixture():
    manifest = read_manifest(fixture_dir("cache_bf16_plain_masked"))
    assert isinstance(manifest, Manifest) and manifest.dtype == "bf16" and manifest.complete


def test_padding_lengths():
    ids = torch.tensor([[5, 6, 0, 0, 0], [5, 6, 7, 8, 9], [0, 0, 0, 0, 0], [5, 0, 6, 0, 0]])
    assert padding_lengths(ids, 0).tolist() == [3, 0, 5, 2]
    assert padding_lengths(ids, None).tolist() == [0, 0, 0, 0]


def test_inspect_fixture():
    cache = fixture_dir("cache_fp32")
    info = inspect_cache(cache)
    sizes = ("logical_bytes", "bytes_on_disk", "padding_fraction")
    assert {k: v for k, v in info.items() if k not in ("identity", "bookkeeping", *sizes)} == {
        "cache_dir": str(cache), "complete": True, "format_version": 1, "samples": 10, "shards": 3,
        "expected_shards": 3, "shard_size": 4, "seq_length": 48, "tokens": 372, "supervised_tokens": 177,
        "pad_id": 363, "layers": [1, 2, 3], "dtype": "fp32", "numerics": None,  # NeMo's cache: no record
    }
    assert info["logical_bytes"] == 612 + 2 * 200008 + 100168 + 196784
    assert info["bytes_on_disk"] == sum(p.stat().st_blocks * 512 for p in cache.rglob("*") if p.is_file())
    assert info["padding_fraction"] == round(1 - 372 / (10 * 48), 6)
    assert info["identity"]["target_layer_ids"] == [1, 2, 3] and info["identity"]["train_split"] is None
    assert len(info["identity"]) == 18
    text = format_inspect(info)
    assert "samples      10 in 3/3 shards of 4" in text
    assert "tokens       372 non-padding (37.2 per sample), pad id 363" in text
    assert "(22.5% of row positions are padding)" in text
    assert '  chat_template_sha256    "e9a7d7783307ad6563c2257c15eaf555c819eb0a93d9a60698e8e448fe871f7b"' in text
