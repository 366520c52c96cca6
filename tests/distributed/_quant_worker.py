"""One rank of the quantized-layout test: the quantized release and its reference dequantisation, same layout.

    python -m torch.distributed.run --nproc_per_node N tests/distributed/_quant_worker.py CASE_JSON OUT_DIR
In:  ``{"quantized": dir, "reference": dir, "engine": "deepspeed"|"fsdp2", "tp_size": t, "ep_size": e,
     "storages": ["dequantized", "checkpoint"]}`` (the quantized checkpoint is built once per expert storage;
     FSDP2 builds through ``fsdp2_engine``'s own steps to get its load stats).
Out: ``OUT_DIR/rank{r}.json``: per storage, the local parameters / buffers that differ bitwise from the
     reference model's, the hidden states and logits of one batch that differ bitwise, and both models' bytes
     read (total, per param).
Both models are built by the engines' own builders (the ones ``ds-capture run`` uses) on the same ranks.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from ds_capture.parallel.dist import discover_env, distributed_session, repair_cpu_allreduce
from ds_capture.parallel.layout import build_layout, new_groups
from ds_capture.target.families import read_target_info


def _local(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def build(case: dict, path: str, env, storage: str):
    target = read_target_info(Path(path))
    plan = build_layout(world_size=env.world_size, rank=env.rank, tp_size=case["tp_size"], ep_size=case["ep_size"],
                      num_experts=target.num_experts, num_attention_heads=target.num_attention_heads,
                      num_key_value_heads=target.num_key_value_heads)
    groups = new_groups(plan)
    repair_cpu_allreduce(env, tp_group_is_world=plan.tp_size == env.world_size)
    if case["engine"] == "fsdp2":
        from ds_capture.parallel import fsdp2_engine as fsdp2
        from ds_capture.target.loading import build_meta_model

        from ds_capture.parallel.shard_spec import build_shard_spec, member_of

        model = build_meta_model(target, dtype=torch.float32, attn_implementation=None)
        spec = build_shard_spec(model, member_of(plan), sharding="fsdp2", family=target.family)
        fsdp2.apply_fsdp(model, target, fsdp2._mesh(plan.world_size, torch.device("cpu")))
        stats = fsdp2.load_fsdp_shards(model, target, spec, device=torch.device("cpu"))
    else:
        from ds_capture.parallel.deepspeed_engine import build_sharded_model

        model, stats = build_sharded_model(target, plan, groups, dtype=torch.float32, attn_implementation=None,
                                           ds_config=None, expert_storage=storage)
    return model.eval(), stats, target, plan


def _forward(model, input_ids) -> list[torch.Tensor]:
    with torch.no_grad():
        out = model(input_ids=input_ids, output_hidden_states=True, use_cache=False)
    return [*out.hidden_states, out.logits]


def run(env, case: dict) -> dict:
    reference, r_stats, target, plan = build(case, case["reference"], env, "dequantized")
    generator = torch.Generator().manual_seed(1000 + plan.dp_rank)
    input_ids = torch.randint(1, target.vocab_size, (2, 24), generator=generator)
    r_outputs = _forward(reference, input_ids)
    r_state = {**dict(reference.named_parameters()), **dict(reference.named_buffers())}
    results = {"rank": env.rank}
    for storage in case["storages"]:
        quantized, q_stats, _, _ = build(case, case["quantized"], env, storage)
        outputs = _forward(quantized, input_ids)
        q_state = {**dict(quantized.named_parameters()), **dict(quantized.named_buffers())}
        compared = sorted(set(q_state) & set(r_state))
        results[storage] = {
            "num_compared": len(compared),
            "only_reference": sorted(set(r_state) - set(q_state)),
            "tensors_differ": [n for n in compared if not torch.equal(_local(q_state[n]), _local(r_state[n]))],
            "outputs_differ": [i for i, (a, b) in enumerate(zip(outputs, r_outputs)) if not torch.equal(a, b)],
            "num_outputs": len(outputs),
            "bytes_read": {"quantized": q_stats.bytes_read, "reference": r_stats.bytes_read},
            "bytes_by_param": {"quantized": q_stats.bytes_by_param, "reference": r_stats.bytes_by_param},
        }
        del quantized
    return results


def main() -> None:
    torch.set_num_threads(1)
    case, out_dir = json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])
    env = discover_env()
    with distributed_session(env, backend="gloo", timeout_minutes=3):
        result = run(env, case)
    (out_dir / f"rank{env.rank}.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
