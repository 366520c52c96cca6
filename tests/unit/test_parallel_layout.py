"""ParallelLayout placement, shard / sample ranges, build_layout refusals (exact messages), resolve_degrees."""

from __future__ import annotations

import pytest

from ds_capture.errors import CaptureError
from ds_capture.parallel.layout import ParallelLayout, build_layout, resolve_degrees, shard_ranges

DENSE = dict(num_experts=None, num_attention_heads=4, num_key_value_heads=2)
MOE = dict(num_experts=8, num_attention_heads=4, num_key_value_heads=2)


def plan(world_size, rank, tp_size=1, ep_size=1, model=DENSE):
    return build_layout(world_size=world_size, rank=rank, tp_size=tp_size, ep_size=ep_size, **model)


def test_shard_ranges_first_ranks_take_the_extra():
    assert shard_ranges(5, 2) == [range(0, 3), range(3, 5)]
    assert shard_ranges(7, 3) == [range(0, 3), range(3, 5), range(5, 7)]
    assert shard_ranges(2, 4) == [range(0, 1), range(1, 2), range(2, 2), range(2, 2)]
    assert shard_ranges(0, 2) == [range(0, 0), range(0, 0)]


def test_layout_dp2_tp2_ep2():
    placed = [plan(4, rank, tp_size=2, ep_size=2, model=MOE) for rank in range(4)]
    assert [(p.dp_rank, p.tp_rank, p.ep_rank) for p in placed] == [(0, 0, 0), (0, 1, 1), (1, 0, 0), (1, 1, 1)]
    assert [p.tp_ranks for p in placed] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [p.dp_ranks for p in placed] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [p.ep_ranks for p in placed] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [p.is_writer for p in placed] == [True, False, True, False]
    assert [p.is_manifest_writer for p in placed] == [True, False, False, False]


def test_ep_spanning_dp_groups():
    placed = plan(4, 3, tp_size=1, ep_size=4, model=MOE)
    assert (placed.dp_size, placed.dp_rank, placed.ep_rank, placed.ep_ranks) == (4, 3, 3, [0, 1, 2, 3])


def test_sample_range_is_shard_aligned_and_tp_ranks_share_it():
    # 10 samples, shard_size 3 -> 4 shards (last holds 1): dp0 shards 0-1, dp1 shards 2-3
    assert [plan(4, r, tp_size=2).sample_range(10, 3) for r in range(4)] == [range(0, 6), range(0, 6),
                                                                              range(6, 10), range(6, 10)]
    assert [plan(3, r).sample_range(2, 1) for r in range(3)] == [range(0, 1), range(1, 2), range(2, 2)]
    assert ParallelLayout.single().sample_range(10, 4) == range(0, 10)
    assert ParallelLayout.single().shard_range(3) == range(0, 3)


@pytest.mark.parametrize("kwargs, message", [
    (dict(world_size=3, rank=0, tp_size=2, ep_size=1, **DENSE),
     "world_size 3 is not a multiple of tp_size 2: every data-parallel rank needs a full tensor-parallel group. "
     "Launch a multiple of 2 ranks or set distributed.tp_size / distributed.ep_size in the YAML (or the DeepSpeed "
     "JSON)."),
    (dict(world_size=3, rank=0, tp_size=3, ep_size=1, **DENSE),
     "tp_size 3 does not divide num_attention_heads 4: AutoTP splits attention by heads. Use a tp_size that "
     "divides 4."),
    (dict(world_size=4, rank=0, tp_size=4, ep_size=1, num_experts=None, num_attention_heads=8,
          num_key_value_heads=2),
     "tp_size 4 does not divide num_key_value_heads 2: AutoTP splits the key/value heads too. Use a tp_size that "
     "divides 2."),
    (dict(world_size=3, rank=0, tp_size=1, ep_size=3, **MOE),
     "ep_size 3 does not divide num_experts 8: every expert-parallel rank holds the same number of experts. Use an "
     "ep_size that divides 8."),
    (dict(world_size=2, rank=0, tp_size=1, ep_size=2, **DENSE),
     "ep_size 2 on a dense target: the model has no routed experts to shard. Set distributed.ep_size to 1."),
    (dict(world_size=2, rank=0, tp_size=1, ep_size=4, **MOE),
     "ep_size 4 does not divide world_size 2: expert-parallel groups are consecutive ranks and must tile the world. "
     "Launch a multiple of 4 ranks or set distributed.tp_size / distributed.ep_size in the YAML (or the DeepSpeed "
     "JSON)."),
    (dict(world_size=2, rank=0, tp_size=0, ep_size=1, **DENSE),
     "tp_size 0 must be at least 1; set distributed.tp_size / distributed.ep_size in the YAML (or the DeepSpeed "
     "JSON)."),
])
def test_build_plan_refusals(kwargs, message):
    with pytest.raises(CaptureError) as error:
        build_layout(**kwargs)
    assert str(error.value) == message


def test_resolve_degrees_sources():
    src = dict(yaml_source="run.yaml", ds_source="ds_configs/tp2.json")
    assert resolve_degrees(None, None, None, **src) == (1, 1)
    assert resolve_degrees(2, None, {}, **src) == (2, 1)
    assert resolve_degrees(None, None, {"tensor_parallel": {"autotp_size": 2},
                                        "expert_parallel": {"enabled": True, "autoep_size": 4}}, **src) == (2, 4)
    assert resolve_degrees(None, None, {"tensor_parallel": {"tp_size": 8}}, **src) == (8, 1)
    assert resolve_degrees(None, None, {"tensor_parallel": {"autotp_size": 0}}, **src) == (1, 1)
    assert resolve_degrees(2, 2, {"tensor_parallel": {"autotp_size": 2}, "expert_parallel": {"ep_size": 2}},
                           **src) == (2, 2)


def test_resolve_degrees_contradiction_names_both_files():
    with pytest.raises(CaptureError) as error:
        resolve_degrees(4, None, {"tensor_parallel": {"autotp_size": 2}}, yaml_source="run.yaml",
                        ds_source="ds_configs/tp2.json")
    assert str(error.value) == (
        "contradicting parallel degrees: run.yaml: distributed.tp_size = 4 but ds_configs/tp2.json: "
        "tensor_parallel.autotp_size = 2. Set the degree in one place only (or make them equal).")
    with pytest.raises(CaptureError, match=r"run.yaml: distributed.ep_size = 2 but ds.json: expert_parallel"
                                           r".autoep_size = 4"):
        resolve_degrees(None, 2, {"expert_parallel": {"autoep_size": 4}}, yaml_source="run.yaml",
                        ds_source="ds.json")


def test_resolve_degrees_inside_one_json():
    with pytest.raises(CaptureError) as error:
        resolve_degrees(None, None, {"tensor_parallel": {"autotp_size": 2, "tp_size": 4}}, yaml_source="run.yaml",
                        ds_source="ds.json")
    assert str(error.value) == ("ds.json: tensor_parallel.autotp_size = 2 but tensor_parallel.tp_size = 4. "
                                "Keep one of them (or make them equal).")
    with pytest.raises(CaptureError) as error:
        resolve_degrees(None, None, {"tensor_parallel": {"autotp_size": "2"}}, yaml_source="run.yaml",
                        ds_source="ds.json")
    assert str(error.value) == "ds.json: tensor_parallel.autotp_size must be a non-negative integer, got '2'."
