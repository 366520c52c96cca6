"""The DeepSpeed engine: the frozen target sharded over ranks, no rank ever holding the whole model.

In:  a :class:`~ds_capture.target.families.TargetInfo`, this rank's :class:`~ds_capture.parallel.layout.ParallelLayout` and
     :class:`~ds_capture.parallel.layout.ParallelGroups`, the compute dtype, the attention implementation and the
     DeepSpeed config mapping (only ``tensor_parallel.tp_grain_size`` is read here).
Out: the plain Hugging Face CausalLM module (unwrapped from DeepSpeed's InferenceEngine, so hooks use the
     family's module paths), ``eval()``, ``requires_grad_(False)``. Every rank calls
     ``model(input_ids=..., attention_mask=...)`` under ``torch.no_grad()`` (gloo collectives fail under
     ``inference_mode``) with its own micro-batch; ranks of one TP group must pass the same batch.

Steps: meta model -> expert parallelism (ep > 1, :mod:`.expert_parallel`) -> the family's row-parallel tables
split over every rank (:mod:`.engram_parallel`, DeepSeek-V4.1's Engram) -> AutoTP
(``deepspeed.init_inference``, tp > 1; or the family's own ``tp_plan``, :mod:`.tensor_parallel`, where AutoTP
mis-shards it) on the meta model, so each rank allocates only its shards ->
fill from safetensors slices (:mod:`.loading`). A world of one, and every DP-only rank of a family without
row-parallel tables, loads the whole model through the same loader (:mod:`.single`).
"""

from __future__ import annotations

import types
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ds_capture.errors import CaptureError
from ds_capture.parallel.engram_parallel import apply_engram_row_parallel
from ds_capture.parallel.expert_parallel import apply_expert_parallel
from ds_capture.parallel.shard_spec import build_shard_spec, member_of
from ds_capture.parallel.single import build_single_model
from ds_capture.parallel.tensor_parallel import apply_tensor_parallel
from ds_capture.target.families import TargetInfo
from ds_capture.target.loading import build_meta_model, load_owned_parameters
from ds_capture.target.tensor_io import LoadStats, record_tensor_layout, restore_tensor_layout

# AutoTP's default grain (64) rounds shard sizes of the MLP / lm_head to multiples of 64, which
# leaves a rank with an empty shard when a dim is small (DESIGN §6). 1 splits evenly; a DeepSpeed
# config may still ask for a coarser grain.
DEFAULT_TP_GRAIN_SIZE = 1


@dataclass(frozen=True)
class _ModelParallelUnit:
    """The ``mpu`` DeepSpeed needs to honour our TP group (without it, AutoTP groups ranks 0..tp-1)."""

    tp_group: Any
    dp_group: Any

    def get_model_parallel_group(self) -> Any:
        return self.tp_group

    def get_model_parallel_rank(self) -> int:
        return dist.get_rank(self.tp_group)

    def get_model_parallel_world_size(self) -> int:
        return dist.get_world_size(self.tp_group)

    def get_data_parallel_group(self) -> Any:
        return self.dp_group

    def get_data_parallel_rank(self) -> int:
        return 0 if self.dp_group is None else dist.get_rank(self.dp_group)

    def get_data_parallel_world_size(self) -> int:
        return 1 if self.dp_group is None else dist.get_world_size(self.dp_group)


def build_deepspeed_model(target: TargetInfo, plan: Any, groups: Any, *, dtype: torch.dtype,
                          attn_implementation: str | None, ds_config: Mapping[str, Any] | None,
                          expert_storage: str = "dequantized") -> nn.Module:
    """This rank's shard of the frozen target: EP over ``groups.ep_group``, AutoTP over ``groups.tp_group``."""
    if plan.tp_size == 1 and plan.ep_size == 1 and not target.family.row_parallel_tables:
        # Pure data parallelism replicates the model: every rank loads it whole, as one process would.
        return build_single_model(target, dtype=dtype, attn_implementation=attn_implementation,
                                  expert_storage=expert_storage)
    model, _ = build_sharded_model(target, plan, groups, dtype=dtype, attn_implementation=attn_implementation,
                                   ds_config=ds_config, expert_storage=expert_storage)
    return model


