"""Expert parallelism for NeMo AutoModel's ``GroupedExperts`` (DeepSeek-V4.1, Kimi K3): E/ep experts per rank.

In:  a model holding NeMo ``GroupedExperts`` modules (``forward(x [T, D], token_mask [T] bool, weights [T, K],
     indices [T, K] global ids)``, parameters ``gate_and_up_projs [E, D, 2I]`` and ``down_projs [E, I, D]``),
     this rank's EP group / size / rank.
Out: the same model, each such module now holding experts ``[ep_rank * E/ep, (ep_rank + 1) * E/ep)`` only
     and exchanging (token, slot) pairs with its EP peers by ``all_to_all_single``.

NeMo's own EP all-gathers every rank's tokens, computes the local experts over all of them and all-reduces
the fp32 partial sums: ``(e1 + e2) + (e3 + e4)`` where one process adds ``((e1 + e2) + e3) + e4``, and each
expert's GEMM sees every rank's rows at once, where one process sees only its own (on this CPU a GEMM's
row results can change with its row count). Neither is bitwise. This layer reproduces one process exactly:

1. each (token, slot) pair of a valid token goes to the rank owning its expert, grouped by expert and, within
   an expert, in token order, with its routing weight;
2. the owner runs, for each source rank and each local expert, exactly the block of rows that source's own
   single-process loop (``GroupedExperts._forward_loop``, the ``experts="torch"`` backend) would multiply:
   same rows, same order, same GEMM shapes, the module's own activation, in the module's compute dtype;
3. the fp32 per-pair results come back, and each token adds them to an fp32 zero row in ascending expert
   id (the loop's ``scatter_add_`` order) or, with ``apply_router_weight_after_down``, places them in their
   slots and sums the slots as the loop does; then the cast to the input dtype.

Kimi K3's ``KimiK3MoE`` does not call ``experts.forward`` in eval mode (experts not DTensors): it runs its own
``_forward_reference_order`` (pairs by ``argsort`` of the expert ids, unweighted SiTU, the K outputs weighted in
fp32 and summed). That block is switched too, and :meth:`~ExpertParallelGroupedExperts.forward_reference_order`
runs the same order, blocks and combine over the EP group.

Equal to one process bit for bit in fp32 and bf16 (tests/distributed/test_grouped_experts_ep.py). The grouped
GEMM backends (``experts="torch_mm"`` / ``"gmm"``) are refused: their combine is another function.

Legend: T = tokens on this rank, K = experts per token, D = hidden, P = valid pairs sent, N = pairs received,
E = experts, L = E / ep local experts.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from ds_capture.errors import CaptureError
from ds_capture.parallel.all_to_all import all_to_all_rows, exchange_counts
from ds_capture.parallel.expert_slicing import check_ep_divides, keep_local_experts
from ds_capture.target.nemo_models import is_grouped_experts


def _expert_rows(module: nn.Module, x: torch.Tensor, w: torch.Tensor, local_idx: int,
                 gate_and_up_projs: torch.Tensor, down_projs: torch.Tensor) -> torch.Tensor:
    """One expert over one source's rows, as ``GroupedExperts._forward_loop`` computes it; fp32 [rows, D].

    x [rows, D] in the compute dtype; w [rows, 1] routing weights in their own dtype.
    """
    config = module.config
    gate_and_up_out = x @ gate_and_up_projs[local_idx]
    if module.gate_up_proj_bias is not None:
        gate_and_up_out = gate_and_up_out + module.gate_up_proj_bias[local_idx].to(x.dtype)
    activation_weight = torch.ones_like(w) if config.apply_router_weight_after_down else w
    expert_out = module.expert_activation_grouped(gate_and_up_out, activation_weight) @ down_projs[local_idx]
    if module.down_proj_bias is not None:
        bias = module.down_proj_bias[local_idx].to(x.dtype)
        expert_out = expert_out + (bias if config.apply_router_weight_after_down else bias * w)
    if config.apply_router_weight_after_down:
        return expert_out.float() * w.float()
    return expert_out.float()


class ExpertParallelGroupedExperts(nn.Module):
    """Mixin placed in front of NeMo's ``GroupedExperts``; the instance keeps only its EP rank's experts."""

    ep_group: dist.ProcessGroup
    ep_size: int
    ep_rank: int
    num_local_experts: int
    expert_start: int

    def _exchange(self, send_x: torch.Tensor, send_w: torch.Tensor | None, send_counts: torch.Tensor,
                  expert_fn: Callable[..., torch.Tensor], out_dtype: torch.dtype) -> torch.Tensor:
        """Pairs ``send_x [P, D]`` (sorted by global expert, ``send_counts [ep, L]`` per rank and local expert)
        -> ``expert_fn(rows, w, local_idx)`` computed on the owners, one block per source rank and expert
        (the rows that source's own single-process loop multiplies, in its order), returned in send order."""
        hidden_dim = send_x.shape[-1]
        # Every EP rank must enter these all-to-alls, also with zero pairs for some peer.
        recv_counts = exchange_counts(send_counts, self.ep_group)
        send_splits, recv_splits = send_counts.sum(1).tolist(), recv_counts.sum(1).tolist()
        recv_x = all_to_all_rows(send_x, send_splits, recv_splits, self.ep_group)  # [N, D]
        recv_w = None if send_w is None else all_to_all_rows(send_w, send_splits, recv_splits, self.ep_group)

        out = recv_x.new_empty(recv_x.shape[0], hidden_dim, dtype=out_dtype)
        start = 0
        for block, count in enumerate(recv_counts.reshape(-1).tolist()):
            if count:
                rows = recv_x[start : start + count]
                w = None if recv_w is None else recv_w[start : start + count, None]
                out[start : start + count] = expert_fn(rows, w, block % self.num_local_experts)
            start += count
        return all_to_all_rows(out, recv_splits, send_splits, self.ep_group)

    def _send_counts(self, pair_expert: torch.Tensor) -> torch.Tensor:
        """``[ep, L]`` pairs per destination rank and local expert (pairs sorted by expert)."""
        return torch.bincount(pair_expert, minlength=self.ep_size * self.num_local_experts).view(
            self.ep_size, self.num_local_experts)

    def forward(self, x: torch.Tensor, token_mask: torch.Tensor, weights: torch.Tensor,
                indices: torch.Tensor) -> torch.Tensor:
        """``GroupedExperts.forward`` (experts="torch": ``_forward_loop``) over the EP group."""
        num_tokens, top_k = indices.shape
        compute_dtype = x.dtype
        # Valid pairs in token-major order, then stably by expert: grouped by destination rank and expert,
        # tokens ascending within an expert, which is the row order of the loop's torch.where.
        valid = token_mask.unsqueeze(-1).expand(num_tokens, top_k).reshape(-1)
        pair_ids = torch.nonzero(valid).squeeze(-1)
        pair_expert = indices.reshape(-1)[pair_ids].long()
        order = torch.argsort(pair_expert, stable=True)
        pair_ids, pair_expert = pair_ids[order], pair_expert[order]
        send_x = x[torch.div(pair_ids, top_k, rounding_mode="floor")]  # [P, D]
        send_w = weights.reshape(-1)[pair_ids]  # [P], the router's dtype
        gate_and_up_projs = self.gate_and_up_projs.to(compute_dtype)
        down_projs = self.down_projs.to(compute_dtype)

        def expert_fn(rows: torch.Tensor, w: torch.Tensor, local_idx: int) -> torch.Tensor:
            # A fresh copy, as the loop's x.gather makes one.
            return _expert_rows(self, rows.clone(), w.clone(), local_idx, gate_and_up_projs, down_projs)

        back = self._exchange(send_x, send_w, self._send_counts(pair_expert), expert_fn, torch.float32)
        return self._combine(back, pair_ids, num_tokens, top_k, x.dtype)

    def forward_reference_order(self, hidden_states: torch.Tensor, topk_ids: torch.Tensor,
                                topk_weight: torch.Tensor, activation: Callable[[torch.Tensor], torch.Tensor]
                                ) -> torch.Tensor:
        """Kimi K3's eval-mode ``KimiK3MoE._forward_reference_order`` over the EP group (every pair, no mask).

        Its order: pairs by ``topk_ids.reshape(-1).argsort()`` (the same call, so the same order), each expert's
        block of ``sorted_tokens``, ``activation(rows @ W1) @ W2`` in the hidden dtype, then per token the K
        outputs times the weights in the weights' dtype, summed over K, cast back.
        """
        num_tokens, top_k = topk_ids.shape
        sorted_ids = topk_ids.reshape(-1).argsort()
        send_x = hidden_states[torch.div(sorted_ids, top_k, rounding_mode="floor")]  # [T*K, D]

        def expert_fn(rows: torch.Tensor, w: None, local_idx: int) -> torch.Tensor:
            gate_up = rows @ self.gate_and_up_projs[local_idx].to(rows.dtype)
            return activation(gate_up) @ self.down_projs[local_idx].to(rows.dtype)

        counts = self._send_counts(topk_ids.reshape(-1)[sorted_ids].long())
        routed = self._exchange(send_x, None, counts, expert_fn, hidden_states.dtype)
        unpermuted = torch.empty_like(routed)
        unpermuted[sorted_ids] = routed
        return (unpermuted.view(num_tokens, top_k, -1).type(topk_weight.dtype).mul_(topk_weight.unsqueeze(-1))
                .sum(dim=1).type(routed.dtype))

    def _combine(self, back: torch.Tensor, pair_ids: torch.Tensor, num_tokens: int, top_k: int,
                 input_dtype: torch.dtype) -> torch.Tensor:
        """The loop's fp32 accumulation, from per-pair results ``back [P, D]`` sorted by (expert, token)."""
        hidden_dim = back.shape[-1]
        if self.config.apply_router_weight_after_down:
            # Each slot is written once onto zeros (0 + v, as scatter_add_), then the loop's sum over slots.
            slots = torch.zeros(num_tokens * top_k, hidden_dim, dtype=torch.float32, device=back.device)
            slots[pair_ids] = slots[pair_ids] + back
            return slots.view(num_tokens, top_k, hidden_dim).sum(dim=1).to(input_dtype)
        # Without it, the loop adds each expert's rows into y in ascending expert id. The pairs are sorted
        # by expert, so a token's n-th pair is its n-th smallest expert: add the n-th pairs for n = 0, 1, ...
        token = torch.div(pair_ids, top_k, rounding_mode="floor")
        nth_of_token = torch.zeros_like(token)
        by_token = torch.argsort(token, stable=True)  # stable: ascending expert within a token
        first = torch.searchsorted(token[by_token], token[by_token], right=False)
        nth_of_token[by_token] = torch.arange(token.numel(), device=token.device) - first
        y = torch.zeros(num_tokens, hidden_dim, dtype=torch.float32, device=back.device)
        for nth in range(top_k):
            pick = nth_of_token == nth
            rows = token[pick]
            y[rows] = y[rows] + back[pick]
        return y.to(input_dtype)


class ReferenceOrderExpertParallelMoE(nn.Module):
    """Mixin for a MoE block with an eval-mode ``_forward_reference_order`` (Kimi K3's ``KimiK3MoE``), which
    bypasses ``experts.forward`` when the experts are not DTensors: it now runs over the EP group."""

    def _forward_reference_order(self, hidden_states: torch.Tensor, topk_ids: torch.Tensor,
                                 topk_weight: torch.Tensor) -> torch.Tensor:
        # SiTU's function, not the module's call: it runs once per local expert that received rows, which differs
        # between ranks (a chunk vs a filler), and ZeRO-3 requires every rank to trace the same module calls.
        return self.experts.forward_reference_order(hidden_states, topk_ids, topk_weight, self._situ.forward)


_EP_CLASSES: dict[tuple[type, type], type] = {}


def _swap_class(module: nn.Module, mixin: type) -> None:
    """Put ``mixin`` in front of the module's class (one subclass per pair, so ``isinstance`` still holds)."""
    cls = type(module)
    if (mixin, cls) not in _EP_CLASSES:
        _EP_CLASSES[(mixin, cls)] = type(f"ExpertParallel{cls.__name__}", (mixin, cls), {})
    module.__class__ = _EP_CLASSES[(mixin, cls)]


def apply_grouped_experts_parallel(model: nn.Module, *, ep_group: dist.ProcessGroup | None, ep_size: int,
                                   ep_rank: int) -> nn.Module:
    """Keep experts ``[ep_rank*E/ep, (ep_rank+1)*E/ep)`` in every ``GroupedExperts``; route with all-to-all.

    A MoE block that computes its experts itself in eval mode (``_forward_reference_order``: Kimi K3) is
    switched too, so that path also runs over the EP group in its own order.

    Works on a meta model (each rank then only allocates its own experts) or a materialised one (the kept
    experts are sliced out and cloned). ``ep_size == 1`` returns the model unchanged.
    """
    if ep_size == 1:
        return model
    found = [(name, m) for name, m in model.named_modules() if is_grouped_experts(m)]
    if not found:
        raise AssertionError("apply_grouped_experts_parallel: the model has no GroupedExperts module")
    for name, experts in found:
        if isinstance(experts, ExpertParallelGroupedExperts):
            raise AssertionError(f"{name} is already expert-parallel")
        num_experts = experts.n_routed_experts
        check_ep_divides(ep_size, num_experts, name)
        if experts.use_torch_mm:
            raise CaptureError(
                f"{name}: NeMo's grouped-GEMM experts backend has no exact expert-parallel combine here; "
                f"build the model with BackendConfig(experts='torch')."
            )
        num_local, start = keep_local_experts(experts, num_experts, ep_size, ep_rank)
        _swap_class(experts, ExpertParallelGroupedExperts)
        experts.num_local_experts = num_local
        experts.expert_start = start
        experts.ep_group, experts.ep_size, experts.ep_rank = ep_group, ep_size, ep_rank
    for _, block in model.named_modules():
        if hasattr(type(block), "_forward_reference_order") and isinstance(getattr(block, "experts", None),
                                                                            ExpertParallelGroupedExperts):
            _swap_class(block, ReferenceOrderExpertParallelMoE)
    return model
