"""Engines: functions that turn a target checkpoint and a ParallelLayout into a frozen, sharded model.

Every engine has the same signature and returns a plain Hugging Face causal LM module (its
module paths unchanged, so the family registry and the hooks work on it) whose forward is a
collective: every rank of the job calls it the same number of times. Choosing an engine is one
config key (``engine: deepspeed | fsdp2``); a world of one process is the plain model for both.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from ds_capture.errors import CaptureError
from ds_capture.target.families import TargetInfo


def build_model(
    engine: str,
    target: TargetInfo,
    plan: Any,
    groups: Any,
    *,
    dtype: torch.dtype,
    attn_implementation: str | None,
    ds_config: Mapping[str, Any] | None,
    expert_storage: str = "dequantized",
) -> torch.nn.Module:
    """Build the frozen target for this rank in ``plan``'s layout (resolved and checked by
    :func:`~ds_capture.parallel.resolve.resolve_layout`: the engine dispatches on ``plan.sharding``).

    ``expert_storage``: ``dequantized`` (routed experts dequantized on load) or ``checkpoint`` (kept in the
    checkpoint's quantized format, dequantized per expert in the forward: :mod:`.resident_experts`).
    """
    if plan.world_size == 1:
        from ds_capture.parallel.single import build_single_model

        return build_single_model(target, dtype=dtype, attn_implementation=attn_implementation,
                                  expert_storage=expert_storage)
    if plan.sharding == "zero3":
        from ds_capture.parallel.zero3_engine import build_zero3_model

        return build_zero3_model(target, plan, dtype=dtype, attn_implementation=attn_implementation,
                                 expert_storage=expert_storage)
    if plan.sharding == "deepspeed":
        from ds_capture.parallel.deepspeed_engine import build_deepspeed_model

        return build_deepspeed_model(
            target, plan, groups, dtype=dtype, attn_implementation=attn_implementation, ds_config=ds_config,
            expert_storage=expert_storage,
        )
    if plan.sharding == "fsdp2":
        try:
            from ds_capture.parallel.fsdp2_engine import build_fsdp2_model
        except ImportError as error:
            raise CaptureError("engine: fsdp2 is not available in this version; use engine: deepspeed.") from error
        return build_fsdp2_model(target, plan, groups, dtype=dtype, attn_implementation=attn_implementation,
                                 expert_storage=expert_storage)
    raise AssertionError(f"unresolved sharding {plan.sharding!r} (engine {engine!r})")
