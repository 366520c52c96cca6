"""ds-capture plan: counts against independent references, every rank listed, and run's refusal before loading.

The per-rank tensors of the real engines are compared in tests/distributed/test_plan_layouts.py; here the
real-size counts are checked against formulas typed from the published configs, the FSDP2 rule against
``torch.chunk``, the quantized sizes against their formats' definitions.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ds_capture.cli import main
from ds_capture.errors import CaptureError
from ds_capture.parallel.fsdp2_engine import dim0_chunk
from ds_capture.recipe.config import load_config, parse_config
from ds_capture.sizing import memory_model as mm
from ds_capture.sizing.command import plan_capture
from ds_capture.sizing.count import Sizer
from ds_capture.target.shard_spec import Member
from ds_capture.target.families import read_target_info

REPO = Path(__file__).resolve().parents[2]
RELEASES = REPO / "tests" / "fixtures" / "release_configs"


def _cfg(target: Path | str, *, tp: int = 1, ep: int = 1, engine: str = "deepspeed", **recipe) -> object:
    raw = {"engine": engine, "distributed": {"tp_size": tp, "ep_size": ep},
           "recipe_args": {"target_model_name_or_path": str(target), "train_data_path": "/nonexistent/train.jsonl",
                           "cache_output_dir": "/nonexistent/out", "seq_length": 4096, "micro_batch_size": 4,
                           **recipe}}
    return parse_config(raw, source="<test>", base_dir=REPO)


def test_fsdp2_rows_are_torch_chunk():
    for rows in range(0, 21):
        for world in range(1, 10):
            chunks = [len(c) for c in torch.arange(rows).chunk(world)] if rows else []
            chunks += [0] * (world - len(chunks))
            got = [dim0_chunk(rows, world, rank) for rank in range(world)]
            assert [n for _, n in got] == chunks, (rows, world)
            assert [s for s, _ in got] == [min(rows, sum(chunks[:r])) for r in range(world)], (rows, world)


def test_quantized_expert_storage_follows_the_formats():
    fp8 = mm.checkpoint_expert_storage({"quant_method": "fp8", "weight_block_size": [128, 128]})
    assert (fp8.format, fp8.bytes_per_param) == ("fp8", 1 + 4 / (128 * 128))
    v4 = mm.checkpoint_expert_storage({"quant_method": "fp8", "weight_block_size": [128, 128], "expert_dtype": "fp4"})
    assert (v4.format, v4.bytes_per_param) == ("fp4", 0.5 + 1 / 32)
    int4 = mm.checkpoint_expert_storage({"quant_method": "compressed-tensors", "config_groups": {
        "group_0": {"weights": {"num_bits": 4, "group_size": 32, "type": "int"}}}})
    assert (int4.format, int4.bytes_per_param) == ("int4", 0.5 + 2 / 32)
    assert mm.checkpoint_expert_storage(None) is None
    assert mm.stored_bytes(1000, 2, is_routed_expert=True, storage=fp8) == 1000 * (1 + 4 / 16384)
    assert mm.stored_bytes(1000, 2, is_routed_expert=False, storage=fp8) == 2000


def _deepseek_v3_params(c: dict) -> tuple[int, int]:
    """(total parameters, routed-expert parameters) of a deepseek_v3 config, typed from the architecture."""
    H, heads, E = c["hidden_size"], c["num_attention_heads"], c["n_routed_experts"]
    qk = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    attention = (H * c["q_lora_rank"] + c["q_lora_rank"] + c["q_lora_rank"] * heads * qk
                 + H * (c["kv_lora_rank"] + c["qk_rope_head_dim"]) + c["kv_lora_rank"]
                 + c["kv_lora_rank"] * heads * (c["qk_nope_head_dim"] + c["v_head_dim"]) + heads * c["v_head_dim"] * H)
    dense, moe = c["first_k_dense_replace"], c["num_hidden_layers"] - c["first_k_dense_replace"]
    expert = 3 * H * c["moe_intermediate_size"]
    per_moe = E * H + E * expert + c["n_shared_experts"] * expert
    total = (2 * c["vocab_size"] * H + H + c["num_hidden_layers"] * (attention + 2 * H)
             + dense * 3 * H * c["intermediate_size"] + moe * per_moe)
    return total, moe * E * expert


@pytest.mark.parametrize("name", ["deepseek_v3", "kimi_k2"])
def test_real_size_counts_equal_the_architecture(name):
    config = json.loads((RELEASES / name / "config.json").read_text())
    total, experts = _deepseek_v3_params(config)
    report = plan_capture(_cfg(RELEASES / name, tp=8, ep=32), world_size=32, gpu_memory_gib=79.6, suggest=False)
    assert report.total_params == total
    assert round(total / 1e9) == {"deepseek_v3": 671, "kimi_k2": 1026}[name]
    for rank in report.ranks:  # bf16: 2 bytes; every EP rank holds E/32 of every MoE layer's experts
        assert rank.param_bytes_by_kind["routed experts"] == experts // 32 * 2
    checkpoint = next(o for o in report.storage_alternatives if o["expert_storage"] == "checkpoint")
    expected = report.ranks[0].param_bytes - experts // 32 * 2 + experts // 32 * (1 + 4 / 16384)
    assert abs(checkpoint["param_bytes"] - expected) <= 1


def test_json_lists_every_rank_of_a_512_rank_world(capsys):
    argv = ["plan", "-c", str(REPO / "configs" / "deepseek_v3_kimi_k2.yaml"), "--world-size", "512",
            "--gpu-memory-gib", "79.6", "--json",
            "--set", f"recipe_args.target_model_name_or_path={RELEASES / 'deepseek_v3'}"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert [r["rank"] for r in report["per_rank"]] == list(range(512))
    assert report["layout"] == {"engine": "deepspeed", "world_size": 512, "dp_size": 64, "tp_size": 8, "ep_size": 16,
                                "zero_stage": 0, "micro_batch_size": 4, "seq_length": 4096,
                                "chunk_tokens": None}
    assert isinstance(report["fits"], bool) and report["fits"]
    for rank in report["per_rank"]:
        assert rank["is_writer"] == (rank["rank"] % 8 == 0)
        assert (rank["writer_host_bytes"] > 0) == rank["is_writer"]
        parts = ("param_bytes", "activation_bytes", "capture_bytes", "writer_device_bytes", "reserve_bytes")
        assert abs(rank["peak_bytes"] - sum(rank[k] for k in parts)) <= len(parts)  # each rounded down to bytes
    layer_ids = 5  # default ids of a 61-layer target
    assert report["cache"]["bytes_per_sample"] == 4096 * (16 + 7168 * (layer_ids + 1) * 2)
    assert report["cache"]["total_bytes"] is None  # the recipe's dataset does not exist here


def test_a_layout_that_does_not_fit_names_its_largest_consumer_and_fitting_layouts():
    report = plan_capture(_cfg(RELEASES / "glm5", ep=32, micro_batch_size=2), world_size=32, gpu_memory_gib=79.6)
    assert not report.fits
    name, value = report.largest_consumer()
    assert name == "routed experts" and value == report.ranks[0].param_bytes_by_kind["routed experts"]
    assert "does NOT fit; largest consumer: routed experts 42.2 GiB" in report.reason()
    assert report.alternatives and all(a["peak_bytes"] <= 79.6 * mm.GIB for a in report.alternatives)
    assert any(a["ep_size"] == 64 for a in report.alternatives)


def test_fsdp2_chunks_tile_the_model_and_gather_one_root_and_two_layers(tiny_target):
    target = tiny_target("qwen3_moe", num_hidden_layers=3)
    sizer = Sizer(_cfg(target, engine="fsdp2", seq_length=64, micro_batch_size=2), read_target_info(target), [1, 2],
                  "fp32", tp_grain_size=1)
    table = sizer.table("fsdp2", 1, 1, 3)
    for entry in table.tensors:
        assert sum(entry.local_numel(Member(rank=rank, world_size=3)) for rank in range(3)) == (
            entry.numel() * (3 if not entry.fsdp_sharded else 1)), entry.name
    layer_bytes = {}
    for entry in table.tensors:
        if entry.fsdp_sharded:
            layer_bytes[entry.layer] = layer_bytes.get(entry.layer, 0) + entry.numel() * entry.itemsize
    root = layer_bytes.pop(None)
    assert sizer._fsdp2_gather(table, mm.COMPUTE_STORAGE) == root + 2 * max(layer_bytes.values())


def test_run_refuses_a_layout_that_does_not_fit_before_any_weight_loads(write_recipe, tmp_path, monkeypatch):
    from ds_capture import runner

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was built although plan says it does not fit")

    monkeypatch.setattr(runner, "build_model", no_loading)
    recipe = write_recipe({"recipe_args": {"target_model_name_or_path": "demo:qwen3_moe_tiny",
                                           "train_data_path": "demo:conversations",
                                           "cache_output_dir": str(tmp_path / "cache"), "seq_length": 512,
                                           "micro_batch_size": 8},
                           "capture": {"gpu_memory_gib": 0.5}})
    cfg = load_config(recipe)
    with pytest.raises(CaptureError) as caught:
        runner.run_capture(cfg, show_progress=False)
    expected = plan_capture(cfg, world_size=1, compute_dtype="fp32", count_dataset=False).reason()
    assert f"{cfg.source}: {expected}. Nothing was loaded." in str(caught.value)
    assert "does NOT fit; largest consumer: runtime reserve 3.0 GiB" in expected
    assert not (tmp_path / "cache").exists()
    # The same recipe with room enough passes the check (and would load).
    fits = plan_capture(load_config(recipe, ["capture.gpu_memory_gib=8"]), world_size=1, compute_dtype="fp32",
                        count_dataset=False)
    assert fits.fits


def test_plan_refuses_what_run_refuses(capsys):
    argv = ["plan", "-c", str(REPO / "configs" / "qwen35.yaml"), "--world-size", "16",
            "--set", f"recipe_args.target_model_name_or_path={RELEASES / 'qwen35'}",
            "--set", "distributed.tp_size=2"]
    assert main(argv) == 2
    assert ("tp_size 2: DeepSpeed AutoTP column-splits the shared-expert gate (mlp.shared_expert_gate) of "
            "model_type 'qwen3_5_moe'") in capsys.readouterr().err


def test_plan_splits_deepseek_v4_attention_under_our_own_tp_plan():
    """V4's attention (AutoTP mis-shards its compressor) is split by our own plan: its bytes per rank fall."""
    def attention_gib(tp_size: int) -> float:
        cfg = load_config(REPO / "configs" / "deepseek_v4_flash.yaml",
                          [f"recipe_args.target_model_name_or_path={RELEASES / 'deepseek_v4_flash'}",
                           f"distributed.tp_size={tp_size}"])
        report = plan_capture(cfg, world_size=8, gpu_memory_gib=79.6, suggest=False, count_dataset=False)
        return report.ranks[0].param_bytes_by_kind["attention"] / 2**30

    whole, split = attention_gib(1), attention_gib(8)
    assert 9.0 < whole < 10.0 and 2.0 < split < 3.0, (whole, split)


