"""Peak memory per rank while loading a sharded MoE target, against its checkpoint size and one process.

In:  nothing (a random-init Qwen3-MoE checkpoint of ~0.6 GB fp32 is built under /tmp and deleted after).
Out: one JSON object on stdout (also benchmarks/results/load_memory.json): the checkpoint bytes; for
     ``from_pretrained`` (plain Hugging Face, ``ds_capture.parallel.single.load_with_from_pretrained``), ``single``
     (the world-of-one engine: meta build + the sliced loader, ``build_single_model``) and each
     sharded layout (DeepSpeed engine, ``build_sharded_model`` in a torchrun worker), per rank:
       * ``code_import_mb``: RSS that importing the model's code adds (the transformers modeling module pulls
         ``torch._dynamo``; DeepSpeed's inference and AutoTP modules): ~110 MB, the same for any checkpoint;
       * ``growth_mb``: what loading adds over the baseline taken after those imports and the process-group
         setup (peak ``VmHWM`` minus that ``VmRSS``): the figure the goal is judged on, as ``growth_fraction``
         of the checkpoint; ``growth_with_imports_fraction`` counts the imports too;
       * ``peak_rss_mb`` (absolute ``VmHWM``, torch itself included), ``param_mb`` (this rank's parameters)
         and the bytes the loader read.
     Goal: at most 0.6 of the checkpoint where the routed experts (the bulk of an MoE checkpoint) are split
     2 ways, at most 0.35 where they are split 4 ways. Note ``tp2_ep2`` on 4 ranks: EP groups are consecutive
     ranks, so its EP group is its TP group and each tensor is split 2 ways (2 replicas); the 4-way TP x EP
     layout is ``tp2_ep4`` (attention over 2 ranks, experts over all 4).

    . .venv/bin/activate
    python benchmarks/load_memory.py [--layers 4] [--experts 48] [--keep] [--out load_memory.json]
    python benchmarks/load_memory.py --layers 16 --experts 12 --out load_memory_16layers.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _status_kb(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def worker(target_dir: str, tp_size: int, ep_size: int, hf: bool = False) -> None:
    """One rank: imports, process group, plan and groups (the baseline), then build_sharded_model."""
    import torch

    torch.set_num_threads(1)
    from ds_capture.parallel.deepspeed_engine import build_sharded_model
    from ds_capture.parallel.dist import discover_env, distributed_session, repair_cpu_allreduce
    from ds_capture.parallel.layout import ParallelLayout, build_layout, new_groups
    from ds_capture.parallel.single import build_single_model, load_with_from_pretrained
    from ds_capture.target.families import read_target_info

    target = read_target_info(Path(target_dir))
    start_kb = _status_kb("VmRSS")  # torch and ds_capture's own modules imported
    _import_model_code(target)
    code_import_kb = _status_kb("VmRSS") - start_kb
    env = discover_env()
    with distributed_session(env, backend="gloo", timeout_minutes=10):
        if env.world_size == 1:
            plan, groups = ParallelLayout.single(), None
        else:
            plan = build_layout(world_size=env.world_size, rank=env.rank, tp_size=tp_size, ep_size=ep_size,
                              num_experts=target.num_experts, num_attention_heads=target.num_attention_heads,
                              num_key_value_heads=target.num_key_value_heads)
            repair_cpu_allreduce(env, tp_group_is_world=plan.tp_size == plan.world_size)
            groups = new_groups(plan)
        baseline_kb, baseline_hwm_kb = _status_kb("VmRSS"), _status_kb("VmHWM")
        bytes_read = None
        if env.world_size == 1:
            build = load_with_from_pretrained if hf else build_single_model
            model = build(target, dtype=torch.float32, attn_implementation=None)
        else:
            model, stats = build_sharded_model(target, plan, groups, dtype=torch.float32, attn_implementation=None,
                                               ds_config=None)
            bytes_read = getattr(stats, "bytes_read", None)
        peak_kb = _status_kb("VmHWM")
        # After loading: what stays (anonymous = the parameters and allocator slack; file = mapped checkpoint pages).
        anon_kb, file_kb = _status_kb("RssAnon"), _status_kb("RssFile")
        local_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        print("MEM " + json.dumps({
            "rank": env.rank, "code_import_mb": code_import_kb / 1024, "peak_rss_mb": peak_kb / 1024, "baseline_rss_mb": baseline_kb / 1024,
            "baseline_peak_mb": baseline_hwm_kb / 1024, "growth_mb": (peak_kb - baseline_kb) / 1024,
            "param_mb": local_bytes / 2**20, "after_rss_anon_mb": anon_kb / 1024, "after_rss_file_mb": file_kb / 1024, "bytes_read_mb": None if bytes_read is None else bytes_read / 2**20,
        }), flush=True)


def _import_model_code(target) -> None:
    """Import what building the model imports (its modeling module, DeepSpeed inference / AutoTP)."""
    import deepspeed.inference.engine  # noqa: F401
    import deepspeed.module_inject.layers  # noqa: F401
    import transformers

    target.family.model_class(transformers.AutoConfig.from_pretrained(target.path))  # the loader's own lookup


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=48)
    parser.add_argument("--keep", action="store_true", help="keep the checkpoint under /tmp")
    parser.add_argument("--out", default="load_memory.json", help="file name under benchmarks/results/")
    args = parser.parse_args()
    sys.path[:0] = [str(REPO), str(REPO / "tests" / "distributed")]
    from launchers import run_launcher

    from ds_capture.demo import build_tiny_target

    tmp = Path(tempfile.mkdtemp(prefix="ds_capture_load_memory_", dir="/tmp"))
    try:
        target = build_tiny_target(tmp / "target", "qwen3_moe", hidden_size=512, intermediate_size=1024,
                                   moe_intermediate_size=512, num_attention_heads=8, num_key_value_heads=4,
                                   head_dim=64, num_hidden_layers=args.layers, num_experts=args.experts,
                                   max_shard_size="100MB")
        checkpoint_mb = sum(p.stat().st_size for p in target.glob("*.safetensors")) / 2**20
        # (world, tp, ep). The goal follows how many ways the routed experts are split: tp2_ep2's EP group is
        # its TP group (2 ways, 2 replicas); tp2_ep4 and ep4 split them over all 4 ranks.
        layouts = {"from_pretrained": (1, 1, 1), "single": (1, 1, 1), "ep2": (2, 1, 2), "tp2_ep2": (4, 2, 2), "ep4": (4, 1, 4),
                   "tp2_ep4": (4, 2, 4)}
        goals = {1: None, 2: 0.6, 4: 0.35}
        report = {"checkpoint_mb": round(checkpoint_mb, 1), "model": f"qwen3_moe hidden 512, {args.layers} layers, "
                  f"{args.experts} experts, moe_intermediate 512, fp32",
                  "goal_on": "growth_mb / checkpoint_mb: RSS added by loading, over the baseline after the model's code "
                  "is imported (code_import_mb, reported per rank, is the same for any checkpoint size)",
                  "layouts": {}}
        for name, (world, tp_size, ep_size) in layouts.items():
            kind = "single" if world == 1 else "torchrun"
            result = run_launcher(kind, world, [__file__, "--worker", str(target), str(tp_size), str(ep_size),
                                                str(name == "from_pretrained")], None, 600)
            ranks = sorted((json.loads(line[4:]) for line in result.stdout.splitlines() if line.startswith("MEM ")),
                           key=lambda r: r["rank"])
            entry: dict = {"world": world, "tp_size": tp_size, "ep_size": ep_size, "expert_ways": ep_size,
                           "attention_ways": tp_size, "returncode": result.returncode}
            if result.returncode != 0 or len(ranks) != world:
                entry["log_tail"] = result.stdout[-2000:]
            else:
                for r in ranks:
                    r["growth_fraction"] = round(r["growth_mb"] / checkpoint_mb, 3)
                    r["growth_with_imports_fraction"] = round((r["growth_mb"] + r["code_import_mb"]) / checkpoint_mb, 3)
                    r["peak_fraction"] = round(r["peak_rss_mb"] / checkpoint_mb, 3)
                    for key in ("code_import_mb", "peak_rss_mb", "baseline_rss_mb", "baseline_peak_mb", "growth_mb", "param_mb",
                                "bytes_read_mb", "after_rss_anon_mb", "after_rss_file_mb"):
                        r[key] = None if r[key] is None else round(r[key], 1)
                entry["ranks"] = ranks
                entry["max_growth_fraction"] = max(r["growth_fraction"] for r in ranks)
                entry["max_growth_with_imports_fraction"] = max(r["growth_with_imports_fraction"] for r in ranks)
                if goals[ep_size] is not None:
                    entry["goal"] = goals[ep_size]
                    entry["meets_goal"] = entry["max_growth_fraction"] <= goals[ep_size]
            report["layouts"][name] = entry
        print(json.dumps(report, indent=2))
        (REPO / "benchmarks" / "results").mkdir(exist_ok=True)
        (REPO / "benchmarks" / "results" / args.out).write_text(json.dumps(report, indent=2) + "\n")
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "True")
    else:
        main()
