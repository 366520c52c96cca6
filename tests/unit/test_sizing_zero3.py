"""DeepSpeed ZeRO-3's expert-parallel layout (``engine: deepspeed``, ``deepspeed_config: {zero_optimization: {stage:
3}}``, ``distributed.ep_size`` = the world; NeMo's families): which recipes ask for it and which are refused (before
anything loads, with the key named), and what ``ds-capture plan`` counts on every rank: the packed routed experts /
world + ZeRO's ``ceil(numel / world)`` partition of every other parameter + the largest gathered chain + the
dequantization scratch; ``run`` refuses what plan says does not fit, on the same path.

Counted on the release-size Kimi K3 (tests/fixtures/release_configs/kimi_k3, meta only, no weights).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ds_capture.errors import CaptureError
from ds_capture.parallel.resolve import sharding_of
from ds_capture.parallel.zero3_engine import zero_stage
from ds_capture.target.families import FAMILIES

REPO = Path(__file__).resolve().parents[2]
K3 = "recipe_args.target_model_name_or_path=tests/fixtures/release_configs/kimi_k3"
ZERO3 = ("engine=deepspeed", "deepspeed_config.zero_optimization.stage=3")


def test_the_stage_comes_from_the_deepspeed_config():
    assert zero_stage(None, "ds.json") == 0
    assert zero_stage({"tensor_parallel": {"autotp_size": 2}}, "ds.json") == 0
    assert zero_stage({"zero_optimization": {"stage": 3}}, "ds.json") == 3
    assert zero_stage({"zero_optimization": {"stage": 0}}, "ds.json") == 0


@pytest.mark.parametrize("section, message", [
    ({"stage": 2}, "ds.json: zero_optimization.stage 2: a frozen target has no optimizer states (stage 1) or gradients "
                   "(stage 2) to partition. Use 3 to partition its parameters (engine: deepspeed, a NeMo-built family, "
                   "distributed.ep_size = the world size), or 0 (or no zero_optimization) to keep them whole."),
    ({"stage": True}, "ds.json: zero_optimization.stage True: a frozen target"),
    ({"stage": 3, "offload_param": {"device": "cpu"}, "stage3_prefetch_bucket_size": 5},
     "ds.json: zero_optimization.offload_param: ds_capture sets ZeRO-3's other settings itself (nothing kept whole, no "
     "prefetch, every gathered parameter released after its module) so that ds-capture plan counts what each rank "
     "holds. Keep only zero_optimization.stage (remove offload_param, stage3_prefetch_bucket_size)."),
    (3, "ds.json: zero_optimization must be a mapping such as {stage: 3}, got 3."),
])
def test_other_zero_settings_are_refused_naming_the_key(section, message):
    with pytest.raises(CaptureError) as error:
        zero_stage({"zero_optimization": section}, "ds.json")
    assert str(error.value).startswith(message)


def test_which_layouts_zero3_runs():
    k3, qwen = FAMILIES["kimi_k3"], FAMILIES["qwen3_moe"]
    ds = 3
    assert sharding_of("deepspeed", ds, k3, world_size=4, tp_size=1, ep_size=4, ds_source="ds.json") == "zero3"
    assert sharding_of("deepspeed", ds, k3, world_size=1, tp_size=1, ep_size=1) == "deepspeed"  # one process: plain
    assert sharding_of("deepspeed", 0, k3, world_size=4, tp_size=1, ep_size=4) == "deepspeed"
    refusals = [
        (("fsdp2", ds, k3), dict(world_size=4, tp_size=1, ep_size=4),
         "ds.json: zero_optimization.stage 3 is DeepSpeed's parameter partitioning, but engine is 'fsdp2' (torch's "
         "fully_shard). Use engine: deepspeed for ZeRO-3, or remove zero_optimization."),
        (("deepspeed", ds, qwen), dict(world_size=2, tp_size=1, ep_size=2),
         "deepspeed_config zero_optimization.stage 3 partitions NeMo-built families (deepseek_v41, kimi_k3); "
         "model_type 'qwen3_moe' is sharded by AutoTP and expert parallelism instead. Remove zero_optimization, or "
         "use engine: fsdp2 to shard every parameter."),
        (("deepspeed", ds, k3), dict(world_size=4, tp_size=1, ep_size=2),
         "deepspeed_config zero_optimization.stage 3 partitions every parameter over all 4 ranks and keeps the routed "
         "experts expert-parallel over all of them: it needs distributed.tp_size 1 and distributed.ep_size 4 (got "
         "tp_size 1, ep_size 2)."),
    ]
    for args, degrees, message in refusals:
        with pytest.raises(CaptureError) as error:
            sharding_of(*args, **degrees, ds_source="ds.json")
        assert str(error.value) == message


@pytest.fixture()
def k3_cfg(monkeypatch):
    pytest.importorskip("nemo_automodel")
    from ds_capture.recipe.config import load_config

    monkeypatch.chdir(REPO)
    return lambda *overrides: load_config(REPO / "configs" / "kimi_k3.yaml", [K3, *overrides])


def test_every_term_is_counted(k3_cfg):
    from ds_capture.sizing import memory_model as mm
    from ds_capture.sizing.command import plan_capture

    report = plan_capture(k3_cfg(*ZERO3), world_size=32, gpu_memory_gib=79.6, suggest=False, count_dataset=False)
    fsdp2 = plan_capture(k3_cfg(), world_size=32, gpu_memory_gib=79.6, suggest=False, count_dataset=False).ranks[0]
    whole = plan_capture(k3_cfg("engine=deepspeed", "distributed.ep_size=1", "capture.expert_storage=dequantized"),
                         world_size=1, gpu_memory_gib=1e6, suggest=False, count_dataset=False).ranks[0]
    assert report.layout.describe() == "engine deepspeed ZeRO-3, world 32, ep 32, micro_batch_size 1"
    rank = report.ranks[0]
    # Routed experts: the release's packed bytes (0.5 + 1/32 per parameter) of E/world experts, as under FSDP2.
    experts_bf16 = whole.param_bytes_by_kind["routed experts"]
    assert rank.param_bytes_by_kind["routed experts"] == pytest.approx(experts_bf16 / 2 * (0.5 + 1 / 32) / 32)
    # The rest: ceil(numel / world) of every parameter (buffers whole): 1/world of the whole and a little more.
    rest, rest_whole = rank.param_bytes - rank.param_bytes_by_kind["routed experts"], whole.param_bytes - experts_bf16
    assert rest_whole / 32 <= rest <= rest_whole / 32 * 1.01
    # Transients: the gathered chain is at least the largest parameter (K3's untied lm_head, vocab x hidden bf16)
    # and below FSDP2's root + two layers; one layer's local experts dequantized as scratch (an activation term).
    lm_head = report.target.vocab_size * report.target.hidden_size * 2
    assert lm_head <= rank.fsdp2_gather_bytes < fsdp2.fsdp2_gather_bytes
    assert rank.gather_name == "ZeRO-3 gathered modules" and "ZeRO-3 gathered modules" in rank.consumers()
    assert "dequantized" in report.activation_largest.note
    assert rank.peak_bytes == pytest.approx(rank.param_bytes + rank.activation_bytes + rank.capture_bytes
                                            + rank.fsdp2_gather_bytes + rank.reserve_bytes + rank.writer_device_bytes)
    assert report.fits and rank.peak_bytes < fsdp2.peak_bytes < 79.6 * mm.GIB
    assert report.to_dict()["layout"]["zero_stage"] == 3


def test_run_refuses_what_plan_says_does_not_fit(k3_cfg):
    import torch

    from ds_capture.sizing.command import refuse_if_not_fitting

    refuse_if_not_fitting(k3_cfg(*ZERO3, "capture.gpu_memory_gib=79.6"), world_size=32, compute_dtype=torch.bfloat16)
    with pytest.raises(CaptureError, match="does NOT fit; largest consumer: routed experts") as error:
        refuse_if_not_fitting(k3_cfg(*ZERO3, "capture.gpu_memory_gib=79.6", "distributed.ep_size=16"),
                              world_size=16, compute_dtype=torch.bfloat16)
    assert "engine deepspeed ZeRO-3, world 16, ep 16" in str(error.value)
