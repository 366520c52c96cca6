"""Soak: N kill-and-resume cycles on the demo target; every resumed cache must equal an uninterrupted one.

Each cycle starts a capture into a fresh directory, SIGKILLs it at a seeded point (inside the process:
k-th forward, half-written shard, shard renamed before its sidecar, before/after the manifest flip;
or from outside once a seeded number of shards is finished), then reruns it to completion and checks:
the rerun wrote exactly the shards that were not finished (its summary), and the cache files
(manifest, target weights, shards) are byte-identical to the reference run. Ranks are forks of this
process (imports paid once), with the environment a launcher gives them when ``--world-size`` > 1.

    python benchmarks/soak.py                      # 12 cycles, 2 ranks (dp=2), ~2 min on 2 shared cores
    python benchmarks/soak.py --cycles 100 --world-size 1 --seed 3

Prints one JSON object: cycles, shards recomputed per cycle, mismatches (must be 0), and per-cycle details.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from tests.distributed import _kill_helpers as kh  # noqa: E402  (the kill switch and on-disk checks)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cycles", type=int, default=12, help="kill-and-resume cycles (default 12)")
    parser.add_argument("--world-size", type=int, default=2, help="ranks per run, data parallel (default 2)")
    parser.add_argument("--samples", type=int, default=32, help="first rows of the demo data (default 32)")
    parser.add_argument("--seq-length", type=int, default=64)
    parser.add_argument("--shard-size", type=int, default=4)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0, help="chooses the kill points")
    parser.add_argument("--timeout-s", type=float, default=180, help="per run (default 180)")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    return parser.parse_args(argv)


def write_recipe(path: Path, args: argparse.Namespace, data: Path, out: Path) -> Path:
    import yaml

    path.write_text(yaml.safe_dump({"engine": "deepspeed", "recipe_args": dict(
        target_model_name_or_path="demo:qwen3_moe_tiny", train_data_path=str(data), cache_output_dir=str(out),
        seq_length=args.seq_length, micro_batch_size=args.micro_batch_size, cache_shard_size=args.shard_size,
        cache_dtype="fp32", mask_generation_prompt=False, mask_reasoning_content=False),
        "dist_env": {"timeout_minutes": 2}}))
    return path


KINDS = ("forward", "save", "sidecar", "outside", "flip", "after_flip")


def pick_kill(cycle: int, rng: random.Random, num_shards: int, world_size: int, micro_batches_per_rank: int) -> str:
    """A seeded kill: ``point:k:ranks`` (inside) or ``outside:shards>=n``; the kinds take turns."""
    shards_per_rank = -(-num_shards // world_size)
    ranks = rng.choice(["all"] + [str(r) for r in range(world_size)]) if world_size > 1 else "all"
    point = KINDS[cycle % len(KINDS)]
    if point == "forward":
        return f"forward:{rng.randint(1, micro_batches_per_rank)}:{ranks}"
    if point in ("save", "sidecar"):
        return f"{point}:{rng.randint(1, shards_per_rank)}:{ranks}"
    if point in ("flip", "after_flip"):
        return f"{point}:1:0"
    return f"outside:shards>={rng.randint(1, num_shards - 1)}"


def run_cycle(index: int, kill: str, cfg: Path, out: Path, work: Path, args, reference: dict, num_shards: int) -> dict:
    started = time.monotonic()
    log = work / f"cycle{index}.log"
    if kill.startswith("outside:"):
        needed = int(kill.split(">=")[1])
        killed = kh.run_forked_ranks(args.world_size, cfg, log_path=log, timeout_s=args.timeout_s,
                                     kill_when_cond=lambda: out.is_dir() and len(kh.finished_shards(out)) >= needed)
    else:
        killed = kh.run_forked_ranks(args.world_size, cfg, kill=kill, log_path=log, timeout_s=args.timeout_s)
    done_before = kh.finished_shards(out) if out.is_dir() else set()
    inodes = {name: ino for name, ino in (kh.shard_inodes(out) if out.is_dir() else {}).items()
              if int(name[6:12]) in done_before}
    rerun = kh.run_forked_ranks(args.world_size, cfg, log_path=work / f"cycle{index}.rerun.log",
                                timeout_s=args.timeout_s)
    summary = rerun["summary"] or {}
    kept_inodes = {name: ino for name, ino in kh.shard_inodes(out).items() if name in inodes}
    problems = []
    if 9 not in killed["signals"]:
        problems.append("the kill point was never reached")
    if killed["timed_out"]:
        problems.append("a surviving rank hung after the kill")
    if any(code != 0 for code in rerun["codes"]):
        problems.append(f"rerun failed: exit codes {rerun['codes']}")
    if (summary.get("shards_written"), summary.get("shards_skipped")) != (num_shards - len(done_before),
                                                                          len(done_before)):
        problems.append(f"rerun wrote {summary.get('shards_written')} / kept {summary.get('shards_skipped')}, "
                        f"expected {num_shards - len(done_before)} / {len(done_before)}")
    if kept_inodes != inodes:
        problems.append("a finished shard was rewritten")
    if kh.cache_digests(out) != reference:
        problems.append("cache differs from the reference")
    shutil.rmtree(out, ignore_errors=True)
    return {"cycle": index, "kill": kill, "killed_signals": killed["signals"],
            "finished_before_rerun": len(done_before),
            "recomputed": summary.get("shards_written"), "kept": summary.get("shards_skipped"),
            "identical": not problems, "problems": problems, "seconds": round(time.monotonic() - started, 1)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # stdout carries only the JSON report: libraries' notices (DeepSpeed logs to stdout) go to stderr.
    with contextlib.redirect_stdout(sys.stderr):
        report = soak(args)
    print(json.dumps(report, indent=2))
    return 0 if report.get("mismatches") == 0 else 1


def soak(args: argparse.Namespace) -> dict:
    import torch

    torch.set_num_threads(1)
    import ds_capture.runner  # noqa: F401  (imported before the forks, so each rank starts at once)
    from ds_capture.demo import demo_data_path, ensure_demo_target

    if args.world_size > 1:
        kh.disable_shm_op()  # dp-only ranks never use it; loading it can hang on a stale build lock
    ensure_demo_target()
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="ds_capture_soak_"))
    try:
        data = work / "data.jsonl"
        data.write_text("".join(demo_data_path().read_text().splitlines(keepends=True)[:args.samples]))
        num_samples = len(data.read_text().splitlines())
        num_shards = -(-num_samples // args.shard_size)
        reference_dir = work / "reference"
        ref = kh.run_forked_ranks(args.world_size, write_recipe(work / "reference.yaml", args, data, reference_dir),
                                  log_path=work / "reference.log", timeout_s=args.timeout_s)
        if any(code != 0 for code in ref["codes"]):
            print((work / "reference.log").read_text()[-3000:], file=sys.stderr)
            return {"error": "the reference run failed", "mismatches": None}
        reference = kh.cache_digests(reference_dir)
        out = work / "cache"
        cfg = write_recipe(work / "run.yaml", args, data, out)
        rng = random.Random(args.seed)
        shards_per_rank = -(-num_shards // args.world_size)
        batches_per_rank = shards_per_rank * -(-args.shard_size // args.micro_batch_size)
        cycles = [run_cycle(i, pick_kill(i, rng, num_shards, args.world_size, batches_per_rank), cfg, out, work, args,
                            reference, num_shards) for i in range(args.cycles)]
        report = {
            "cycles": args.cycles,
            "world_size": args.world_size,
            "num_samples": num_samples,
            "num_shards": num_shards,
            "seed": args.seed,
            "shards_recomputed_per_cycle": [c["recomputed"] for c in cycles],
            "mismatches": sum(not c["identical"] for c in cycles),
            "reference_seconds": round(ref["seconds"], 1),
            "seconds": round(time.monotonic() - started, 1),
            "per_cycle": cycles,
        }
        return report
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
