"""Which experts an expert-parallel rank keeps, for both EP layers (transformers' fused experts, NeMo's
GroupedExperts): the divisibility check and the slicing of every parameter with a leading expert dim.
"""

from __future__ import annotations

from torch import nn

from ds_capture.errors import CaptureError


def check_ep_divides(ep_size: int, num_experts: int, name: str) -> None:
    if num_experts % ep_size:
        raise CaptureError(
            f"distributed.ep_size ({ep_size}) must divide the number of routed experts ({num_experts}) "
            f"of {name}. Choose an ep_size among the divisors of {num_experts}."
        )


def keep_local_experts(experts: nn.Module, num_experts: int, ep_size: int, ep_rank: int) -> tuple[int, int]:
    """Slice every parameter of ``experts`` with a leading expert dimension to this rank's block of experts
    (meta tensors stay meta; real ones are cloned, so the full tensors can be freed). Returns (count, first)."""
    num_local = num_experts // ep_size
    start = ep_rank * num_local
    for param_name, param in list(experts.named_parameters(recurse=False)):
        if param.dim() and param.shape[0] == num_experts:
            kept = param.detach()[start : start + num_local]
            kept = kept if kept.is_meta else kept.clone()
            setattr(experts, param_name, nn.Parameter(kept, requires_grad=False))
    return num_local, start
