"""The manifest contract: fields, JSON types, NeMo's exact formatting, refusals, identity."""

from __future__ import annotations

import json

import pytest
import torch
from cache_helpers import fixture_dir, make_manifest

from ds_capture.cache.common.names import DTYPES, SHARD_RE, num_shards, shard_name
from ds_capture.cache.dspark.format import IDENTITY_FIELDS, Manifest
from ds_capture.errors import CaptureError

# The values of the two reference caches, typed in by hand so to_json is tested, not round-tripped.
FIXTURE_VALUES = {
    "cache_fp32": dict(dtype="fp32", mask_generation_prompt=False, mask_reasoning_content=False,
                       chat_template_sha256="e9a7d7783307ad6563c2257c15eaf555c819eb0a93d9a60698e8e448fe871f7b"),
    "cache_bf16_plain_masked": dict(dtype="bf16", mask_generation_prompt=True, mask_reasoning_content=True,
                                    chat_template_sha256="c2dec8de783b2288584b494164c3be12831c2e33a104c1bb00cc3897506d3805"),
}


def fixture_manifest(name: str) -> Manifest:
    return Manifest(
        target_model="target", target_model_type="qwen3", target_vocab_size=384, hidden_size=64,
        num_hidden_layers=4, seq_length=48, num_samples=10, shard_size=4, target_hidden_dim=192,
        target_last_hidden_dim=64, target_layer_ids=[1, 2, 3], train_data_path="data.jsonl",
        train_split=None, shuffle_seed=42, complete=True, **FIXTURE_VALUES[name],
    )


@pytest.mark.parametrize("name", sorted(FIXTURE_VALUES))
def test_to_json_is_byte_identical_to_nemo_manifest(name):
    expected = (fixture_dir(name) / "manifest.json").read_bytes()
    assert fixture_manifest(name).to_json().encode("utf-8") == expected


@pytest.mark.parametrize("name", sorted(FIXTURE_VALUES))
def test_from_json_parses_nemo_manifest(name):
    path = fixture_dir(name) / "manifest.json"
    parsed = Manifest.from_json(path.read_text(), str(path))
    assert parsed == fixture_manifest(name)
    assert parsed.target_layer_ids == (1, 2, 3) and parsed.bookkeeping == {}


def test_json_layout_sorted_two_space_no_trailing_newline():
    text = make_manifest(train_split="train[:10]").to_json()
    assert not text.endswith("\n")
    assert text.splitlines()[1] == '  "chat_template_sha256": "' + "ab" * 32 + '",'
    keys = list(json.loads(text))
    assert keys == sorted(keys) and len(keys) == 20
    assert json.loads(text)["train_split"] == "train[:10]"


def test_bookkeeping_written_at_top_level_and_kept_on_read():
    manifest = make_manifest(bookkeeping={"producer": {"name": "ds_capture", "world_size": 2}})
    obj = json.loads(manifest.to_json())
    assert obj["producer"] == {"name": "ds_capture", "world_size": 2}
    back = Manifest.from_json(manifest.to_json(), "m.json")
    assert back == manifest and back.bookkeeping == {"producer": {"name": "ds_capture", "world_size": 2}}


def test_identity_fields_are_all_contract_fields_but_version_and_complete():
    assert set(IDENTITY_FIELDS) == {
        "target_model", "target_model_type", "target_vocab_size", "hidden_size", "num_hidden_layers",
        "seq_length", "dtype", "num_samples", "shard_size", "target_hidden_dim", "target_last_hidden_dim",
        "target_layer_ids", "train_data_path", "train_split", "shuffle_seed", "mask_reasoning_content",
        "mask_generation_prompt", "chat_template_sha256",
    }
    assert len(IDENTITY_FIELDS) == 18


CHANGED = {
    "target_model": "other/model", "target_model_type": "llama", "target_vocab_size": 51, "hidden_size": 16,
    "num_hidden_layers": 5, "seq_length": 13, "dtype": "bf16", "num_samples": 11, "shard_size": 2,
    "target_hidden_dim": 16, "target_last_hidden_dim": 16, "target_layer_ids": (1, 3),
    "train_data_path": "other.jsonl", "train_split": "train", "shuffle_seed": 0,
    "mask_reasoning_content": True, "mask_generation_prompt": True, "chat_template_sha256": "cd" * 32,
}


@pytest.mark.parametrize("field_name", IDENTITY_FIELDS)
def test_identity_diff_names_each_field(field_name):
    base = make_manifest()
    other = make_manifest(**{field_name: CHANGED[field_name]})
    assert base.identity_diff(other) == [field_name]
    assert other.identity_diff(base) == [field_name]


