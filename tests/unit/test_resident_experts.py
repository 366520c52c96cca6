"""``capture.expert_storage: checkpoint``: quantized routed experts stay resident, the cache does not change.

Per release scheme (FP8 block experts of DeepSeek-V3, FP4 + e8m0 experts of DeepSeek-V4, INT4 experts of
Kimi-K2.5; ``quant_release.build_release_pair``), a single-process capture with ``expert_storage:
checkpoint`` is byte-identical to the ``dequantized`` one; the model then holds the experts as stored (the
checkpoint's dtypes, a fraction of the bytes) and reads the same checkpoint bytes. Refusals are asserted
by message.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import yaml

sys.path.insert(0, str(Path(__file__).parent))
import quant_release as qr  # noqa: E402

from ds_capture.parallel.shard_spec import build_shard_spec  # noqa: E402
from ds_capture.target.shard_spec import Member  # noqa: E402
from ds_capture.errors import CaptureError  # noqa: E402
from ds_capture.parallel.expert_parallel import moe_experts_modules  # noqa: E402
from ds_capture.parallel.resident_experts import QuantizedExpertStack, check_expert_storage, keep_experts_quantized  # noqa: E402
from ds_capture.recipe.config import load_config  # noqa: E402
from ds_capture.runner import run_capture  # noqa: E402
from ds_capture.target.families import read_target_info  # noqa: E402
from ds_capture.target.loading import build_meta_model, load_owned_parameters  # noqa: E402

CASES = [("deepseek_v3", "fp8"), ("deepseek_v4", "fp8_fp4"), ("kimi_k25", "int4")]
STORED = {"fp8": {torch.float8_e4m3fn, torch.float32}, "fp8_fp4": {torch.int8, torch.float8_e8m0fnu},
          "int4": {torch.int32, torch.bfloat16}}


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    root = tmp_path_factory.mktemp("resident_pairs")
    built = {}

    def make(model_type, scheme):
        if (model_type, scheme) not in built:
            built[model_type, scheme] = qr.build_release_pair(root / f"{model_type}-{scheme}", model_type, scheme)
        return built[model_type, scheme]

    return make


def _capture(target: Path, out: Path, storage: str, extra: dict | None = None) -> dict[str, bytes]:
    recipe = out.parent / f"{out.name}.yaml"
    recipe.write_text(yaml.safe_dump({"capture": {"expert_storage": storage}, "recipe_args": dict(
        target_model_name_or_path=str(target), train_data_path="demo:conversations", train_split="train[:4]",
        cache_output_dir=str(out), seq_length=32, micro_batch_size=2, cache_shard_size=4, cache_dtype="fp32",
        target_layer_ids=[-1, 0, 1, 2, 3], **(extra or {}))}))
    run_capture(load_config(recipe), show_progress=False)
    return {p.name: p.read_bytes() for p in sorted(out.glob("*.safetensors"))}


def _tensor_bytes(model) -> int:
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))


@pytest.mark.parametrize("model_type, scheme", [
    pytest.param(m, s, id=f"{m}-{s}", marks=() if m == "deepseek_v4" else (pytest.mark.slow,)) for m, s in CASES])
def test_resident_quantized_experts_capture_bit_identical_to_dequantized(pairs, tmp_path, model_type, scheme):
    quantized, _ = pairs(model_type, scheme)
    resident = _capture(quantized, tmp_path / "checkpoint", "checkpoint")
    dequantized = _capture(quantized, tmp_path / "dequantized", "dequantized")
    assert resident and resident == dequantized


@pytest.mark.parametrize("model_type, scheme", CASES, ids=[f"{m}-{s}" for m, s in CASES])
def test_resident_experts_hold_the_stored_bytes_and_dequantize_to_the_loaded_weights(pairs, model_type, scheme):
    quantized, _ = pairs(model_type, scheme)
    info = read_target_info(quantized)
    plain = build_meta_model(info, dtype=torch.float32, attn_implementation=None)
    plain_stats = load_owned_parameters(plain, info, build_shard_spec(plain, Member()))
    model = build_meta_model(info, dtype=torch.float32, attn_implementation=None)
    swapped = keep_experts_quantized(model, info)
    stats = load_owned_parameters(model, info, build_shard_spec(model, Member()))
    assert len(swapped) == 2 * len(moe_experts_modules(plain, info.family))  # gate_up_proj and down_proj per MoE layer
    assert stats.bytes_read == plain_stats.bytes_read  # the same checkpoint bytes, kept as read
    stacks = [m for m in model.modules() if isinstance(m, QuantizedExpertStack)]
    assert {b.dtype for s in stacks for n, b in s.named_buffers() if n != "_anchor"} == STORED[scheme]
    for name in swapped:  # every expert, dequantized on demand, is the parameter dequantize-on-load filled
        stack, param = model.get_submodule(name), plain.get_parameter(name)
        assert all(torch.equal(stack[e], param[e]) for e in range(param.shape[0])), name
    expert_params = sum(plain.get_parameter(n).numel() * 4 for n in swapped)
    saved = _tensor_bytes(plain) - _tensor_bytes(model)
    assert saved > 0.6 * expert_params  # fp32 experts -> their stored bytes (FP8 / FP4 / INT4 + scales)


def test_checkpoint_storage_refusals():
    with pytest.raises(CaptureError) as caught:
        check_expert_storage("checkpoint", "fsdp2", 2)
    assert str(caught.value) == (
        "capture.expert_storage: checkpoint keeps each rank's routed experts whole in the checkpoint's format, which "
        "FSDP2's dim-0 parameter sharding does not hold. Use engine: deepspeed with distributed.ep_size to shard "
        "the experts, or capture.expert_storage: dequantized with engine: fsdp2.")
    check_expert_storage("checkpoint", "fsdp2", 1)  # one process never shards
    with pytest.raises(CaptureError, match=r"must be one of dequantized, checkpoint, got 'fp8'"):
        check_expert_storage("fp8", "deepspeed", 1)


@pytest.mark.parametrize("implementation", ["eager", "batched_mm", "grouped_mm"])
def test_every_experts_implementation_is_bit_identical(pairs, implementation):
    """``eager`` indexes one expert at a time, ``batched_mm`` / ``grouped_mm`` (the default) get the layer's
    dense stack for one forward: the hidden states equal the dequantized model's bit for bit."""
    quantized, _ = pairs("deepseek_v3", "fp8")
    info = read_target_info(quantized)
    outputs = []
    for storage in ("checkpoint", "dequantized"):
        model = build_meta_model(info, dtype=torch.float32, attn_implementation=None)
        model.config._experts_implementation = implementation
        if storage == "checkpoint":
            assert keep_experts_quantized(model, info)
        load_owned_parameters(model, info, build_shard_spec(model, Member()))
        input_ids = torch.randint(1, info.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            outputs.append(model(input_ids=input_ids, output_hidden_states=True).hidden_states)
    assert all(torch.equal(a, b) for a, b in zip(*outputs))


def test_expert_storage_is_validated_in_the_recipe(write_recipe):
    path = write_recipe({"capture": {"expert_storage": "fp8"}, "recipe_args": dict(
        target_model_name_or_path="t", train_data_path="d.jsonl", cache_output_dir="out", seq_length=64)})
    with pytest.raises(CaptureError) as caught:
        load_config(path)
    assert str(caught.value) == f"{path}: `capture.expert_storage` must be dequantized or checkpoint, got 'fp8'."
    assert load_config(path, ["capture.expert_storage=checkpoint"]).capture.expert_storage == "checkpoint"
