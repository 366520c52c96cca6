"""Quantized release checkpoints load dequantized, exactly, reading only this rank's share of the quantized bytes.

Per family x release scheme (``quant_release.build_release_pair``: ragged dims > 128, scales in another
shard file, a quantized MTP block, ``quantization_config`` in config.json), the single-process cache of the
quantized checkpoint is byte-identical to the cache of the same weights dequantized by an independent
reference (transformers' ``Fp8Dequantize`` for block-aligned FP8 / FP4, ``compressed-tensors`` for INT4,
block loops of our own for ragged FP8); that reference checkpoint carries the now stale
``quantization_config`` over fp32 tensors, so it shows the stale case loads too. The per-rank bytes read
(EP experts, dim-0 chunks, column / row slices not aligned to the 128 block) are computed here from the
block arithmetic and compared with what the loader counted. Errors name key and file.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors import safe_open
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).parent))
import quant_release as qr  # noqa: E402

from ds_capture.parallel.shard_spec import build_shard_spec  # noqa: E402
from ds_capture.target.shard_spec import Member  # noqa: E402
from ds_capture.errors import CaptureError  # noqa: E402
from ds_capture.parallel.expert_parallel import apply_expert_parallel  # noqa: E402
from ds_capture.recipe.config import load_config  # noqa: E402
from ds_capture.runner import run_capture  # noqa: E402
from ds_capture.target.families import read_target_info  # noqa: E402
from ds_capture.target.checkpoint_reads import OwnedSlice  # noqa: E402
from ds_capture.target.loading import (  # noqa: E402
    build_meta_model,
    checkpoint_sources,
    fill_from_checkpoint,
    load_owned_parameters,
)

CASES = [("deepseek_v3", "fp8"), ("deepseek_v4", "fp8_fp4"), ("kimi_k25", "int4"), ("qwen3_moe", "fp8"),
         ("glm_moe_dsa", "fp8"), ("qwen3_moe", "fp8_channel")]


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    root = tmp_path_factory.mktemp("quant_pairs")
    built: dict[tuple[str, str], tuple[Path, Path]] = {}

    def make(model_type: str, scheme: str) -> tuple[Path, Path]:
        if (model_type, scheme) not in built:
            built[model_type, scheme] = qr.build_release_pair(root / f"{model_type}-{scheme}", model_type, scheme)
        return built[model_type, scheme]

    return make


def _capture(target: Path, out: Path) -> Path:
    recipe = out.parent / f"{out.name}.yaml"
    recipe.write_text(yaml.safe_dump({"recipe_args": dict(
        target_model_name_or_path=str(target), train_data_path="demo:conversations", train_split="train[:4]",
        cache_output_dir=str(out), seq_length=32, micro_batch_size=2, cache_shard_size=4, cache_dtype="fp32",
        target_layer_ids=[-1, 0, 1, 2, 3])}))
    run_capture(load_config(recipe), show_progress=False)
    return out


def _digests(cache: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(cache.glob("*.safetensors"))}


def _dtypes(path: Path) -> dict[str, str]:
    out = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(file, "pt") as handle:
            out.update({key: handle.get_slice(key).get_dtype() for key in handle.keys()})
    return out


EXPECTED_FORMATS = {  # (model_type, scheme) -> what the release layout must hold (so the test cannot pass vacuously)
    ("deepseek_v3", "fp8"): {"F8_E4M3": ".weight", "F32": ".weight_scale_inv"},
    ("glm_moe_dsa", "fp8"): {"F8_E4M3": ".weight", "F32": ".weight_scale_inv"},
    ("qwen3_moe", "fp8"): {"F8_E4M3": ".weight", "BF16": ".weight_scale_inv"},
    ("deepseek_v4", "fp8_fp4"): {"F8_E4M3": ".weight", "I8": "experts.0.w1.weight", "F8_E8M0": ".scale"},
    ("kimi_k25", "int4"): {"I32": ".weight_packed", "BF16": ".weight_scale", "I64": ".weight_shape"},
    ("qwen3_moe", "fp8_channel"): {"F8_E4M3": ".weight", "BF16": ".weight_scale"},
}


@pytest.mark.parametrize("model_type, scheme", CASES, ids=[f"{m}-{s}" for m, s in CASES])
def test_quantized_release_captures_equal_the_reference_dequantized_checkpoint(pairs, tmp_path, model_type, scheme):
    quantized, reference = pairs(model_type, scheme)
    dtypes = _dtypes(quantized)
    for dtype, suffix in EXPECTED_FORMATS[model_type, scheme].items():
        assert any(d == dtype and key.endswith(suffix) for key, d in dtypes.items()), (dtype, suffix)
    weight_map = json.loads((quantized / "model.safetensors.index.json").read_text())["weight_map"]
    assert any(file == qr.SCALES_FILE for file in weight_map.values())
    assert any(file == qr.MTP_FILE for file in weight_map.values())
    assert json.loads((reference / "config.json").read_text())["quantization_config"]  # stale over fp32

    ours = _digests(_capture(quantized, tmp_path / "quantized"))
    theirs = _digests(_capture(reference, tmp_path / "reference"))
    assert ours and ours == theirs


def test_the_references_agree_and_ragged_blocks_are_where_transformers_goes_wrong():
    """Our block-loop reference equals transformers' dequantize on aligned shapes; on DeepSeek's ragged
    kv_a_proj_with_mqa shape transformers refuses (the trap in CHECKPOINT_FORMATS.md), so ours is used there."""
    torch.manual_seed(0)
    w = torch.randn(256, 384)
    q, scale = qr.quantize_fp8_block(w, torch.float32)
    assert torch.equal(qr.reference_fp8_block(q, scale), qr.transformers_dequantize(q, scale))
    q, scale = qr.quantize_fp8_block(torch.randn(576, 300), torch.float32)
    with pytest.raises(ValueError, match=r"not divisible by scale grid \(5, 3\)"):
        qr.transformers_dequantize(q, scale)


# ---------------------------------------------------------------------------------------- bytes read


def _stored(path: Path) -> dict[str, tuple[str, list[int]]]:
    out = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(file, "pt") as handle:
            for key in handle.keys():
                view = handle.get_slice(key)
                out[key] = (view.get_dtype(), view.get_shape())
    return out


_SIZE = {"F8_E4M3": 1, "F8_E8M0": 1, "I8": 1, "BF16": 2, "F32": 4, "I32": 4, "I64": 8}


def _bytes(entry) -> int:
    return math.prod(entry[1]) * _SIZE[entry[0]]


@pytest.mark.parametrize("model_type, scheme", [("deepseek_v4", "fp8_fp4"), ("kimi_k25", "int4")])
def test_each_expert_parallel_rank_reads_its_share_of_the_quantized_experts(pairs, model_type, scheme):
    quantized, _ = pairs(model_type, scheme)
    info = read_target_info(quantized)
    stored = {k: v for k, v in _stored(quantized).items() if not k.startswith("mtp.") and ".layers.4." not in k
              and "vision_tower" not in k and "mm_projector" not in k}
    expert = {k: _bytes(v) for k, v in stored.items() if ".experts." in k}
    others = sum(_bytes(v) for k, v in stored.items() if k not in expert)
    total = 0
    for ep_rank in range(2):
        model = build_meta_model(info, dtype=torch.float32, attn_implementation=None)
        apply_expert_parallel(model, info.family, ep_group=None, ep_size=2, ep_rank=ep_rank)
        stats = load_owned_parameters(model, info, build_shard_spec(model, Member(ep_rank=ep_rank)))
        # experts [4 * ep_rank, +4) of 8: their FP4 bytes + e8m0 scales (INT4: packed + bf16 scales + weight_shape)
        mine = sum(n for k, n in expert.items() if int(k.split(".experts.")[1].split(".")[0]) // 4 == ep_rank)
        assert stats.bytes_read == others + mine, ep_rank
        total += mine
    assert total == sum(expert.values())
    bf16_bytes = sum(math.prod(v[1]) for k, v in stored.items() if k.endswith((".weight", ".weight_packed"))) * 2
    assert sum(expert.values()) < 0.35 * bf16_bytes  # FP4 / INT4 experts: ~1/4 of their bf16 bytes (+ scales)


def _covering(start: int, stop: int, unit: int) -> int:
    return -(-stop // unit) - start // unit


@pytest.mark.parametrize("dim", [0, 1])
def test_a_slice_not_aligned_to_the_block_reads_the_covering_blocks_and_equals_the_cut(pairs, dim):
    """Two ranks split every 2-D FP8 weight on ``dim`` (TP: rows or columns; FSDP2: dim 0), 160 / 144 rows
    cut at 80 / 72: each reads its rows / columns of FP8 and the scale blocks covering them, nothing else."""
    quantized, reference = pairs("deepseek_v3", "fp8")
    info = read_target_info(quantized)
    stored = _stored(quantized)
    for rank in range(2):
        model = build_meta_model(info, dtype=torch.float32, attn_implementation=None).to_empty(device="cpu")
        index, key_map, state = checkpoint_sources(model, info)
        owned, expected = {}, 0
        for name, keys in key_map.sources.items():
            (key,) = keys if len(keys) == 1 else (None,)
            if key is None or key not in key_map.quantized or name in key_map.converter_of:
                continue
            rows, cols = state[name].shape
            size = (rows, cols)[dim] // 2
            owned[name] = OwnedSlice(dim=dim, start=rank * size, length=size)
            lo, hi = rank * size, (rank + 1) * size
            other = (cols, rows)[dim]
            expected += size * other  # FP8: one byte per value of the slice
            scale_dtype, grid = stored[key[: -len(".weight")] + ".weight_scale_inv"]
            expected += _covering(lo, hi, 128) * -(-other // 128) * _SIZE[scale_dtype]
        assert owned
        destinations = {name: state[name] if name not in owned else
                        torch.empty([owned[name].length if d == dim else n for d, n in enumerate(state[name].shape)])
                        for name in key_map.sources}
        stats = fill_from_checkpoint(index, key_map, destinations, owned)
        assert sum(stats.bytes_by_param[name] for name in owned) == expected
        full = {k: v for f in sorted(reference.glob("*.safetensors")) for k, v in load_file(f).items()}
        for name, cut in owned.items():
            (key,) = key_map.sources[name]
            assert torch.equal(destinations[name], full[key].narrow(dim, cut.start, cut.length)), name


# -------------------------------------------------------------------------------------------- errors


def _copy(source: Path, tmp_path: Path) -> Path:
    target = tmp_path / source.parent.name
    shutil.copytree(source, target)
    return target


def _load(target: Path):
    info = read_target_info(target)
    model = build_meta_model(info, dtype=torch.float32, attn_implementation=None)
    return load_owned_parameters(model, info, build_shard_spec(model, Member()))


def _drop_key(target: Path, key: str) -> str:
    index_path = target / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    file = index["weight_map"].pop(key)
    save_file({k: v for k, v in load_file(target / file).items() if k != key}, target / file, metadata={"format": "pt"})
    index_path.write_text(json.dumps(index))
    return file


def test_a_quantized_tensor_without_its_scale_is_named_with_its_file(pairs, tmp_path):
    target = _copy(pairs("deepseek_v3", "fp8")[0], tmp_path)
    base = "model.layers.1.self_attn.q_b_proj"
    _drop_key(target, f"{base}.weight_scale_inv")
    file = json.loads((target / "model.safetensors.index.json").read_text())["weight_map"][f"{base}.weight"]
    with pytest.raises(CaptureError) as caught:
        _load(target)
    assert str(caught.value) == (
        f"{base}.weight ({file}): a F8_E4M3 tensor without a scale sibling ({base}.weight_scale_inv, {base}.scale "
        f"or {base}.weight_scale). Casting it without its scale would be silently wrong: the checkpoint is "
        "incomplete (check model.safetensors.index.json).")


def test_a_scale_that_does_not_match_weight_block_size_is_named_with_its_file(pairs, tmp_path):
    target = _copy(pairs("deepseek_v3", "fp8")[0], tmp_path)
    config = json.loads((target / "config.json").read_text())
    config["quantization_config"]["weight_block_size"] = [64, 64]
    (target / "config.json").write_text(json.dumps(config))
    with pytest.raises(CaptureError) as caught:
        _load(target)
    # the first quantized weight in key order: layer 0's dense MLP down_proj [160, 144], scales in a shard file
    key = "model.layers.0.mlp.down_proj"
    file = json.loads((target / "model.safetensors.index.json").read_text())["weight_map"][f"{key}.weight_scale_inv"]
    assert str(caught.value) == (
        f"{key}.weight_scale_inv ({file}): scale shape [2, 2] does not match weight_block_size [64, 64] for the "
        f"[160, 144] weight {key}.weight (expected [3, 3]). Check quantization_config in config.json against the "
        "checkpoint.")


def test_an_int4_weight_without_its_shape_is_named(pairs, tmp_path):
    target = _copy(pairs("kimi_k25", "int4")[0], tmp_path)
    base = "language_model.model.layers.1.mlp.experts.3.up_proj"
    _drop_key(target, f"{base}.weight_shape")
    file = json.loads((target / "model.safetensors.index.json").read_text())["weight_map"][f"{base}.weight_packed"]
    with pytest.raises(CaptureError) as caught:
        _load(target)
    assert str(caught.value) == (
        f"{base}.weight_packed ({file}): compressed-tensors pack-quantized weight without its {base}.weight_shape; "
        "the checkpoint is incomplete (check model.safetensors.index.json).")


@pytest.mark.parametrize("scheme", ["fp8", "fp4", "int4", "mxfp4"])
def test_every_slice_of_a_large_ragged_weight_equals_the_reference_cut(tmp_path, scheme):
    """DeepSeek's kv_a_proj_with_mqa shape [576, 7168] scaled down to [576, 320] (FP8: a [5, 3] grid, both last
    blocks partial), cut in 4 on each dim as TP / FSDP2 ranks do (144 rows: rank 3 starts in block 3): each
    piece, read through the loader's path, equals the reference's dequantisation cut to it."""
    from ds_capture.target import quant

    torch.manual_seed(0)
    w = torch.randn(576, 320)
    parts, ref = qr.quantize(scheme, w, torch.float32)
    suffix = {"fp8": "weight_scale_inv", "fp4": "scale", "int4": "weight_scale", "mxfp4": "weight_scale"}
    tensors = {f"x.{suffix[scheme] if name in ('scale', 'weight_scale') else name}": t for name, t in parts.items()}
    weights = {k: v for k, v in tensors.items() if "scale" not in k}
    save_file(weights, tmp_path / "a.safetensors")
    save_file({k: v for k, v in tensors.items() if k not in weights}, tmp_path / "b.safetensors")
    index = {k: tmp_path / ("a.safetensors" if k in weights else "b.safetensors") for k in tensors}
    headers = quant.read_headers(set(index.values()))
    logical, _ = quant.logical_keys(index, headers)
    assert "x.weight" in logical
    (qt,) = quant.plan_quantized(index, headers, quant.QuantConfig(), ["x.weight"]).values()
    for dim in (0, 1):
        size = w.shape[dim] // 4
        for rank in range(4):
            piece, _ = quant.read_dequantized(qt, quant.region_of(qt, dim, rank * size, size))
            assert torch.equal(piece, ref.narrow(dim, rank * size, size)), (dim, rank)


def test_a_row_wise_fp8_scale_beside_a_square_weight_block_size_reads_one_scale_row_per_weight_row(tmp_path):
    """DeepSeek-V4.1's Engram tables: FP8 [rows, cols] with e8m0 scales [rows, cols / 32] although config.json
    says weight_block_size [32, 32]. The block comes from the scale's shape (1 x 32), every row slice equals the
    reference, and a scale matching neither grid is still refused."""
    from ds_capture.target import quant

    torch.manual_seed(0)
    w = torch.randn(70, 64)
    scale = torch.pow(2.0, torch.ceil(torch.log2(w.reshape(70, 2, 32).abs().amax(-1) / 448.0)))
    stored = (w / scale.repeat_interleave(32, 1)).to(torch.float8_e4m3fn)
    reference = stored.float() * scale.repeat_interleave(32, 1)
    save_file({"t.weight": stored, "t.scale": scale.to(torch.float8_e8m0fnu)}, tmp_path / "a.safetensors")
    index = {"t.weight": tmp_path / "a.safetensors", "t.scale": tmp_path / "a.safetensors"}
    headers = quant.read_headers(set(index.values()))
    (qt,) = quant.plan_quantized(index, headers, quant.QuantConfig(block=(32, 32)), ["t.weight"]).values()
    assert (qt.scheme, qt.block) == ("fp8_block", (1, 32))
    assert torch.equal(quant.read_dequantized(qt, quant.region_of(qt, None, 0, 0))[0], reference)
    piece, num_bytes = quant.read_dequantized(qt, quant.region_of(qt, 0, 33, 20))
    assert torch.equal(piece, reference[33:53]) and num_bytes == 20 * 64 + 20 * 2
    save_file({"t.weight": stored, "t.scale": scale[:35].to(torch.float8_e8m0fnu)}, tmp_path / "a.safetensors")
    with pytest.raises(CaptureError, match=r"scale shape \[35, 2\] does not match weight_block_size \[32, 32\]"):
        quant.plan_quantized(index, quant.read_headers(set(index.values())), quant.QuantConfig(block=(32, 32)),
                             ["t.weight"])


def test_quantization_config_sections_give_block_and_group_sizes_and_refuse_what_cannot_be_read():
    from ds_capture.target.quant import QuantConfig, read_quant_config

    int4 = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}
    assert read_quant_config({}, "c.json") == QuantConfig()
    assert read_quant_config({"quantization_config": {"quant_method": "fp8", "weight_block_size": [64, 32]}},
                             "c.json").block == (64, 32)
    kimi = {"quant_method": "compressed-tensors", "format": "pack-quantized",
            "config_groups": {"group_0": {"weights": int4}}}
    assert read_quant_config({"text_config": {"quantization_config": kimi}}, "c.json").group_size == 32
    per_group = {"quant_method": "compressed-tensors", "format": "mixed-precision",
                 "config_groups": {"g": {"format": "pack-quantized", "weights": {**int4, "group_size": 128}}}}
    assert read_quant_config({"quantization_config": per_group}, "c.json").group_size == 128
    ct_block = {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"g": {
        "weights": {"num_bits": 8, "type": "float", "strategy": "block", "block_structure": [128, 64]}}}}
    assert read_quant_config({"quantization_config": ct_block}, "c.json").block == (128, 64)
    k3 = json.loads((Path(__file__).parents[1] / "fixtures/release_configs/kimi_k3/config.json").read_text())
    assert read_quant_config(k3, "c.json").method == "compressed-tensors"
    mxfp4 = k3["text_config"]["quantization_config"]
    cases = [
        ({**kimi, "config_groups": {"group_0": {"weights": {**int4, "num_bits": 8}}}},
         "c.json: quantization_config.config_groups.group_0: pack-quantized 8-bit int symmetric=True is not supported."),
        ({**kimi, "format": "nvfp4-pack-quantized"},
         "c.json: quantization_config.config_groups.group_0: compressed-tensors format 'nvfp4-pack-quantized' is not "
         "supported."),
        ({**mxfp4, "config_groups": {"group_0": {**mxfp4["config_groups"]["group_0"], "weights": {
            **mxfp4["config_groups"]["group_0"]["weights"], "group_size": 16}}}},
         "c.json: quantization_config.config_groups.group_0: mxfp4-pack-quantized with 4-bit float weights in groups "
         "of 16 is not MXFP4 (4-bit float, groups of 32)."),
        ({"quant_method": "fp8", "weight_block_size": [128]},
         "c.json: quantization_config.weight_block_size [128] is not two positive integers (e.g. [128, 128])."),
    ]
    for section, message in cases:
        with pytest.raises(CaptureError) as caught:
            read_quant_config({"quantization_config": section}, "c.json")
        assert str(caught.value).startswith(message), str(caught.value)


def test_a_stale_quantization_config_over_bf16_tensors_just_loads(tmp_path):
    """An offline-converted bf16 directory that kept the release's quantization_config loads as bf16 tensors."""
    from ds_capture.demo import build_tiny_target

    plain = build_tiny_target(tmp_path / "plain", "deepseek_v3", seed=0, dtype=torch.bfloat16, num_hidden_layers=2)
    stale = tmp_path / "stale"
    shutil.copytree(plain, stale)
    config = json.loads((stale / "config.json").read_text())
    config["quantization_config"] = qr.QUANT_CONFIGS["fp8"]
    (stale / "config.json").write_text(json.dumps(config))
    models = []
    for path in (plain, stale):
        info = read_target_info(path)
        model = build_meta_model(info, dtype=torch.bfloat16, attn_implementation=None)
        stats = load_owned_parameters(model, info, build_shard_spec(model, Member()))
        models.append((model.state_dict(), stats.bytes_read))
    (ours, read), (theirs, read_plain) = models[1], models[0]
    assert read == read_plain and sorted(ours) == sorted(theirs)
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
