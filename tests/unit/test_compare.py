"""compare_caches and ``ds-capture compare``: exit 0 equal within tolerance, 1 different, 2 not a valid cache."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from cache_helpers import copy_fixture, fixture_dir, make_manifest, write_cache
from safetensors.torch import load_file, save_file

from ds_capture.cache.common.names import shard_name
from ds_capture.cache.common.verify import DEFAULT_TOLERANCES
from ds_capture.cache.registry import compare_caches
from ds_capture.cli import main
from ds_capture.errors import CaptureError


def _cache(root: Path, name: str, **overrides) -> Path:
    out = root / name
    write_cache(out, make_manifest(**overrides))
    return out


def _edit_shard(cache: Path, index: int, edit) -> None:
    """Rewrite one shard with ``edit(tensors)`` applied (the sidecar checksum is left stale on purpose)."""
    path = cache / shard_name(index)
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)


def test_identical_caches_are_equal(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    a, b = _cache(tmp_path, "a"), _cache(tmp_path, "b")
    report = compare_caches(a, b, atol=None, rtol=None)
    assert report.equal and report.compared_tensors and not report.identity_diff
    assert (report.atol, report.rtol) == DEFAULT_TOLERANCES["fp32"]
    # Three shards (10 samples / 4) plus the target weights, every key seen.
    assert [s.name for s in report.shards] == ["target_weights.safetensors"] + [shard_name(i) for i in range(3)]
    assert set(report.keys) == {"embed_tokens.weight", "lm_head.weight", "input_ids", "loss_mask",
                                "target_hidden_states", "target_last_hidden_states"}
    assert all(d.max_abs == 0 and d.numel > 0 for d in report.keys.values())
    assert main(["compare", str(a), str(b)]) == 0
    assert "verdict: EQUAL" in capsys.readouterr().out


def test_float_perturbed_beyond_tolerance_names_key_and_shard(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    a, b = _cache(tmp_path, "a"), _cache(tmp_path, "b")

    def bump(tensors):
        tensors["target_hidden_states"][1, 3, 5] += 1e-3

    _edit_shard(a, 2, bump)
    report = compare_caches(a, b, atol=None, rtol=None)
    assert not report.equal
    assert report.failing_shards == [shard_name(2)]
    diff = report.keys["target_hidden_states"]
    assert diff.num_mismatched == 1 and diff.max_abs == pytest.approx(1e-3, rel=1e-3)
    assert report.keys["target_last_hidden_states"].ok and report.keys["input_ids"].ok

    assert main(["compare", str(a), str(b), "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["equal"] is False and out["failing_shards"] == [shard_name(2)]
    assert out["keys"]["target_hidden_states"]["ok"] is False
    assert main(["compare", str(a), str(b)]) == 1
    text = capsys.readouterr().out
    assert f"{shard_name(2)}: target_hidden_states" in text and "verdict: DIFFERENT" in text
    # A looser tolerance accepts the same difference.
    assert main(["compare", str(a), str(b), "--atol", "2e-3"]) == 0


def test_difference_within_tolerance_is_equal(tmp_path: Path) -> None:
    a, b = _cache(tmp_path, "a"), _cache(tmp_path, "b")
    _edit_shard(a, 0, lambda t: t["target_last_hidden_states"].add_(5e-6))
    report = compare_caches(a, b, atol=None, rtol=None)
    assert report.equal
    assert report.keys["target_last_hidden_states"].max_abs == pytest.approx(5e-6, rel=0.1)


def test_bf16_default_tolerance_is_ulp_scale(tmp_path: Path) -> None:
    a, b = _cache(tmp_path, "a", dtype="bf16"), _cache(tmp_path, "b", dtype="bf16")

    def one_ulp(tensors):  # next representable bf16 value away from zero: 1 ulp
        h = tensors["target_hidden_states"]
        h[0, 0, 0] = torch.nextafter(h[0, 0, 0], h[0, 0, 0] * 2)

    _edit_shard(a, 0, one_ulp)
    assert compare_caches(a, b, atol=None, rtol=None).equal
    _edit_shard(a, 1, lambda t: t["target_hidden_states"][0, 0].mul_(1.1))  # 10%: far beyond 2 ulp
    report = compare_caches(a, b, atol=None, rtol=None)
    assert not report.equal and report.failing_shards == [shard_name(1)]


def test_changed_token_id_is_different(tmp_path: Path) -> None:
    a, b = _cache(tmp_path, "a"), _cache(tmp_path, "b")
    _edit_shard(b, 1, lambda t: t["input_ids"][0, 0].add_(1))
    report = compare_caches(a, b, atol=1.0, rtol=1.0)  # integers are exact whatever the float tolerance
    assert not report.equal
    assert report.keys["input_ids"].num_mismatched == 1 and report.keys["input_ids"].max_abs == 1
    assert report.failing_shards == [shard_name(1)]
    assert main(["compare", str(a), str(b), "--atol", "1", "--rtol", "1"]) == 1


def test_identity_difference_is_reported_side_by_side(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    a, b = _cache(tmp_path, "a"), _cache(tmp_path, "b", shuffle_seed=7)
    report = compare_caches(a, b, atol=None, rtol=None)
    assert report.identity_diff == ["shuffle_seed"] and report.identity["shuffle_seed"] == (42, 7)
    assert not report.equal and report.compared_tensors  # same shapes: tensors still compared
    c = _cache(tmp_path, "c", seq_length=10)
    report = compare_caches(a, c, atol=None, rtol=None)
    assert report.identity_diff == ["seq_length"] and not report.compared_tensors and not report.equal
    assert main(["compare", str(a), str(c)]) == 1
    assert "seq_length: A 12 | B 10" in capsys.readouterr().out


@pytest.mark.parametrize("damage", ["incomplete", "no_manifest", "foreign", "missing_shard", "not_a_dir"])
def test_invalid_cache_exits_2(tmp_path: Path, damage: str, capsys: pytest.CaptureFixture) -> None:
    good = _cache(tmp_path, "good")
    bad = tmp_path / "bad"
    if damage == "incomplete":
        write_cache(bad, make_manifest(), complete=False)
    elif damage == "no_manifest":
        write_cache(bad, make_manifest())
        (bad / "manifest.json").unlink()
    elif damage == "foreign":
        bad.mkdir()
        (bad / "manifest.json").write_text(json.dumps({"model": "something else"}))
    elif damage == "missing_shard":
        write_cache(bad, make_manifest())
        (bad / shard_name(1)).unlink()
    with pytest.raises(CaptureError):
        compare_caches(good, bad, atol=None, rtol=None)
    assert main(["compare", str(bad), str(good)]) == 2
    assert main(["compare", str(good), str(bad)]) == 2
    assert "ds-capture compare: error:" in capsys.readouterr().err


def test_nemo_reference_cache_equals_its_copy(tmp_path: Path) -> None:
    source = fixture_dir("cache_bf16_plain_masked")
    copy = copy_fixture("cache_bf16_plain_masked", tmp_path)
    assert compare_caches(copy, source, atol=None, rtol=None).equal
    _edit_shard(copy, 0, lambda t: t["loss_mask"][0].fill_(1 - int(t["loss_mask"][0, 0])))
    report = compare_caches(copy, source, atol=None, rtol=None)
    assert not report.equal and report.failing_shards == [shard_name(0)]
    assert report.keys["loss_mask"].num_mismatched > 0
