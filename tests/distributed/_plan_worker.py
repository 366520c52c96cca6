"""One rank of the plan-vs-engine test: the tensors the real engine holds on this rank, for ds-capture plan to match.

Run under a launcher, one process per rank:
    python -m torch.distributed.run --nproc_per_node 2 tests/distributed/_plan_worker.py CASES_JSON OUT_DIR
In:  a JSON list of cases ``{"target": dir, "engine": "deepspeed"|"fsdp2"|"zero3", "tp_size": t, "ep_size": e}``
     (and optionally ``"expert_storage"``; ``zero3``: ``engine: deepspeed`` with ``zero_optimization.stage`` 3),
     each built through the engines' one entry point (:func:`~ds_capture.parallel.engines.build_model`).
Out: ``OUT_DIR/rank{r}.json``: per case, every parameter and buffer of the loaded model on this rank as
     ``name -> [local numel, element size]`` (an FSDP2 DTensor counts its local shard, a ZeRO-3 parameter its
     partition), the elements ZeRO-3 parameters still hold whole after loading (``whole_numel``: 0 when every one
     is partitioned and released), and the stored bytes of every packed GroupedExperts stack
     (``capture.expert_storage: checkpoint``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from ds_capture.parallel.dist import discover_env, distributed_session, repair_cpu_allreduce
from ds_capture.parallel.engines import build_model
from ds_capture.parallel.layout import new_groups
from ds_capture.parallel.resolve import layout_of
from ds_capture.target.families import read_target_info


def local_tensors(model: torch.nn.Module) -> dict[str, list[int]]:
    from torch.distributed.tensor import DTensor

    out = {}
    for name, tensor in (*model.named_parameters(), *model.named_buffers()):
        local = tensor.to_local() if isinstance(tensor, DTensor) else getattr(tensor, "ds_tensor", tensor)
        out[name] = [local.numel(), local.element_size()]
    return out


def main(cases_path: str, out_dir: str) -> None:
    cases = json.loads(Path(cases_path).read_text())
    env = discover_env()
    results = []
    with distributed_session(env, backend="gloo", timeout_minutes=5):
        for case in cases:
            target = read_target_info(Path(case["target"]))
            zero3 = case["engine"] == "zero3"
            engine, storage = "deepspeed" if zero3 else case["engine"], case.get("expert_storage", "dequantized")
            plan = layout_of(target, engine=engine, zero_stage=3 if zero3 else 0, world_size=env.world_size,
                             rank=env.rank, tp_size=case["tp_size"], ep_size=case["ep_size"], expert_storage=storage)
            repair_cpu_allreduce(env, tp_group_is_world=plan.tp_size == plan.world_size)
            groups = new_groups(plan)
            model = build_model(engine, target, plan, groups, dtype=torch.float32, attn_implementation=None,
                                ds_config={"zero_optimization": {"stage": 3}} if zero3 else None,
                                expert_storage=storage)
            from ds_capture.parallel.packed_grouped_experts import packed_stacks

            packed = {name: stack.packed_bytes() for name, stack in packed_stacks(model).items()}
            whole = sum(p.data.numel() for p in model.parameters() if hasattr(p, "ds_id"))
            results.append({**case, "rank": env.rank, "tp_rank": plan.tp_rank, "tensors": local_tensors(model),
                            "packed_bytes": packed, "whole_numel": whole})
    Path(out_dir, f"rank{env.rank}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
