"""Run on every rank by tests/distributed/test_grouped_experts_ep.py: GroupedExperts EP vs the unsplit module.

In:  a JSON file of cases (dtype, activation options, routing skew) and an output directory, through torchrun
     with 2 gloo ranks.
Out: ``rank{R}.json`` in the output directory, one entry per case: whether EP equals this rank's single-process forward bit
     for bit, the max abs diff, which class was used (NeMo's own, or the faithful copy where NeMo is absent).

Every rank builds the same experts (seed 0) and its own tokens (seed 100 + rank, different counts per rank).
"""

from __future__ import annotations

import copy
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from ds_capture.parallel.dist import discover_env, distributed_session  # noqa: E402
from ds_capture.parallel.grouped_experts import apply_grouped_experts_parallel  # noqa: E402

NUM_EXPERTS, DIM, INTER, TOP_K = 8, 32, 16, 3


def build_experts(case: dict, dtype: torch.dtype) -> tuple[torch.nn.Module, str]:
    """NeMo's GroupedExperts when nemo_automodel is installed, else the faithful copy; random, same on all ranks."""
    try:
        from nemo_automodel.components.models.common import BackendConfig
        from nemo_automodel.components.moe.config import MoEConfig
        from nemo_automodel.components.moe.experts import GroupedExperts

        config = MoEConfig(n_routed_experts=NUM_EXPERTS, n_shared_experts=0, n_activated_experts=TOP_K,
                           n_expert_groups=1, n_limited_groups=1, train_gate=False, gate_bias_update_factor=0.0,
                           aux_loss_coeff=0.0, score_func="sigmoid", route_scale=1.0, dim=DIM, inter_dim=INTER,
                           moe_inter_dim=INTER, norm_topk_prob=False, expert_bias=case["expert_bias"],
                           apply_router_weight_after_down=case["after_down"], swiglu_limit=case["swiglu_limit"],
                           dtype=dtype)
        experts = GroupedExperts(config, backend=BackendConfig(attn="sdpa", linear="torch", rms_norm="torch_fp32",
                                                               experts="torch", dispatcher="torch", rope="torch",
                                                               rope_fusion=False, gate_precision="float32"))
        source = "nemo"
    except ImportError:
        from _grouped_experts_reference import GroupedExperts, MoEConfig

        experts = GroupedExperts(MoEConfig(n_routed_experts=NUM_EXPERTS, expert_dim=DIM, moe_inter_dim=INTER,
                                           expert_bias=case["expert_bias"], apply_router_weight_after_down=
                                           case["after_down"], swiglu_limit=case["swiglu_limit"], dtype=dtype))
        source = "copy"
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in experts.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
    return experts, source


def build_k3_block(dtype: torch.dtype) -> tuple[torch.nn.Module, str]:
    """NeMo's KimiK3MoE (tiny, eval mode) when installed, else the copy of its reference-order path."""
    gen = torch.Generator().manual_seed(0)
    try:
        from nemo_automodel.components.models.common import BackendConfig
        from nemo_automodel.components.models.kimi_k3.config import KimiK3TextConfig
        from nemo_automodel.components.models.kimi_k3.model import KimiK3MoE, _build_moe_config

        config = KimiK3TextConfig(vocab_size=128, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=2, moe_intermediate_size=INTER, num_experts=NUM_EXPERTS,
                                  num_experts_per_token=TOP_K, num_shared_experts=1, routed_expert_hidden_size=DIM,
                                  attn_res_block_size=None)
        backend = BackendConfig(attn="sdpa", linear="torch", rms_norm="torch_fp32", experts="torch",
                                dispatcher="torch", rope="torch", rope_fusion=False, gate_precision="float32")
        block = KimiK3MoE(config, _build_moe_config(config, dtype, None), backend)
        source = "nemo"
    except ImportError:
        from _grouped_experts_reference import KimiK3MoE

        block = KimiK3MoE(build_experts({"expert_bias": False, "after_down": True, "swiglu_limit": 0.0}, dtype)[0])
        source = "copy"
    with torch.no_grad():
        for param in block.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
        for buffer in block.buffers():
            buffer.copy_(torch.randn(buffer.shape, generator=gen) * 0.1)
    return block.eval(), source


def rank_inputs(rank: int, case: dict, dtype: torch.dtype):
    """This rank's tokens: its own count, distinct top-k experts, fp32 weights, some masked-out tokens."""
    gen = torch.Generator().manual_seed(100 + rank)
    num_tokens = 41 if rank == 0 else 29
    x = torch.randn(num_tokens, DIM, generator=gen).to(dtype)
    scores = torch.rand(num_tokens, NUM_EXPERTS, generator=gen)
    if case["skew"] and rank == 1:
        scores[:, : NUM_EXPERTS // 2] += 10.0  # rank 1 routes only to rank 0's experts: rank 1 gets no rows
    weights, indices = scores.topk(TOP_K, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    mask = torch.rand(num_tokens, generator=gen) > 0.15
    return x, mask, weights.float(), indices


def main() -> None:
    torch.set_num_threads(1)
    cases = json.loads(open(sys.argv[1]).read())
    env = discover_env()
    results: list[dict] = []
    with distributed_session(env, backend="gloo", timeout_minutes=2):
        for case in cases:
            dtype = getattr(torch, case["dtype"])
            if case.get("k3_block"):
                results.append(run_k3_case(case, env.rank, env.world_size, dtype))
                continue
            experts, source = build_experts(case, dtype)
            x, mask, weights, indices = rank_inputs(env.rank, case, dtype)
            with torch.no_grad():
                reference = experts(x, mask, weights, indices)
                split = apply_grouped_experts_parallel(copy.deepcopy(experts), ep_group=None, ep_size=env.world_size,
                                                       ep_rank=env.rank)
                local_experts = split.gate_and_up_projs.shape[0]
                out = split(x, mask, weights, indices)
            results.append({
                "case": case["name"], "rank": env.rank, "source": source, "local_experts": local_experts,
                "dtype": str(out.dtype), "equal": bool(torch.equal(out, reference)),
                "max_abs_diff": (out.float() - reference.float()).abs().max().item(),
                "max_abs": reference.float().abs().max().item()})
    with open(os.path.join(sys.argv[2], f"rank{env.rank}.json"), "w") as handle:
        json.dump(results, handle)


def run_k3_case(case: dict, rank: int, world_size: int, dtype: torch.dtype) -> dict:
    """Kimi K3's eval-mode reference-order path; with NeMo also its whole MoE block (gate, shared expert)."""
    block, source = build_k3_block(dtype)
    x, _, weights, indices = rank_inputs(rank, case, dtype)
    hidden = torch.randn(1, x.shape[0], 48, generator=torch.Generator().manual_seed(200 + rank)).to(dtype)
    with torch.no_grad():
        reference = block._forward_reference_order(x, indices, weights)
        whole = block(hidden) if source == "nemo" else None
        split = copy.deepcopy(block)
        apply_grouped_experts_parallel(split, ep_group=None, ep_size=world_size, ep_rank=rank)
        out = split._forward_reference_order(x, indices, weights)
        whole_split = split(hidden) if source == "nemo" else None
    equal = torch.equal(out, reference) and (whole is None or torch.equal(whole, whole_split))
    return {"case": case["name"], "rank": rank, "source": source,
            "local_experts": split.experts.gate_and_up_projs.shape[0], "dtype": str(out.dtype), "equal": bool(equal),
            "whole_block_compared": whole is not None,
            "max_abs_diff": (out.float() - reference.float()).abs().max().item()}


if __name__ == "__main__":
    main()
