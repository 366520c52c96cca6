"""Expert parallelism for Hugging Face fused-expert MoE blocks: E/ep routed experts per rank, all-to-all dispatch.

In:  a plain Hugging Face causal LM (on meta or materialised), its :class:`~ds_capture.target.family.Family`, and
     this rank's EP group / size / rank.
Out: the same model, each MoE block's routed-experts module now holding experts
     ``[ep_rank * E/ep, (ep_rank + 1) * E/ep)`` only and exchanging tokens with its EP peers.

The model's own router, shared experts and block forward are untouched: the block still calls
``experts(hidden, top_k_index, top_k_weights)``. The experts module is switched (``__class__`` swap,
as torch's ``fully_shard`` does) to a subclass whose forward

1. sends every (token, slot) pair to the rank owning its expert (``all_to_all_single``, uneven splits),
2. runs the model's **own** expert math there on one expert per row with weight 1 (exact: x * 1 = x),
   which returns the unweighted expert output in the model dtype, once per source rank (each source's
   rows in a computation of their own: no GEMM mixes two ranks' tokens),
3. sends the outputs back and combines them with the routing weights exactly as the experts
   implementation in use (``config._experts_implementation``) combines them on one process.

So the result equals the single-process forward bit for bit (DESIGN §6: combine order and the
router-weight dtype matter in bf16). Parameter names and module paths do not change, so hooks
and the loader see plain Hugging Face names.

Legend: T = tokens on this rank, K = experts per token, P = T*K pairs, N = pairs received, H = hidden.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from ds_capture.errors import CaptureError
from ds_capture.target.family import Family, get_submodule
from ds_capture.parallel.all_to_all import all_to_all_rows, exchange_counts
from ds_capture.parallel.expert_slicing import check_ep_divides, keep_local_experts


def _combine_index_add(expert_out: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                       out_dtype: torch.dtype) -> torch.Tensor:
    """The eager loop: per expert in ascending id, ``out.index_add_((y * w).to(out_dtype))``."""
    # expert_out [T, K, H]; each token adds its K contributions in ascending expert id, rounding to
    # out_dtype after every add, exactly like the eager loop's index_add_ over experts in order.
    order = top_k_index.argsort(dim=-1)
    out = torch.zeros(expert_out.shape[0], expert_out.shape[-1], dtype=out_dtype, device=expert_out.device)
    for slot in range(top_k_index.shape[-1]):
        pick = order[:, slot : slot + 1]
        y = expert_out.gather(1, pick.unsqueeze(-1).expand(-1, -1, expert_out.shape[-1])).squeeze(1)
        w = top_k_weights.gather(1, pick)
        out = out + (y * w).to(out_dtype)
    return out


def _combine_weighted_sum(expert_out: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                          out_dtype: torch.dtype) -> torch.Tensor:
    """grouped_mm / batched_mm: ``(y * w).view(T, K, H).sum(1).to(out_dtype)`` in slot order."""
    return (expert_out * top_k_weights.unsqueeze(-1)).sum(dim=1).to(out_dtype)


# How each transformers experts implementation reduces the K weighted expert outputs of a token
# (transformers 5.24 integrations/moe.py). A new implementation needs its combine here.
_COMBINES: dict[str, Callable[..., torch.Tensor]] = {
    "eager": _combine_index_add,
    "grouped_mm": _combine_weighted_sum,
    "batched_mm": _combine_weighted_sum,
}


class ExpertParallelExperts(nn.Module):
    """Mixin placed in front of a fused-experts class; the instance keeps only its EP rank's experts."""

    ep_group: dist.ProcessGroup
    ep_size: int
    ep_rank: int
    num_global_experts: int
    num_local_experts: int
    expert_start: int

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        num_tokens, top_k = top_k_index.shape
        hidden_dim = hidden_states.shape[-1]
        # Dispatch: group the P pairs by destination rank (stable, so pair order within a rank is kept).
        pair_expert = top_k_index.reshape(-1)
        pair_dest = torch.div(pair_expert, self.num_local_experts, rounding_mode="floor")
        order = torch.argsort(pair_dest, stable=True)
        send_counts = torch.bincount(pair_dest, minlength=self.ep_size)
        # Every EP rank must enter these all-to-alls, also with zero pairs for some peer.
        recv_counts = exchange_counts(send_counts, self.ep_group)
        send_splits, recv_splits = send_counts.tolist(), recv_counts.tolist()

        send_local_id = pair_expert[order] - pair_dest[order] * self.num_local_experts
        recv_hidden = all_to_all_rows(hidden_states[order // top_k], send_splits, recv_splits, self.ep_group)  # [N, H]
        recv_local_id = all_to_all_rows(send_local_id, send_splits, recv_splits, self.ep_group)

        # The model's own expert math, one expert per row and weight 1 (in the hidden dtype, so x * 1
        # is exact): the unweighted expert output. Weighting happens at the origin, in the router's dtype.
        # One call per source rank: an expert's matmul sees exactly the rows its source's own single-process
        # forward would give it (on a CPU a GEMM's row results can change with its row count), never another
        # rank's, so a rank's result does not depend on what its peers forward (ds-capture serve's replicas).
        segments, start = [], 0
        for count in recv_splits:
            if count:
                rows = recv_hidden[start : start + count]
                ones = torch.ones(count, 1, dtype=rows.dtype, device=rows.device)
                segments.append(super().forward(rows, recv_local_id[start : start + count].unsqueeze(-1), ones))
            start += count
        expert_out = (segments[0] if len(segments) == 1 else torch.cat(segments)) if segments else recv_hidden

        # Return trip: the outputs go back along the reversed splits, then back into pair order.
        back = all_to_all_rows(expert_out, recv_splits, send_splits, self.ep_group)  # [T*K, H]
        pair_out = torch.empty_like(back)
        pair_out[order] = back
        combine = _COMBINES[self.config._experts_implementation]
        return combine(pair_out.view(num_tokens, top_k, hidden_dim), top_k_index, top_k_weights,
                       hidden_states.dtype)


_EP_CLASSES: dict[type, type] = {}


def _expert_parallel_class(cls: type) -> type:
    """One ``ExpertParallel<cls>`` subclass per experts class, so ``isinstance(m, cls)`` still holds."""
    if cls not in _EP_CLASSES:
        _EP_CLASSES[cls] = type(f"ExpertParallel{cls.__name__}", (ExpertParallelExperts, cls), {})
    return _EP_CLASSES[cls]


def moe_experts_modules(model: nn.Module, family: Family) -> list[tuple[str, nn.Module]]:
    """``(qualified name, experts module)`` of every MoE block (dense layers of a MoE family are skipped)."""
    if family.is_nemo:  # NeMo's GroupedExperts, wherever its MoE block keeps them
        from ds_capture.target.nemo_models import is_grouped_experts

        return [(name, module) for name, module in model.named_modules() if is_grouped_experts(module)]
    found = []
    for index, layer in enumerate(get_submodule(model, family.layers)):
        block = getattr(layer, family.moe_block, None)
        experts = getattr(block, family.experts, None) if block is not None else None
        if isinstance(experts, nn.Module) and hasattr(experts, "num_experts"):
            found.append((f"{family.layers}.{index}.{family.moe_block}.{family.experts}", experts))
    return found


def apply_expert_parallel(model: nn.Module, family: Family, *, ep_group: dist.ProcessGroup | None, ep_size: int,
                          ep_rank: int) -> nn.Module:
    """Keep experts ``[ep_rank*E/ep, (ep_rank+1)*E/ep)`` in every MoE block and route tokens with all-to-all.

    Works on a meta model (each rank then only ever allocates its own experts) or a materialised one
    (the kept experts are sliced out). ``ep_size == 1`` returns the model unchanged.
    """
    if ep_size == 1:
        return model
    if family.is_nemo:  # NeMo's GroupedExperts: their own exact split
        from ds_capture.parallel.grouped_experts import apply_grouped_experts_parallel

        return apply_grouped_experts_parallel(model, ep_group=ep_group, ep_size=ep_size, ep_rank=ep_rank)
    if not family.is_moe or not family.supports_ep:
        raise CaptureError(
            f"distributed.ep_size ({ep_size}): model_type {family.model_type!r} has no expert-parallel layout. "
            f"{family.ep_refusal or 'It is not a MoE family.'} Set distributed.ep_size to 1."
        )
    blocks = moe_experts_modules(model, family)
    if not blocks:
        raise AssertionError(f"family {family.model_type!r}: no experts module found at {family.layers}.*."
                             f"{family.moe_block}.{family.experts}")
    for name, experts in blocks:
        num_experts = experts.num_experts
        check_ep_divides(ep_size, num_experts, name)
        implementation = experts.config._experts_implementation
        if implementation not in _COMBINES:
            raise CaptureError(
                f"target_experts_implementation {implementation!r} has no exact expert-parallel combine; "
                f"use one of {sorted(_COMBINES)}."
            )
        num_local, start = keep_local_experts(experts, num_experts, ep_size, ep_rank)
        experts.__class__ = _expert_parallel_class(type(experts))
        experts.num_experts = num_local
        experts.num_global_experts = num_experts
        experts.num_local_experts = num_local
        experts.expert_start = start
        experts.ep_group, experts.ep_size, experts.ep_rank = ep_group, ep_size, ep_rank
    return model
