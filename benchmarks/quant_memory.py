"""What ``capture.expert_storage`` buys on a quantized release: per-rank parameter bytes, bytes read, peak memory.

In:  nothing. A DeepSeek-V4-style release checkpoint (FP8 block backbone with e8m0 ``.scale``, FP4 e2m1 routed
     experts with e8m0 1x32 scales; ``tests/unit/quant_release.py``) of a scaled-up tiny target is built under
     /tmp and deleted after; with ``--scheme fp8 --model-type deepseek_v3`` a DeepSeek-V3 / Kimi-K2 style block
     FP8 release instead, with ``--scheme int4 --model-type kimi_k25`` a Kimi-K2.5 INT4 one.
Out: one JSON object on stdout (also ``benchmarks/results/quant_memory.json``): the checkpoint's bytes (and its
     bf16-equivalent), and per layout (``single``, ``ep2``, ``ep4``) x ``expert_storage`` (``dequantized``,
     ``checkpoint``), per rank (medians of ``--repeats`` runs):
       * ``param_mb``: this rank's parameters + buffers (resident experts: their stored bytes);
       * ``bytes_read_mb``: what the loader read (the checkpoint's own bytes of this rank's share);
       * ``load_growth_mb``: peak RSS added by building + loading the model over the baseline after imports and
         process-group setup (VmHWM - VmRSS); ``forward_growth_mb``: the same after one forward of 2 x 64
         tokens (the transient dequantized experts included).
     Compute dtype bf16 (the production setting), experts implementation as transformers picks it (grouped_mm).

    python benchmarks/quant_memory.py [--layers 4] [--experts 32] [--repeats 3] [--out quant_memory.json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _status_kb(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def worker(target_dir: str, ep_size: int, storage: str) -> None:
    import torch

    torch.set_num_threads(1)
    import deepspeed.module_inject.layers  # noqa: F401  (imported before the baseline, as load_memory does)
    import transformers

    from ds_capture.parallel.dist import discover_env, distributed_session
    from ds_capture.parallel.engines import build_model
    from ds_capture.parallel.layout import ParallelLayout, build_layout, new_groups
    from ds_capture.target.families import read_target_info

    target = read_target_info(Path(target_dir))
    target.family.model_class(transformers.AutoConfig.from_pretrained(target.path))
    env = discover_env()
    with distributed_session(env, backend="gloo", timeout_minutes=10):
        if env.world_size == 1:
            plan, groups = ParallelLayout.single(), None
        else:
            plan = build_layout(world_size=env.world_size, rank=env.rank, tp_size=1, ep_size=ep_size,
                              num_experts=target.num_experts, num_attention_heads=target.num_attention_heads,
                              num_key_value_heads=target.num_key_value_heads)
            groups = new_groups(plan)
        from ds_capture.target import loading

        stats_box = {}
        fill = loading.fill_from_checkpoint

        def counting_fill(*args, **kwargs):
            stats_box["stats"] = fill(*args, **kwargs)
            return stats_box["stats"]

        loading.fill_from_checkpoint = counting_fill
        baseline_kb = _status_kb("VmRSS")
        model = build_model("deepspeed", target, plan, groups, dtype=torch.bfloat16, attn_implementation=None,
                            ds_config=None, expert_storage=storage)
        load_peak_kb = _status_kb("VmHWM")
        input_ids = torch.randint(1, target.vocab_size, (2, 64), generator=torch.Generator().manual_seed(env.rank))
        with torch.no_grad():
            model(input_ids=input_ids, use_cache=False)
        forward_peak_kb = _status_kb("VmHWM")
        local = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
        print("MEM " + json.dumps({
            "rank": env.rank, "param_mb": local / 2**20, "bytes_read_mb": stats_box["stats"].bytes_read / 2**20,
            "load_growth_mb": (load_peak_kb - baseline_kb) / 1024, "forward_growth_mb": (forward_peak_kb - baseline_kb) / 1024,
        }), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-type", default="deepseek_v4")
    parser.add_argument("--scheme", default="fp8_fp4")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="quant_memory.json", help="file name under benchmarks/results/")
    args = parser.parse_args()
    sys.path[:0] = [str(REPO), str(REPO / "tests" / "distributed"), str(REPO / "tests" / "unit")]
    import quant_release as qr
    from launchers import run_launcher

    tmp = Path(tempfile.mkdtemp(prefix="ds_capture_quant_memory_", dir="/tmp"))
    try:
        sizes = dict(hidden_size=512, moe_intermediate_size=512, num_hidden_layers=args.layers)
        sizes["num_local_experts" if args.model_type == "mixtral" else "n_routed_experts"] = args.experts
        if args.model_type == "deepseek_v4":
            sizes.update(mlp_layer_types=["hash_moe"] + ["moe"] * (args.layers - 1),
                         layer_types=(["compressed_sparse_attention", "heavily_compressed_attention"] * args.layers)[: args.layers])
        quantized, reference = qr.build_release_pair(tmp, args.model_type, args.scheme, **sizes)
        checkpoint_mb = qr.checkpoint_bytes(quantized) / 2**20
        bf16_mb = qr.checkpoint_bytes(reference) / 2 / 2**20  # the fp32 reference at 2 bytes a value
        report = {"model": f"{args.model_type} ({args.scheme} release layout) hidden 512, {args.layers} layers, "
                  f"{args.experts} routed experts, moe_intermediate 512; compute bf16",
                  "checkpoint_mb": round(checkpoint_mb, 1), "bf16_equivalent_mb": round(bf16_mb, 1),
                  "repeats": args.repeats, "layouts": {}}
        for name, world, ep_size in (("single", 1, 1), ("ep2", 2, 2), ("ep4", 4, 4)):
            for storage in ("dequantized", "checkpoint"):
                runs = []
                for _ in range(args.repeats):
                    result = run_launcher("single" if world == 1 else "torchrun", world,
                                          [__file__, "--worker", str(quantized), str(ep_size), storage], None, 600)
                    ranks = sorted((json.loads(line[4:]) for line in result.stdout.splitlines()
                                    if line.startswith("MEM ")), key=lambda r: r["rank"])
                    if result.returncode != 0 or len(ranks) != world:
                        raise SystemExit(result.stdout[-3000:])
                    runs.append(ranks)
                per_rank = [{key: round(statistics.median(run[rank][key] for run in runs), 1)
                             for key in ("param_mb", "bytes_read_mb", "load_growth_mb", "forward_growth_mb")}
                            for rank in range(world)]
                report["layouts"][f"{name}/{storage}"] = {"world": world, "ep_size": ep_size, "ranks": per_rank}
        print(json.dumps(report, indent=2))
        (REPO / "benchmarks" / "results").mkdir(exist_ok=True)
        (REPO / "benchmarks" / "results" / args.out).write_text(json.dumps(report, indent=2) + "\n")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], int(sys.argv[3]), sys.argv[4])
    else:
        main()
