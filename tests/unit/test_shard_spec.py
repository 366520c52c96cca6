"""The shard spec: one value the loaders read and plan counts from (tests/distributed/test_plan_layouts.py: every layout)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ds_capture.parallel.expert_parallel import apply_expert_parallel
from ds_capture.parallel.layout import ParallelLayout
from ds_capture.parallel.engines import build_model
from ds_capture.parallel.shard_spec import build_shard_spec
from ds_capture.recipe.config import parse_config
from ds_capture.sizing.count import Layout, Sizer
from ds_capture.target.checkpoint_reads import OwnedSlice
from ds_capture.target.families import read_target_info
from ds_capture.target.loading import build_meta_model
from ds_capture.target.shard_spec import Member, Placement, ShardSpec


def test_placements_cut_what_each_member_holds():
    spec = ShardSpec(placements={
        "rows": Placement("split", dim=0, sizes=(3, 2), group="tp"),
        "cols": Placement("split", dim=1, sizes=(4, 4), group="tp"),
        "experts": Placement("split", sizes=(2, 2, 2, 2), group="ep", experts=True),
        "table": Placement("split", sizes=(4, 4, 4), group="world", total=9),
        "chunk": Placement("chunk", group="world"), "flat": Placement("flat", group="world")},
        packed=frozenset({"experts"}), member=Member(rank=2, world_size=3, tp_rank=1, ep_rank=3))
    assert spec.cut("rows") == OwnedSlice(dim=0, start=3, length=2)
    assert spec.cut("cols") == OwnedSlice(dim=1, start=4, length=4)
    assert spec.cut("experts") == OwnedSlice(dim=0, start=6, length=2, experts=True)
    assert spec.cut("table") == OwnedSlice(dim=0, start=8, length=1)  # rows 8..11, one of them in the table
    assert spec.cut("chunk", rows=7) == OwnedSlice(dim=0, start=6, length=1)  # torch.chunk: 3, 3, 1
    assert spec.cut("flat") is None and spec.cut("whole") is None
    assert spec.rows({"chunk": 7}) == {"rows": (3, 2), "experts": (6, 2), "table": (8, 1), "chunk": (6, 1)}
    assert [spec.placement(n) for n in ("rows", "cols", "experts", "table", "chunk", "flat", "whole")] == [
        "rows/tp", "columns/tp", "experts/ep packed", "rows/world", "dim-0 chunk/world", "flat partition/world",
        "whole"]
    # Every member's elements, from one spec: the local sizes, the chunks tiling dim 0, ZeRO-3's padded partitions.
    assert [spec.local_numel("rows", (3, 5), Member(tp_rank=r)) for r in (0, 1)] == [15, 10]
    assert [spec.local_numel("chunk", (7, 5), Member(rank=r, world_size=3)) for r in range(3)] == [15, 15, 5]
    assert spec.local_numel("flat", (7, 5), Member(world_size=3)) == 12
    assert spec.local_numel("table", (4, 8)) == 32  # the padded local rows are held


def _sizer(target_dir: Path) -> Sizer:
    cfg = parse_config({"recipe_args": {"target_model_name_or_path": str(target_dir), "train_data_path": "x.jsonl",
                                        "cache_output_dir": "out", "seq_length": 32}},
                       source="<test>", base_dir=Path("."))
    return Sizer(cfg, read_target_info(target_dir), [1, 2], "fp32", tp_grain_size=1)


def test_plan_counts_the_single_process_engines_tensors(tiny_target):
    """A world of one (the first row of the plan-equals-engine table; the others need ranks)."""
    path = tiny_target("deepseek_v3", num_hidden_layers=3)
    model = build_model("deepspeed", read_target_info(path), ParallelLayout.single(), None, dtype=torch.float32,
                        attn_implementation=None, ds_config=None)
    held = {name: (t.numel(), t.element_size()) for name, t in (*model.named_parameters(), *model.named_buffers())}
    assert _sizer(path).rank_tensors(Layout("deepspeed", 1, 1, 1, 1), 0) == held


@pytest.mark.parametrize("ep_rank", [0, 1])
def test_an_expert_parallel_models_spec_holds_its_experts_block(tiny_target, ep_rank):
    info = read_target_info(tiny_target("qwen3_moe", num_hidden_layers=2))
    model = apply_expert_parallel(build_meta_model(info, dtype=torch.float32, attn_implementation=None), info.family,
                                  ep_group=None, ep_size=2, ep_rank=ep_rank)
    spec = build_shard_spec(model, Member(ep_rank=ep_rank))
    experts = {name: spec.cut(name) for name in spec.placements}
    half = info.num_experts // 2
    assert experts and all(cut == OwnedSlice(dim=0, start=ep_rank * half, length=half, experts=True)
                           for cut in experts.values())
    assert {name.rsplit(".", 1)[-1] for name in experts} == {"gate_up_proj", "down_proj"}
    assert spec.gathers == ("expert parallel: routed tokens all-to-all over the EP group",)
