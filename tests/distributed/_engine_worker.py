"""One rank of the engine-equivalence test: sharded DeepSpeed model vs single-process Hugging Face forward.

Run under a launcher (torchrun), one process per rank:
    python -m torch.distributed.run --nproc_per_node 2 tests/distributed/_engine_worker.py CASES_JSON OUT_DIR
In:  a JSON list of cases ``{"target": dir, "dtype": "fp32"|"bf16", "tp_size": t, "ep_size": e}``.
Out: ``OUT_DIR/rank{r}.json``: per case, the max |diff| of every hidden state (embedding output, each decoder
     layer, post-norm last) and of the logits, whether every router's top-k set matched for every token,
     and the bytes this rank read from the checkpoint (total and per parameter).
Each rank feeds the batch of its DP rank (TP peers share it; DP / EP peers differ).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from ds_capture.parallel.deepspeed_engine import build_sharded_model
from ds_capture.parallel.dist import discover_env, distributed_session, repair_cpu_allreduce
from ds_capture.parallel.layout import build_layout, new_groups
from ds_capture.parallel.single import load_with_from_pretrained
from ds_capture.target.families import read_target_info
from ds_capture.target.family import get_submodule

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def batch_for(dp_rank: int, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two rows of 24 tokens, the second right-padded after 17: different for every DP rank."""
    generator = torch.Generator().manual_seed(1000 + dp_rank)
    input_ids = torch.randint(1, vocab_size, (2, 24), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 17:] = 0
    input_ids[1, 17:] = 0
    return input_ids, attention_mask


def forward_with_routes(model, family, input_ids, attention_mask):
    """Hidden states (output_hidden_states + the post-norm output), logits, and each router's top-k indices."""
    routes, handles = [], []
    for layer in get_submodule(model, family.layers):
        block = getattr(layer, family.moe_block, None) if family.moe_block else None
        router = getattr(block, family.router, None) if block is not None else None
        if router is not None:
            handles.append(router.register_forward_hook(lambda _m, _i, out: routes.append(out[2].sort(-1).values)))
    final = []
    handles.append(get_submodule(model, family.final_norm).register_forward_hook(lambda _m, _i, out: final.append(out)))
    try:
        with torch.no_grad():  # not inference_mode: gloo collectives fail there
            out = model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True)
    finally:
        for handle in handles:
            handle.remove()
    return [*out.hidden_states[:-1], final[0]], out.logits, routes


def _first_moe_layer(model, family) -> int:
    layers = get_submodule(model, family.layers)
    return next(i for i, layer in enumerate(layers) if hasattr(getattr(layer, family.moe_block), family.router))


def run_case(env, case: dict) -> dict:
    target = read_target_info(Path(case["target"]))
    dtype = DTYPES[case["dtype"]]
    plan = build_layout(world_size=env.world_size, rank=env.rank, tp_size=case["tp_size"], ep_size=case["ep_size"],
                      num_experts=target.num_experts, num_attention_heads=target.num_attention_heads,
                      num_key_value_heads=target.num_key_value_heads)
    groups = new_groups(plan)
    # The shm all-reduce ignores the group: with several TP groups on one host it would sum across them.
    repair_cpu_allreduce(env, tp_group_is_world=plan.tp_size == env.world_size)
    model, stats = build_sharded_model(target, plan, groups, dtype=dtype, attn_implementation=None, ds_config=None)
    reference = load_with_from_pretrained(target, dtype=dtype, attn_implementation=None)

    input_ids, attention_mask = batch_for(plan.dp_rank, target.vocab_size)
    hidden, logits, routes = forward_with_routes(model, target.family, input_ids, attention_mask)
    ref_hidden, ref_logits, ref_routes = forward_with_routes(reference, target.family, input_ids, attention_mask)
    real = attention_mask.bool()
    return {
        **case,
        "rank": env.rank,
        "dp_rank": plan.dp_rank,
        "input_ids_sum": int(input_ids.sum()),
        "hidden_max_diff": [(a.float() - b.float())[real].abs().max().item() for a, b in zip(hidden, ref_hidden)],
        "hidden_max_abs": [b.float()[real].abs().max().item() for b in ref_hidden],
        "logits_max_diff": (logits.float() - ref_logits.float())[real].abs().max().item(),
        "num_routers": len(ref_routes),
        "first_moe_layer": _first_moe_layer(reference, target.family),
        "routes_equal": len(routes) == len(ref_routes) and all(torch.equal(a, b) for a, b in zip(routes, ref_routes)),
        # Per router: real tokens whose selected-expert set differs from the reference.
        "routes_mismatched": [int((a != b).any(-1)[real.reshape(-1)].sum()) for a, b in zip(routes, ref_routes)],
        "num_real_tokens": int(real.sum()),
        "bytes_read": stats.bytes_read,
        "bytes_by_param": stats.bytes_by_param,
    }


def main() -> None:
    torch.set_num_threads(1)
    cases, out_dir = json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])
    env = discover_env()
    with distributed_session(env, backend="gloo", timeout_minutes=2):
        results = [run_case(env, case) for case in cases]
    (out_dir / f"rank{env.rank}.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