def test_fsdp2_plan_of_a_real_target_shards_every_expert_once():
    cfg = _cfg(RELEASES / "qwen3_235b_a22b", engine="fsdp2")
    report = plan_capture(cfg, world_size=64, gpu_memory_gib=79.6, suggest=False)
    c = json.loads((RELEASES / "qwen3_235b_a22b" / "config.json").read_text())
    experts = c["num_hidden_layers"] * c["num_experts"] * 3 * c["hidden_size"] * c["moe_intermediate_size"] * 2
    assert sum(r.param_bytes_by_kind["routed experts"] for r in report.ranks) == experts
    assert len(report.ranks) == 64 and report.layout.engine == "fsdp2"
    assert report.ranks[0].fsdp2_gather_bytes > 0 and report.fits


def test_plan_json_on_stdout_is_json_alone():
    """A fresh process, as a user pipes it: nothing DeepSpeed logs (its CPU-accelerator warning) lands on stdout."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    done = subprocess.run(
        [sys.executable, "-m", "ds_capture", "plan", "-c", str(REPO / "configs" / "deepseek_v4_flash.yaml"),
         "--world-size", "8", "--gpu-memory-gib", "79.6", "--json",
         "--set", f"recipe_args.target_model_name_or_path={RELEASES / 'deepseek_v4_flash'}",
         "--set", "distributed.tp_size=8"],  # TP: plan's meta layout imports DeepSpeed
        capture_output=True, text=True, cwd=REPO, env=env, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["model_type"] == "deepseek_v4" and report["fits"] is True
