"""One rank of the FSDP2 forward check: FSDP2 model vs the single-process model on this rank's own data.

Run under torchrun (gloo). Every rank builds the target with ``build_fsdp2_model`` and, for reference,
whole with ``load_with_from_pretrained``; forwards ``--steps`` batches of its own random tokens (different per
rank) through both with hooks on every router (``mlp.gate``: its output ends in the top-k expert indices)
and writes ``OUT/rank{R}.json``: max abs difference of every hidden state, the router top-k agreement and
the bytes the loader read.

    torchrun --nproc_per_node 2 tests/distributed/_fsdp2_worker.py TARGET_DIR OUT_DIR --dtype bf16
"""

from __future__ import annotations

import argparse
import json
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

torch.set_num_threads(1)


@contextmanager
def router_topk(model: torch.nn.Module):
    """Collect the top-k expert indices every router returns (``(logits, weights, indices)``)."""
    found: dict[str, list[torch.Tensor]] = {}
    handles = []
    for name, module in model.named_modules():
        if name.endswith("mlp.gate") and not isinstance(module, torch.nn.Linear):
            def hook(_module, _args, output, name=name):
                found.setdefault(name, []).append(output[-1].detach().sort(dim=-1).values.clone())
            handles.append(module.register_forward_hook(hook))
    try:
        yield found
    finally:
        for handle in handles:
            handle.remove()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("target", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=24)
    args = parser.parse_args()
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]

    dist.init_process_group("gloo")
    try:
        from ds_capture.parallel.fsdp2_engine import build_fsdp2_model
        from ds_capture.parallel.layout import build_layout
        from ds_capture.parallel.single import load_with_from_pretrained
        from ds_capture.target.families import read_target_info

        rank, world = dist.get_rank(), dist.get_world_size()
        target = read_target_info(args.target)
        plan = build_layout(world_size=world, rank=rank, tp_size=1, ep_size=1, num_experts=target.num_experts,
                          num_attention_heads=target.num_attention_heads,
                          num_key_value_heads=target.num_key_value_heads)
        sharded = build_fsdp2_model(target, plan, None, dtype=dtype, attn_implementation=None)
        whole = load_with_from_pretrained(target, dtype=dtype, attn_implementation=None)
        local_numel = sum(p.to_local().numel() for p in sharded.parameters())
        whole_numel = sum(p.numel() for p in whole.parameters())

        gen = torch.Generator().manual_seed(1000 + rank)  # different data on every rank
        max_diff, num_tokens, num_same, num_routed = 0.0, 0, 0, 0
        with torch.no_grad(), router_topk(sharded) as got, router_topk(whole) as want:
            for _ in range(args.steps):
                ids = torch.randint(5, target.vocab_size, (args.batch, args.seq), generator=gen)
                mask = torch.ones_like(ids)
                mask[0, args.seq // 2:] = 0  # one padded row, as the runner feeds
                out_a = sharded(input_ids=ids, attention_mask=mask, output_hidden_states=True, use_cache=False)
                out_b = whole(input_ids=ids, attention_mask=mask, output_hidden_states=True, use_cache=False)
                for a, b in zip(out_a.hidden_states, out_b.hidden_states):
                    max_diff = max(max_diff, (a.float() - b.float()).abs().max().item())
                num_tokens += ids.numel()
        for name, indices in want.items():
            for a, b in zip(got[name], indices):
                num_same += int((a == b).all(dim=-1).sum())
                num_routed += a.shape[0]
        result = dict(rank=rank, world=world, max_diff=max_diff, num_tokens=num_tokens, routers=len(want),
                      routed_same=num_same, routed_total=num_routed, local_numel=local_numel,
                      whole_numel=whole_numel)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"rank{rank}.json").write_text(json.dumps(result))
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
