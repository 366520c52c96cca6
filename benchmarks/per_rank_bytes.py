"""Per-rank weight bytes of a full-size target under several parallel layouts, from the layout code itself.

In:  a model type whose transformers config defaults are the release's sizes (default ``glm_moe_dsa``: GLM-5), a
     dtype and ``tp x ep`` layouts. The model is built on ``meta`` (no memory), then the same functions the
     DeepSpeed engine applies shard it for rank 0: :func:`~ds_capture.parallel.expert_parallel.apply_expert_parallel`
     and, for a family with a ``tp_plan``, :func:`~ds_capture.parallel.tensor_parallel.apply_tensor_parallel`
     (a layout needing AutoTP is skipped: AutoTP needs real ranks).
Out: JSON on stdout: per layout, the rank's routed-expert bytes, the rest ("dense") and the total, in GiB.

    python benchmarks/per_rank_bytes.py                      # GLM-5: tp 1 x ep 64, tp 8 x ep 32, tp 1 x ep 32
    python benchmarks/per_rank_bytes.py --layouts 1x64 8x32
"""

from __future__ import annotations

import argparse
import json

import torch
import transformers

from ds_capture.parallel.expert_parallel import apply_expert_parallel, moe_experts_modules
from ds_capture.parallel.tensor_parallel import apply_tensor_parallel
from ds_capture.target.families import FAMILIES


def per_rank_bytes(model_type: str, tp_size: int, ep_size: int, dtype: torch.dtype) -> dict:
    family = FAMILIES[model_type]
    config = transformers.AutoConfig.for_model(model_type)
    with torch.device("meta"):
        model = family.model_class(config)._from_config(config, dtype=dtype)
    model = apply_expert_parallel(model, family, ep_group=None, ep_size=ep_size, ep_rank=0)
    if tp_size > 1:
        model = apply_tensor_parallel(model, family, tp_group=None, tp_size=tp_size, tp_rank=0)
    expert_params = {id(p) for _, experts in moe_experts_modules(model, family) for p in experts.parameters()}
    experts = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) in expert_params)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    gib = 2.0 ** 30
    return {"tp_size": tp_size, "ep_size": ep_size, "experts_gib": round(experts / gib, 1),
            "dense_gib": round((total - experts) / gib, 1), "total_gib": round(total / gib, 1)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-type", default="glm_moe_dsa")
    parser.add_argument("--layouts", nargs="+", default=["1x64", "8x32", "1x32"], help="tp x ep, e.g. 8x32")
    args = parser.parse_args(argv)
    family = FAMILIES[args.model_type]
    results = {}
    for layout in args.layouts:
        tp_size, ep_size = (int(part) for part in layout.split("x"))
        if tp_size > 1 and not family.tp_plan:
            results[layout] = "skipped: TP through AutoTP needs real ranks"
            continue
        results[layout] = per_rank_bytes(args.model_type, tp_size, ep_size, torch.bfloat16)
    print(json.dumps({"model_type": args.model_type, "dtype": "bf16", "rank": 0, "layouts": results}, indent=2))


if __name__ == "__main__":
    main()
