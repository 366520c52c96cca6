"""The one place a run's layout is resolved: degrees, engine, ZeRO stage and expert storage -> a ParallelLayout.

In:  a validated :class:`~ds_capture.recipe.config.RunConfig` (``distributed.tp_size`` / ``ep_size``, ``engine``, the
     DeepSpeed config's degrees and ``zero_optimization.stage``, ``capture.expert_storage``), the target's facts, the
     world size and this rank.
Out: :func:`resolve_layout` -> the :class:`~ds_capture.parallel.layout.ParallelLayout` with its ``sharding`` (TP x EP,
     FSDP2, FSDP2 + EP or ZeRO-3 + EP), its degrees and its expert storage; every refusal (the family's, the degrees
     against the world and the model, the ZeRO stage, the expert storage) raised here, before any process group or
     weight. :func:`layout_of` runs the same checks for a layout ``plan`` proposes.

The session (``run``, ``serve``) and ``plan`` both call it, and the engines dispatch on the layout's ``sharding``, so
no one re-derives the layout from the strings and flags.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from ds_capture.errors import CaptureError
from ds_capture.parallel.layout import ParallelLayout, build_layout, check_family_layout, resolve_degrees
from ds_capture.target.families import TargetInfo


def resolve_layout(cfg: Any, target: TargetInfo, *, world_size: int | None, rank: int = 0) -> ParallelLayout:
    """``cfg``'s layout on ``world_size`` ranks (None: the smallest world its degrees allow, as ``plan`` sizes it),
    placed at ``rank``."""
    from ds_capture.parallel.zero3_engine import zero_stage

    tp_size, ep_size = resolve_degrees(cfg.distributed.tp_size, cfg.distributed.ep_size, cfg.deepspeed_config,
                                       yaml_source=cfg.source, ds_source=cfg.deepspeed_config_source)
    stage = zero_stage(cfg.deepspeed_config, cfg.deepspeed_config_source)
    return layout_of(target, engine=cfg.engine, zero_stage=stage, world_size=world_size or math.lcm(tp_size, ep_size),
                     rank=rank, tp_size=tp_size, ep_size=ep_size, expert_storage=cfg.capture.expert_storage,
                     ds_source=cfg.deepspeed_config_source)


def layout_of(target: TargetInfo, *, engine: str, zero_stage: int, world_size: int, rank: int, tp_size: int,
              ep_size: int, expert_storage: str | None, ds_source: str = "deepspeed_config") -> ParallelLayout:
    """Every check of one layout, then the layout placed at ``rank``: the family's own refusals first (its reason
    beats a head-count mismatch), the sharding's degrees, the expert storage (None: not checked, a layout plan
    proposes), the degrees against the world and the model."""
    from ds_capture.parallel.resident_experts import check_expert_storage, refuse_resident_experts

    family = target.family
    check_family_layout(family, tp_size, ep_size)
    sharding = sharding_of(engine, zero_stage, family, world_size=world_size, tp_size=tp_size, ep_size=ep_size,
                           ds_source=ds_source)
    if expert_storage is not None:
        refuse_resident_experts(family, expert_storage, partitioned_ep=sharding != "deepspeed" and ep_size > 1)
        check_expert_storage(expert_storage, engine, world_size, ep_size=ep_size)
    layout = build_layout(world_size=world_size, rank=rank, tp_size=tp_size, ep_size=ep_size,
                          num_experts=target.num_experts, num_attention_heads=target.num_attention_heads,
                          num_key_value_heads=target.tp_key_value_heads)
    return replace(layout, sharding=sharding, expert_storage=expert_storage or "dequantized", zero_stage=zero_stage)


def sharding_of(engine: str, zero_stage: int, family: Any, *, world_size: int, tp_size: int, ep_size: int,
                ds_source: str = "deepspeed_config") -> str:
    """``deepspeed`` (AutoTP x EP, or the whole model), ``fsdp2`` (with EP: NeMo's families over the world) or
    ``zero3`` (``engine: deepspeed`` with ``zero_optimization.stage: 3`` on more than one rank); a world of one is the
    plain model. A stage or degrees the sharding cannot run are refused here."""
    from ds_capture.parallel.fsdp2_engine import check_fsdp2_degrees
    from ds_capture.parallel.zero3_engine import check_zero3_degrees

    if engine not in ("deepspeed", "fsdp2"):
        raise CaptureError(f"engine {engine!r} is unknown; use deepspeed or fsdp2.")
    if zero_stage == 3 and engine != "deepspeed":
        raise CaptureError(
            f"{ds_source}: zero_optimization.stage 3 is DeepSpeed's parameter partitioning, but engine is {engine!r} "
            "(torch's fully_shard). Use engine: deepspeed for ZeRO-3, or remove zero_optimization.")
    if zero_stage == 3 and world_size > 1:
        check_zero3_degrees(family, world_size=world_size, tp_size=tp_size, ep_size=ep_size)
        return "zero3"
    check_fsdp2_degrees(family, engine, world_size=world_size, tp_size=tp_size, ep_size=ep_size)
    return engine if world_size > 1 else "deepspeed"
