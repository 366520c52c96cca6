"""The engines' parallel layouts applied to a real-size model on ``meta``, for any rank, without a process group.

In:  a :class:`~ds_capture.target.families.TargetInfo` (only ``config.json`` is read), the compute dtype and the
     degrees (``tp_size``, ``ep_size``, and the ``world_size`` the family's row-parallel tables split over), or the
     FSDP2 world size.
Out: :func:`build_layout_on_meta` -> the meta model exactly as the DeepSpeed engine shapes it on one rank
     (expert parallelism by :func:`~ds_capture.parallel.expert_parallel.apply_expert_parallel`, the row-parallel
     tables by :func:`~ds_capture.parallel.engram_parallel.apply_engram_row_parallel`, then DeepSpeed
     AutoTP's own module replacement); ``plan`` reads its :func:`~ds_capture.parallel.shard_spec.build_shard_spec`,
     the same spec the engines load by.

How AutoTP's decisions are obtained without a process group: ``init_inference`` (what the engine calls) runs
``AutoTP.tp_parser(model)`` and then ``replace_transformer_layer`` for every client module it found; the AutoTP
layer classes freeze their split with ``get_shard_size_list(total, tp_size, ...)``, which is the same for every
rank. Here those two DeepSpeed functions run on the meta model with a stand-in TP group: while they run,
``deepspeed.comm.get_rank`` / ``get_world_size`` answer ``(tp_rank 0, tp_size)`` for that one object (and defer
to DeepSpeed for anything else). Only rank 0's shapes are built; every other rank's sizes are the layers'
``partition_sizes[tp_rank]``. What ``init_inference`` does besides (moving to a device, the rng broadcast,
Bloom's alibi hack) does not change the layout.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch
from torch import nn

from ds_capture.errors import CaptureError
from ds_capture.parallel.engram_parallel import apply_engram_row_parallel
from ds_capture.parallel.expert_parallel import apply_expert_parallel
from ds_capture.target.families import TargetInfo
from ds_capture.target.loading import build_meta_model
from ds_capture.target.tensor_io import record_tensor_layout, restore_tensor_layout


@dataclass(frozen=True)
class _StandInGroup:
    """What DeepSpeed asks of a TP process group while it shards: its size and this rank's index in it."""

    size: int
    rank: int = 0


@contextmanager
def _stand_in_comm() -> Iterator[None]:
    """``deepspeed.comm.get_rank / get_world_size`` answer for a :class:`_StandInGroup` (and defer to DeepSpeed for
    anything else); restored on exit, errors included."""
    from ds_capture.parallel.dist import import_deepspeed

    ds_comm = import_deepspeed().comm

    real_rank, real_world_size = ds_comm.get_rank, ds_comm.get_world_size

    def get_rank(group=None):
        return group.rank if isinstance(group, _StandInGroup) else real_rank(group=group)

    def get_world_size(group=None):
        return group.size if isinstance(group, _StandInGroup) else real_world_size(group=group)

    ds_comm.get_rank, ds_comm.get_world_size = get_rank, get_world_size
    try:
        yield
    finally:
        ds_comm.get_rank, ds_comm.get_world_size = real_rank, real_world_size


def apply_autotp_on_meta(model: nn.Module, *, tp_size: int, dtype: torch.dtype, tp_grain_size: int) -> nn.Module:
    """DeepSpeed AutoTP's module replacement on a meta model, as ``init_inference`` runs it (tp rank 0's shapes)."""
    from deepspeed.inference.config import DeepSpeedInferenceConfig
    from deepspeed.module_inject import replace_transformer_layer
    from deepspeed.module_inject.auto_tp import AutoTP

    layout = record_tensor_layout(model)
    group = _StandInGroup(size=tp_size)
    config = DeepSpeedInferenceConfig(tensor_parallel={"tp_size": tp_size, "tp_group": group,
                                                       "tp_grain_size": tp_grain_size},
                                      dtype=dtype, replace_with_kernel_inject=False)
    model.to(dtype)  # init_inference's _convert_to_dtype; the engine restores the recorded dtypes after
    with _stand_in_comm():
        for client_module, policy in AutoTP.tp_parser(model):
            config.injection_policy_tuple = (policy,) if isinstance(policy, str) else policy
            replace_transformer_layer(client_module, model, None, config, model.config, training_mode=False)
    restore_tensor_layout(model, layout)
    return model


def build_layout_on_meta(target: TargetInfo, *, dtype: torch.dtype, tp_size: int, ep_size: int,
                         tp_grain_size: int, attn_implementation: str | None = None,
                         world_size: int = 1) -> nn.Module:
    """The meta model shaped as the DeepSpeed engine shapes one rank: EP (experts of EP rank 0), the family's
    row-parallel tables split over ``world_size`` ranks (rank 0's rows), then AutoTP.

    Every EP rank holds the same number of experts (``ep_size`` must divide it), so EP rank 0 stands for all; every
    rank holds ``ceil(rows / world_size)`` rows of a row-parallel table (the last ones padded), so rank 0 does too.
    """
    family = target.family
    if tp_size > 1 and not family.supports_tp:
        raise CaptureError(f"distributed.tp_size ({tp_size}): {family.tp_refusal} Set distributed.tp_size to 1.")
    model = build_meta_model(target, dtype=dtype, attn_implementation=attn_implementation)
    model = apply_expert_parallel(model, family, ep_group=None, ep_size=ep_size, ep_rank=0)
    model = apply_engram_row_parallel(model, family, group=None, group_size=world_size, group_rank=0)
    if tp_size > 1 and family.tp_plan:  # AutoTP mis-shards this family: the engine applies our own plan
        from ds_capture.parallel.tensor_parallel import apply_tensor_parallel

        model = apply_tensor_parallel(model, family, tp_group=None, tp_size=tp_size, tp_rank=0)
    elif tp_size > 1:
        model = apply_autotp_on_meta(model, tp_size=tp_size, dtype=dtype, tp_grain_size=tp_grain_size)
    return model