def build_sharded_model(target: TargetInfo, plan: Any, groups: Any, *, dtype: torch.dtype,
                        attn_implementation: str | None, ds_config: Mapping[str, Any] | None,
                        expert_storage: str = "dequantized") -> tuple[nn.Module, LoadStats]:
    """:func:`build_deepspeed_model` for a world > 1, also returning what this rank read from disk."""
    family = target.family
    if plan.tp_size > 1 and not family.supports_tp:
        raise CaptureError(f"distributed.tp_size ({plan.tp_size}): {family.tp_refusal} Set distributed.tp_size to 1.")

    model = build_meta_model(target, dtype=dtype, attn_implementation=attn_implementation)
    model = apply_expert_parallel(model, family, ep_group=groups.ep_group, ep_size=plan.ep_size, ep_rank=plan.ep_rank)
    # Over WORLD, DP ranks included: every rank forwards every step (padding batches too), so all enter its lookups.
    model = apply_engram_row_parallel(model, family, group=dist.group.WORLD, group_size=plan.world_size,
                                      group_rank=plan.rank)
    if plan.tp_size > 1 and family.tp_plan:  # AutoTP mis-shards this family: our own explicit plan
        model = apply_tensor_parallel(model, family, tp_group=groups.tp_group, tp_size=plan.tp_size,
                                      tp_rank=plan.tp_rank)
    elif plan.tp_size > 1:
        model = apply_autotp(model, tp_group=groups.tp_group, dp_group=groups.dp_group, dtype=dtype,
                             tp_grain_size=tp_grain_size(ds_config))
    if expert_storage == "checkpoint":
        from ds_capture.parallel.resident_experts import keep_experts_quantized

        keep_experts_quantized(model, target)  # after EP / AutoTP: the rank's experts, kept in the checkpoint format
    stats = load_owned_parameters(model, target, build_shard_spec(model, member_of(plan)))
    return model.eval().requires_grad_(False), stats


def apply_autotp(model: nn.Module, *, tp_group: Any, dp_group: Any, dtype: torch.dtype,
                 tp_grain_size: int) -> nn.Module:
    """DeepSpeed AutoTP on a meta model; returns the (unwrapped) module with its shards allocated, unfilled.

    ``init_inference`` casts the whole module to ``dtype`` (``module.bfloat16()``) and ``to_empty``-s it;
    the model's own fp32 islands (DeepSeek's router) keep their dtype; buffers are filled at load.
    """
    from ds_capture.parallel.dist import import_deepspeed

    deepspeed = import_deepspeed()
    layout = record_tensor_layout(model)
    mpu = _ModelParallelUnit(tp_group=tp_group, dp_group=dp_group)
    engine = deepspeed.init_inference(
        model,
        tensor_parallel={"tp_size": dist.get_world_size(tp_group), "tp_group": tp_group, "mpu": mpu,
                         "tp_grain_size": tp_grain_size},
        dtype=dtype,  # always explicit: init_inference defaults to fp16 and casts silently
        replace_with_kernel_inject=False,
    )
    module = engine.module
    restore_tensor_layout(module, layout)
    if dtype != torch.float32:
        reduce_row_parallel_in_fp32(module)
    empty = [name for name, param in module.named_parameters() if 0 in param.shape]
    if empty:
        raise CaptureError(
            f"deepspeed tensor_parallel.tp_grain_size ({tp_grain_size}) leaves this rank empty shards of "
            f"{', '.join(empty[:4])}: lower tp_grain_size (1 always splits evenly) or the tp_size."
        )
    return module


def reduce_row_parallel_in_fp32(model: nn.Module) -> None:
    """Row-parallel layers compute their partial products in fp32, all-reduce in fp32, round once.

    One process's bf16 matmul accumulates in fp32 and rounds once. AutoTP's default rounds each rank's
    partial sum to bf16 and then sums those, which flips near-tie router choices (measured: up to 5.75%
    of a layer's tokens). bf16 values are exact in fp32, so here only the fp32 summation order differs
    from one process before the single rounding. That costs an fp32 matmul in o_proj / down_proj.
    """
    from deepspeed.module_inject.layers import LinearAllreduce, LmHeadLinearAllreduce

    for module in model.modules():
        if isinstance(module, LinearAllreduce) and not isinstance(module, LmHeadLinearAllreduce):
            module.forward = types.MethodType(_fp32_row_parallel_forward, module)


def _fp32_row_parallel_forward(self, input: torch.Tensor) -> torch.Tensor:
    from deepspeed.module_inject.layers import RowParallel

    output = torch.matmul(input.float(), self.weight.float().transpose(-1, -2))
    if self.mp_group is not None:
        output = RowParallel.apply(self.mp_group, output, True)  # collective: every TP rank, same shapes
    if self.bias is not None:
        output = output + self.bias.float()
    return output.to(input.dtype)


def tp_grain_size(ds_config: Mapping[str, Any] | None) -> int:
    """``tensor_parallel.tp_grain_size`` of the DeepSpeed config (AutoTP's split grain): the engine and ``plan``."""
    section = (ds_config or {}).get("tensor_parallel") or {}
    value = section.get("tp_grain_size", DEFAULT_TP_GRAIN_SIZE)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise CaptureError(f"deepspeed config tensor_parallel.tp_grain_size ({value!r}) must be a positive integer.")
    return value