def test_identity_ignores_complete_and_bookkeeping():
    base = make_manifest()
    assert base.identity_diff(make_manifest(complete=True, bookkeeping={"producer": "x"})) == []
    assert base.with_complete(True).complete is True and base.complete is False
    assert base.identity_diff(make_manifest(seq_length=99, dtype="fp16")) == ["seq_length", "dtype"]


def _text_without(field_name):
    obj = json.loads(make_manifest().to_json())
    del obj[field_name]
    return json.dumps(obj)


def test_from_json_missing_field_names_file_and_field():
    with pytest.raises(CaptureError) as err:
        Manifest.from_json(_text_without("seq_length"), "/c/manifest.json")
    assert str(err.value) == (
        "/c/manifest.json has no field 'seq_length' (int); it is not a complete DSpark cache manifest "
        "(format v1). Re-create the cache with a current producer."
    )


@pytest.mark.parametrize(
    "field_name, value, shown",
    [
        ("hidden_size", True, "true (bool), expected int"),
        ("complete", 1, "1 (int), expected bool"),
        ("seq_length", 48.0, "48.0 (float), expected int"),
        ("target_layer_ids", [1, True], "[1, true] (list), expected list of int"),
        ("target_layer_ids", "1,2", '"1,2" (str), expected list of int'),
        ("train_split", 3, "3 (int), expected str or null"),
        ("target_model", None, "null (null), expected str"),
    ],
)
def test_from_json_wrong_type_names_field_value_and_type(field_name, value, shown):
    obj = json.loads(make_manifest().to_json())
    obj[field_name] = value
    with pytest.raises(CaptureError) as err:
        Manifest.from_json(json.dumps(obj), "/c/manifest.json")
    assert str(err.value) == (
        f"/c/manifest.json: field '{field_name}' is {shown}. "
        "The manifest is damaged or from another tool; re-create the cache."
    )


def test_from_json_refuses_bad_json_other_version_and_unknown_dtype():
    with pytest.raises(CaptureError, match=r"^/c/manifest.json: not valid JSON \(Expecting property name enclosed in "
                       r"double quotes at column 2\)\. A cache manifest is a JSON object: delete the cache "
                       r"directory and re-run, or point at the right directory\.$"):
        Manifest.from_json("{not json", "/c/manifest.json")
    with pytest.raises(CaptureError, match=r"^/c/manifest.json holds a JSON list, not an object"):
        Manifest.from_json("[]", "/c/manifest.json")
    obj = json.loads(make_manifest().to_json())
    with pytest.raises(CaptureError) as err:
        Manifest.from_json(json.dumps({**obj, "format_version": 2}), "/c/manifest.json")
    assert str(err.value).startswith("/c/manifest.json: format_version is 2, this tool reads and writes format 1 only.")
    with pytest.raises(CaptureError) as err:
        Manifest.from_json(json.dumps({**obj, "dtype": "fp8"}), "/c/manifest.json")
    assert str(err.value) == "/c/manifest.json: field 'dtype' is \"fp8\", expected one of ['bf16', 'fp16', 'fp32']."


def test_shard_naming_and_counts():
    assert shard_name(7) == "shard-000007.safetensors"
    assert SHARD_RE.match(shard_name(123456)).group(1) == "123456"
    assert SHARD_RE.match("shard-1.safetensors") is None and SHARD_RE.match("shard-000001.safetensors.tmp") is None
    assert [num_shards(n, 4) for n in (0, 1, 4, 5, 8, 10)] == [0, 1, 1, 2, 2, 3]
    manifest = make_manifest(num_samples=10, shard_size=4)
    assert manifest.num_shards == 3
    assert [manifest.shard_rows(i) for i in range(3)] == [4, 4, 2]
    with pytest.raises(IndexError):
        manifest.shard_rows(3)


def test_expected_shard_tensors():
    manifest = make_manifest(dtype="bf16")
    assert manifest.expected_shard_tensors(2) == {
        "input_ids": ((2, 12), torch.int64),
        "loss_mask": ((2, 12), torch.int64),
        "target_hidden_states": ((2, 12, 24), torch.bfloat16),
        "target_last_hidden_states": ((2, 12, 8), torch.bfloat16),
    }
    assert DTYPES == {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def test_consistency_problems():
    assert make_manifest().consistency_problems() == []
    assert make_manifest(target_hidden_dim=20, target_layer_ids=(3, 1)).consistency_problems() == [
        "target_layer_ids [3, 1] must be strictly increasing within -1..3",
        "target_hidden_dim 20 != hidden_size 8 x 2 layer ids",
    ]
