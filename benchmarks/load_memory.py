"""Peak memory per rank while loading a sharded MoE target, against its checkpoint size and one process.

In:  nothing (a random-init Qwen3-MoE checkpoint of ~0.6 GB fp32 is built under /tmp and deleted after).
Out: one JSON object on stdout: the checkpoint bytes; for ``single`` (plain ``from_pretrained`` through
     ``ds_capture.engine.single.build_single_model``), ``ep2`` and ``tp2_ep2`` (DeepSpeed engine,
     ``build_sharded_model`` in a torchrun worker) per rank: ``VmHWM`` (absolute peak RSS), the RSS baseline
     after imports and process-group setup, the growth over it, both as fractions of the checkpoint; and the
     bytes the loader read. The goal (at most 0.6 of the checkpoint at 2-way, 0.35 at 4-way) is judged on
     the *growth* (what loading adds to a process), since the baseline (torch + transformers + DeepSpeed
     imported, ~400-500 MB) is the same whatever the model; the absolute peaks are reported next to it.

    . .venv/bin/activate
    python benchmarks/load_memory.py [--layers 4] [--experts 48] [--keep]
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


def worker(target_dir: str, tp_size: int, ep_size: int) -> None:
    """One rank: imports, process group, plan and groups (the baseline), then build_sharded_model."""
    import torch

    torch.set_num_threads(1)
    from ds_capture.dist import discover_env, distributed_session, repair_cpu_allreduce
    from ds_capture.engine.deepspeed_engine import build_sharded_model
    from ds_capture.engine.single import build_single_model
    from ds_capture.families import read_target_info
    from ds_capture.plan import ParallelPlan, build_plan, new_groups

    target = read_target_info(Path(target_dir))
    env = discover_env()
    with distributed_session(env, backend="gloo", timeout_minutes=10):
        if env.world_size == 1:
            plan, groups = ParallelPlan.single(), None
        else:
            plan = build_plan(world_size=env.world_size, rank=env.rank, tp_size=tp_size, ep_size=ep_size,
                              num_experts=target.num_experts, num_attention_heads=target.num_attention_heads,
                              num_key_value_heads=target.num_key_value_heads)
            repair_cpu_allreduce(env, tp_group_is_world=plan.tp_size == plan.world_size)
            groups = new_groups(plan)
        baseline_kb, baseline_hwm_kb = _status_kb("VmRSS"), _status_kb("VmHWM")
        bytes_read = None
        if env.world_size == 1:
            model = build_single_model(target, dtype=torch.float32, attn_implementation=None)
        else:
            model, stats = build_sharded_model(target, plan, groups, dtype=torch.float32, attn_implementation=None,
                                               ds_config=None)
            bytes_read = getattr(stats, "bytes_read", None)
        peak_kb = _status_kb("VmHWM")
        # After loading: what stays (anonymous = the parameters and allocator slack; file = mapped checkpoint pages).
        anon_kb, file_kb = _status_kb("RssAnon"), _status_kb("RssFile")
        local_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        print("MEM " + json.dumps({
            "rank": env.rank, "peak_rss_mb": peak_kb / 1024, "baseline_rss_mb": baseline_kb / 1024,
            "baseline_peak_mb": baseline_hwm_kb / 1024, "growth_mb": (peak_kb - baseline_kb) / 1024,
            "param_mb": local_bytes / 2**20, "after_rss_anon_mb": anon_kb / 1024, "after_rss_file_mb": file_kb / 1024, "bytes_read_mb": None if bytes_read is None else bytes_read / 2**20,
        }), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=48)
    parser.add_argument("--keep", action="store_true", help="keep the checkpoint under /tmp")
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
        # tp2_ep2 is the layout the goal names; ep4 shows the 4-way expert split (AutoTP leaves the fused
        # 3-D experts whole, so with ep 2 every rank of a 4-rank job still holds half the experts).
        layouts = {"single": (1, 1, 1), "ep2": (2, 1, 2), "tp2_ep2": (4, 2, 2), "ep4": (4, 1, 4)}
        goals = {"single": None, "ep2": 0.6, "tp2_ep2": 0.35, "ep4": 0.35}
        report = {"checkpoint_mb": round(checkpoint_mb, 1), "model": f"qwen3_moe hidden 512, {args.layers} layers, "
                  f"{args.experts} experts, moe_intermediate 512, fp32",
                  "goal_on": "growth_mb / checkpoint_mb (RSS added by loading, over the post-import baseline)",
                  "layouts": {}}
        for name, (world, tp_size, ep_size) in layouts.items():
            kind = "single" if world == 1 else "torchrun"
            result = run_launcher(kind, world, [__file__, "--worker", str(target), str(tp_size), str(ep_size)],
                                  None, 600)
            ranks = sorted((json.loads(line[4:]) for line in result.stdout.splitlines() if line.startswith("MEM ")),
                           key=lambda r: r["rank"])
            entry: dict = {"world": world, "tp_size": tp_size, "ep_size": ep_size, "returncode": result.returncode}
            if result.returncode != 0 or len(ranks) != world:
                entry["log_tail"] = result.stdout[-2000:]
            else:
                for r in ranks:
                    r["growth_fraction"] = round(r["growth_mb"] / checkpoint_mb, 3)
                    r["peak_fraction"] = round(r["peak_rss_mb"] / checkpoint_mb, 3)
                    for key in ("peak_rss_mb", "baseline_rss_mb", "baseline_peak_mb", "growth_mb", "param_mb",
                                "bytes_read_mb", "after_rss_anon_mb", "after_rss_file_mb"):
                        r[key] = None if r[key] is None else round(r[key], 1)
                entry["ranks"] = ranks
                entry["max_growth_fraction"] = max(r["growth_fraction"] for r in ranks)
                if goals[name] is not None:
                    entry["goal"] = goals[name]
                    entry["meets_goal"] = entry["max_growth_fraction"] <= goals[name]
            report["layouts"][name] = entry
        print(json.dumps(report, indent=2))
        (REPO / "benchmarks" / "results").mkdir(exist_ok=True)
        (REPO / "benchmarks" / "results" / "load_memory.json").write_text(json.dumps(report, indent=2) + "\n")
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    else:
        main()
