"""DeepSpeed layouts side by side on one model and one dataset: tokens/s of single, DP=2, TP=2, EP=2.

In:  a tiny random-init Qwen3-MoE target built in code (hidden 128, 4 layers, 8 experts, fp32) and the first
     ``--samples`` bundled demo conversations.
Out: one JSON object on stdout (and ``benchmarks/results/layouts.json``): per layout the tokens/s of the
     capture loop (non-padding tokens over the forward/write loop, from the CLI's summary line), the last
     ``metrics.jsonl`` record, the wall time of the whole launch, and each layout's tokens/s as a ratio to
     the single process, which runs with as many threads as the others have ranks (same cores).

Every layout is the real CLI (``python -m ds_capture run``) started through the test launchers: single is a
plain process, the others ``torchrun --nproc_per_node 2``. ``--repeats`` runs the whole set that many times,
interleaved, and reports medians.

    . .venv/bin/activate
    python benchmarks/layouts.py [--samples 48] [--seq-length 256] [--micro-batch-size 4] [--repeats 1]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
LAYOUTS = {"single": (1, 1, 1), "dp2": (2, 1, 1), "tp2": (2, 2, 1), "ep2": (2, 1, 2)}  # world, tp, ep
SUMMARY = re.compile(r"([\d,]+) tokens at ([\d,]+) tokens/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=48)
    parser.add_argument("--seq-length", type=int, default=256)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    sys.path[:0] = [str(REPO), str(REPO / "tests" / "distributed")]
    from launchers import ensure_shm_op_built, run_launcher

    from ds_capture.demo import build_tiny_target

    ensure_shm_op_built()
    runs: dict[str, list[dict]] = {name: [] for name in LAYOUTS}
    with tempfile.TemporaryDirectory(prefix="ds_capture_layouts_") as tmp:
        root = Path(tmp)
        target = build_tiny_target(root / "target", "qwen3_moe", hidden_size=128, intermediate_size=256,
                                   moe_intermediate_size=128, head_dim=32)
        for repeat in range(args.repeats):
            for name, (world, tp_size, ep_size) in LAYOUTS.items():
                out = root / f"{name}-{repeat}"
                cfg = root / f"{name}-{repeat}.yaml"
                cfg.write_text(yaml.safe_dump({
                    "recipe_args": {"target_model_name_or_path": str(target), "train_data_path": "demo:conversations",
                                    "train_split": f"train[:{args.samples}]", "cache_output_dir": str(out),
                                    "seq_length": args.seq_length, "micro_batch_size": args.micro_batch_size,
                                    "cache_shard_size": 4 * args.micro_batch_size, "cache_dtype": "bf16"},
                    "distributed": {"tp_size": tp_size, "ep_size": ep_size},
                    "dist_env": {"timeout_minutes": 5},
                }))
                # Same cores for every layout: the single process gets one thread per rank of the others.
                env = {"OMP_NUM_THREADS": "2"} if world == 1 else None
                kind = "single" if world == 1 else "torchrun"
                started = time.perf_counter()
                result = run_launcher(kind, world, ["-m", "ds_capture", "run", "-c", str(cfg), "--no-progress"],
                                      env, 600)
                wall = time.perf_counter() - started
                match = SUMMARY.search(result.stdout)
                entry = {"returncode": result.returncode, "wall_s": round(wall, 1)}
                if result.returncode != 0 or match is None:
                    entry["log_tail"] = result.stdout[-2000:]
                else:
                    entry["num_tokens"] = int(match.group(1).replace(",", ""))
                    entry["tokens_per_s"] = int(match.group(2).replace(",", ""))
                    metrics = (out / ".ds_capture" / "metrics.jsonl").read_text().splitlines()
                    entry["metrics_last"] = json.loads(metrics[-1]) if metrics else None
                runs[name].append(entry)
    report = {"model": "qwen3_moe hidden 128, 4 layers, 8 experts (fp32 compute, bf16 cache)",
              "samples": args.samples, "seq_length": args.seq_length, "micro_batch_size": args.micro_batch_size,
              "repeats": args.repeats, "threads": "1 per rank; single: 2", "layouts": {}}
    single = None
    for name, entries in runs.items():
        speeds = [e["tokens_per_s"] for e in entries if "tokens_per_s" in e]
        median = statistics.median(speeds) if speeds else None
        single = median if name == "single" else single
        report["layouts"][name] = {
            "world": LAYOUTS[name][0], "tp_size": LAYOUTS[name][1], "ep_size": LAYOUTS[name][2],
            "median_tokens_per_s": median,
            "ratio_to_single": round(median / single, 3) if median and single else None,
            "median_wall_s": statistics.median(e["wall_s"] for e in entries), "runs": entries,
        }
    print(json.dumps(report, indent=2))
    (REPO / "benchmarks" / "results").mkdir(exist_ok=True)
    (REPO / "benchmarks" / "results" / "layouts.json").write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
