"""Per-rank weight memory of the big releases for both ``capture.expert_storage`` settings, from counted parameters.

In:  nothing (no weights). Each release's model is built on the meta device from its transformers 5.24 config
     (DeepSeek-V4-Flash: ``DeepseekV4Config()`` defaults; DeepSeek-V3: ``DeepseekV3Config()`` defaults;
     Kimi-K2: the same with 384 experts, 64 heads, 1 dense layer, vocab 163840; GLM-5: ``GlmMoeDsaConfig()``
     defaults) and its parameters counted: routed experts (the fused ``experts`` tensors of every MoE layer) and
     everything else.
Out: JSON on stdout (also ``benchmarks/results/release_arithmetic.json``): per release and layout, GiB per rank
     of weights: ``dequantized`` = every parameter in bf16 (2 B); ``checkpoint`` = routed experts at their stored
     bytes per parameter (block FP8 + fp32 128x128 scales: 1 + 4/16384; FP4 e2m1 + e8m0 1x32: 0.5 + 1/32; INT4 +
     bf16 scales per 32: 0.5 + 2/32), the rest in bf16; plus the transient of the default ``grouped_mm`` experts
     (one layer's local experts dequantized to bf16 during its forward). Dense parameters are divided by
     tp_size when the family has TP (AutoTP shards attention and dense MLPs; norms / routers replicated are
     ignored, < 0.1%), routed experts by ep_size. Activations are not included.

    python benchmarks/release_arithmetic.py
"""

from __future__ import annotations

import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GIB = 2**30
STORED_BYTES = {"fp8": 1 + 4 / (128 * 128), "fp4": 0.5 + 1 / 32, "int4": 0.5 + 2 / 32}

RELEASES = {  # name -> (model_type, config overrides, expert format, layouts (nodes of 8, tp, ep), family has TP)
    "DeepSeek-V4-Flash": ("deepseek_v4", {}, "fp4", [(1, 1, 8), (2, 1, 16)], False),
    "DeepSeek-V3 / V3.1 / R1": ("deepseek_v3", {}, "fp8", [(2, 8, 16), (4, 8, 32)], True),
    "Kimi-K2-Instruct (FP8)": ("deepseek_v3", dict(n_routed_experts=384, num_attention_heads=64,
                                                    first_k_dense_replace=1, vocab_size=163840), "fp8",
                               [(2, 8, 16), (4, 8, 32), (8, 8, 64)], True),
    "Kimi-K2-Thinking / K2.5 (INT4 experts)": ("deepseek_v3", dict(n_routed_experts=384, num_attention_heads=64,
                                                                    first_k_dense_replace=1, vocab_size=163840),
                                               "int4", [(2, 8, 16), (4, 8, 32)], True),
    "GLM-5 (-FP8)": ("glm_moe_dsa", {}, "fp8", [(4, 1, 32), (8, 1, 64)], False),
}


def count(model_type: str, overrides: dict) -> dict:
    import torch
    import transformers

    from ds_capture.parallel.expert_parallel import moe_experts_modules
    from ds_capture.target.families import FAMILIES

    family = FAMILIES[model_type]
    config = transformers.AutoConfig.for_model(model_type, **overrides)
    with torch.device("meta"):
        model = family.model_class(config)._from_config(config, dtype=torch.bfloat16)
    experts = moe_experts_modules(model, family)
    expert_params = sum(p.numel() for _, m in experts for p in m.parameters(recurse=False))
    total = sum(p.numel() for p in model.parameters())
    per_layer = max(sum(p.numel() for p in m.parameters(recurse=False)) for _, m in experts)
    return {"total_params": total, "routed_expert_params": expert_params, "other_params": total - expert_params,
            "moe_layers": len(experts), "experts_per_layer": experts[0][1].num_experts,
            "expert_params_per_layer": per_layer}


def main() -> None:
    report = {}
    for name, (model_type, overrides, fmt, layouts, has_tp) in RELEASES.items():
        counted = count(model_type, overrides)
        rows = []
        for nodes, tp, ep in layouts:
            dense = counted["other_params"] * 2 / (tp if has_tp else 1)
            experts = counted["routed_expert_params"] / ep
            transient = counted["expert_params_per_layer"] / ep * 2
            rows.append({"nodes_of_8": nodes, "tp_size": tp, "ep_size": ep,
                         "dense_gib": round(dense / GIB, 1),
                         "experts_dequantized_gib": round(experts * 2 / GIB, 1),
                         "experts_checkpoint_gib": round(experts * STORED_BYTES[fmt] / GIB, 1),
                         "dequantized_gib": round((dense + experts * 2) / GIB, 1),
                         "checkpoint_gib": round((dense + experts * STORED_BYTES[fmt]) / GIB, 1),
                         "checkpoint_transient_gib": round(transient / GIB, 2)})
        report[name] = {"model_type": model_type, "expert_format": fmt, **counted, "layouts": rows}
    print(json.dumps(report, indent=2))
    (REPO / "benchmarks" / "results").mkdir(exist_ok=True)
    (REPO / "benchmarks" / "results" / "release_arithmetic.json").write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
