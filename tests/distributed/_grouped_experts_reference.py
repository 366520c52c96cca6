"""A small faithful copy of NeMo AutoModel 0.7.0's ``GroupedExperts`` single-process forward (experts="torch").

Used by tests/distributed/_grouped_experts_worker.py ONLY where nemo_automodel is not installed (CI's project
venv), so the expert-parallel split is still tested against the loop it must reproduce; with NeMo installed the
worker uses NeMo's real class. Copied from ``nemo_automodel/components/moe/experts.py``
(``GroupedExperts.__init__`` / ``forward`` at ep_size 1 / ``_forward_loop``) and
``moe/megatron/moe_utils.py`` (``weighted_swiglu``), ``experts.py`` (``swiglu_clamped_deepep``); Apache-2.0.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class MoEConfig:
    n_routed_experts: int
    expert_dim: int
    moe_inter_dim: int
    expert_bias: bool = False
    apply_router_weight_after_down: bool = False
    swiglu_limit: float = 0.0
    dtype: torch.dtype = torch.float32


def weighted_swiglu(y, weights):
    y_1, y_2 = torch.chunk(y, 2, -1)
    return (F.silu(y_1) * y_2 * weights).to(y.dtype)


def swiglu_clamped_deepep(x, permuted_probs, limit: float):
    gate, up = torch.chunk(x, 2, dim=-1)
    gate = gate.float().clamp(max=limit)
    up = up.float().clamp(min=-limit, max=limit)
    return (F.silu(gate) * up * permuted_probs).to(x.dtype)


class GroupedExperts(nn.Module):
    def __init__(self, config: MoEConfig):
        super().__init__()
        self.config = config
        self.n_routed_experts = config.n_routed_experts
        self.expert_bias = config.expert_bias
        self.use_torch_mm = False
        up = config.moe_inter_dim * 2
        self.gate_and_up_projs = nn.Parameter(torch.empty(config.n_routed_experts, config.expert_dim, up,
                                                          dtype=config.dtype))
        self.down_projs = nn.Parameter(torch.empty(config.n_routed_experts, config.moe_inter_dim, config.expert_dim,
                                                   dtype=config.dtype))
        if self.expert_bias:
            self.gate_up_proj_bias = nn.Parameter(torch.empty(config.n_routed_experts, up, dtype=config.dtype))
            self.down_proj_bias = nn.Parameter(torch.empty(config.n_routed_experts, config.expert_dim,
                                                           dtype=config.dtype))
        else:
            self.gate_up_proj_bias = self.down_proj_bias = None
        self.expert_activation_grouped = (partial(swiglu_clamped_deepep, limit=config.swiglu_limit)
                                          if config.swiglu_limit > 0 else weighted_swiglu)

    def forward(self, x, token_mask, weights, indices):
        input_dtype = x.dtype
        gate_and_up_projs, down_projs = self.gate_and_up_projs.to(x.dtype), self.down_projs.to(x.dtype)
        gate_up_proj_bias = self.gate_up_proj_bias.to(x.dtype) if self.expert_bias else None
        down_proj_bias = self.down_proj_bias.to(x.dtype) if self.expert_bias else None
        after_down = self.config.apply_router_weight_after_down
        y = torch.zeros((x.shape[0], weights.shape[1], x.shape[1]) if after_down else x.shape, dtype=torch.float32)
        for i in range(self.n_routed_experts):
            idx, top = torch.where(torch.logical_and(indices == i, token_mask.unsqueeze(-1)))
            if idx.numel() == 0:
                continue
            idx_b = idx[:, None].expand(-1, x.size(1))
            x_idx = x.gather(dim=0, index=idx_b)
            gate_and_up_out = x_idx @ gate_and_up_projs[i]
            if gate_up_proj_bias is not None:
                gate_and_up_out = gate_and_up_out + gate_up_proj_bias[i]
            w = weights[idx, top, None]
            activated = self.expert_activation_grouped(gate_and_up_out, torch.ones_like(w) if after_down else w)
            expert_out = activated @ down_projs[i]
            if down_proj_bias is not None:
                expert_out = expert_out + (down_proj_bias[i] if after_down else down_proj_bias[i] * w)
            if after_down:
                expert_out = expert_out.float() * w.float()
                slot_ids_b = (idx * weights.shape[1] + top)[:, None].expand(-1, x.size(1))
                y.view(-1, x.size(1)).scatter_add_(dim=0, index=slot_ids_b, src=expert_out.float())
            else:
                y.scatter_add_(dim=0, index=idx_b, src=expert_out.float())
        if after_down:
            y = y.sum(dim=1)
        return y.to(input_dtype)


class KimiK3MoE(nn.Module):
    """The part of NeMo's ``KimiK3MoE`` the split replaces: its eval-mode ``_forward_reference_order``
    (copied from ``nemo_automodel/components/models/kimi_k3/model.py``), with SwiGLU for its SiTU."""

    def __init__(self, experts: GroupedExperts):
        super().__init__()
        self.experts = experts
        self.n_routed_experts = experts.n_routed_experts
        self._situ = lambda x: F.silu(x.chunk(2, -1)[0]) * x.chunk(2, -1)[1]

    def _forward_reference_order(self, hidden_states, topk_ids, topk_weight):
        counts = topk_ids.new_zeros((topk_ids.shape[0], self.n_routed_experts))
        counts.scatter_(1, topk_ids, 1)
        tokens_per_expert = counts.sum(dim=0).cpu().tolist()
        sorted_ids = topk_ids.reshape(-1).argsort()
        sorted_tokens = hidden_states[sorted_ids // topk_ids.shape[1]]
        outputs = []
        start = 0
        for expert_idx, num_tokens in enumerate(tokens_per_expert):
            end = start + num_tokens
            if num_tokens:
                tokens = sorted_tokens[start:end]
                gate_up = tokens @ self.experts.gate_and_up_projs[expert_idx].to(tokens.dtype)
                outputs.append(self._situ(gate_up) @ self.experts.down_projs[expert_idx].to(tokens.dtype))
            start = end
        routed = torch.cat(outputs, dim=0) if outputs else sorted_tokens.new_empty((0, hidden_states.shape[-1]))
        unpermuted = torch.empty_like(routed)
        unpermuted[sorted_ids] = routed
        return (unpermuted.view(*topk_ids.shape, -1).type(topk_weight.dtype).mul_(topk_weight.unsqueeze(-1))
                .sum(dim=1).type(routed.dtype))
