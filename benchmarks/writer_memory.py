"""Writer host memory against the shard size: a whole shard assembled in RAM (before) vs rows written in
place as their micro-batch completes (after), issue 13.4.

In: the issue-16 target (Qwen3-MoE hidden 256, 3 captured layers: 2 KiB of bf16 states per position), short
chat rows (so the forwards are cheap) at seq 4096, i.e. 8 MiB of states per row, and shards of
``--shard-rows`` rows each (default 64, 128, 256, 384: 0.5 to 3 GiB). Every capture runs the same 384 rows
(the largest shard size), so only the shard size changes between them (the rank's tokenised rows, which the
runner holds whatever the writer, stay the same), each as its own ``ds-capture run`` process, from this
checkout ("after") and from ``--before`` (a checkout of the earlier writer, e.g.
``git worktree add /tmp/writer_before a7c1052``). Out: one JSON object: per tree and shard size the process's
peak RSS, and the growth over the smallest shard, against one micro-batch of
states at full length (the goal: growth <= 2 micro-batches + a fixed amount, whatever the shard size).

    python benchmarks/writer_memory.py [--before /tmp/writer_before] [--shard-rows 64 128 256 384]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import yaml
from write_path_workload import build_workload

CHECKOUT = Path(__file__).resolve().parents[1]
SEQ_LENGTH = 4096
MICRO_BATCH_SIZE = 4
PROBE = ("import resource, sys\nfrom ds_capture.cli import main\n"
         "rc = main(['run', '-c', sys.argv[1], '--no-progress'])\n"
         "print('PEAK_RSS_KB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)\nsys.exit(rc)\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", type=Path, default=Path("/tmp/writer_before"))
    parser.add_argument("--shard-rows", type=int, nargs="+", default=[64, 128, 256, 384])
    parser.add_argument("--root", type=Path, default=Path("/tmp/ds_capture_writer_memory"))
    args = parser.parse_args()
    work = build_workload(args.root)
    data = _short_rows(args.root, max(args.shard_rows))
    trees = {"after": CHECKOUT}
    if (args.before / "ds_capture").is_dir():
        trees["before"] = args.before
    per_row = SEQ_LENGTH * 256 * 4 * 2  # [S, H*k] + [S, H] bf16
    results: dict[str, list[dict]] = {}
    for name, tree in trees.items():
        results[name] = []
        for rows in args.shard_rows:
            out = args.root / f"out_{name}_{rows}"
            shutil.rmtree(out, ignore_errors=True)
            recipe = args.root / f"recipe_{rows}.yaml"
            recipe.write_text(yaml.safe_dump({"recipe_args": dict(
                target_model_name_or_path=str(work.target), train_data_path=str(data),
                train_split=f"train[:{max(args.shard_rows)}]",
                cache_output_dir=str(out), seq_length=SEQ_LENGTH, micro_batch_size=MICRO_BATCH_SIZE,
                cache_shard_size=rows, cache_dtype="bf16")}))
            env = dict(os.environ, PYTHONPATH=str(tree), TORCH_EXTENSIONS_DIR=os.environ.get(
                "TORCH_EXTENSIONS_DIR", "/work/main/.venv/torch_extensions"))
            done = subprocess.run([sys.executable, "-c", PROBE, str(recipe)], env=env, capture_output=True, text=True)
            if done.returncode:
                raise SystemExit(f"{name} {rows} rows failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
            peak = int(done.stdout.split("PEAK_RSS_KB")[1].split()[0]) * 1024
            shard = out / "shard-000000.safetensors"
            results[name].append({"shard_rows": rows, "shard_bytes": shard.stat().st_size,
                                  "shard_disk_bytes": shard.stat().st_blocks * 512, "peak_rss_bytes": peak})
            shutil.rmtree(out, ignore_errors=True)
        smallest = results[name][0]["peak_rss_bytes"]
        for entry in results[name]:
            entry["growth_bytes"] = entry["peak_rss_bytes"] - smallest
            entry["growth_over_shard_growth"] = round(
                entry["growth_bytes"] / max(1, entry["shard_bytes"] - results[name][0]["shard_bytes"]), 3)
            entry["growth_in_micro_batches"] = round(entry["growth_bytes"] / (MICRO_BATCH_SIZE * per_row), 2)
    print(json.dumps({
        "benchmark": "writer_memory",
        "seq_length": SEQ_LENGTH, "micro_batch_size": MICRO_BATCH_SIZE, "state_bytes_per_row": per_row,
        "micro_batch_state_bytes": MICRO_BATCH_SIZE * per_row,
        "trees": {name: str(tree) for name, tree in trees.items()},
        "results": results,
        "goal": "growth <= 2 micro-batches of states + a fixed amount, whatever the shard size",
        "goal_met": all(e["growth_in_micro_batches"] <= 2 for e in results["after"]),
    }, indent=2))


def _short_rows(root: Path, count: int) -> Path:
    """``count`` one-turn rows from the demo conversations (tens of tokens each: the forwards stay cheap)."""
    from ds_capture.demo import demo_data_path

    path = root / "short_rows.jsonl"
    lines = demo_data_path().read_text().splitlines()
    rows = []
    for i in range(count):
        messages = [m for m in json.loads(lines[i % len(lines)])["messages"] if m["role"] in ("user", "assistant")][:2]
        rows.append(json.dumps({"messages": [{"role": m["role"], "content": m["content"]} for m in messages]}))
    path.write_text("\n".join(rows) + "\n")
    return path


if __name__ == "__main__":
    main()
