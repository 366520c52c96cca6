"""Length mix: tokens/s of the trimmed + sorted capture loop vs the fixed-padding loop, side by side.

In: the demo target and the first ``--samples`` demo conversations at ``--seq-length`` (512: mean
row length near 30% of it) in shards of ``--shard-size`` 64 rows. Out: one JSON object on stdout:
the length mix, each loop's runs and median tokens/s, and ``ratio`` = trimmed / fixed (goal: >= 2).

Sorting happens within a shard only, so the shard size matters: with 16-row shards and 8-row
batches each shard has just two batches and the positions computed drop only 1.6x (ratio ~1.5);
with 64-row shards 2.5x (the project's default shard is 256 rows).

Both loops are the runner's compute loop (hooks, forward of the CausalLM, collect) over the
runner's own micro-batches (``capture.micro_batches.plan_micro_batches``) with the same model and data; only the
plan differs: default ``CaptureOptions`` (length sorted within each shard, each batch at its longest
row rounded up to 64) vs ``pad_to_multiple_of: 0, sort_by_length: false`` (every batch at S). No
writes: this isolates the compute saved by trimming. Tokens are the non-padding tokens (same count).

    . .venv/bin/activate && python benchmarks/length_mix.py [--samples 128] [--repeats 3] [--threads 1]
"""

from __future__ import annotations

import json

from common import FIXED, TRIMMED, base_parser, capture_loop, interleaved, median, summary, workload


def main() -> None:
    args = base_parser(__doc__, shard_size=64).parse_args()
    work = workload(args)
    model = work.model()
    plans = {"trimmed_sorted": work.plan(TRIMMED), "fixed_padding": work.plan(FIXED)}
    capture_loop(model, work, plans["trimmed_sorted"][:2])  # warm-up
    seconds = interleaved({name: (lambda _r, plan=plan: capture_loop(model, work, plan))
                           for name, plan in plans.items()}, args.repeats)
    lengths = work.rows.num_tokens.float()
    computed = {name: sum(b.length * len(b.rows) for b in plan) for name, plan in plans.items()}
    ratio = median(seconds["fixed_padding"]) / median(seconds["trimmed_sorted"])
    print(json.dumps({
        "benchmark": "length_mix",
        **work.describe(),
        "mean_length_fraction": round(float(lengths.mean()) / work.seq_length, 3),
        "positions_computed": computed,
        "trimmed_sorted": summary(seconds["trimmed_sorted"], work.num_tokens),
        "fixed_padding": summary(seconds["fixed_padding"], work.num_tokens),
        "ratio": round(ratio, 3),
        "goal_ratio": 2.0,
        "goal_met": ratio >= 2.0,
    }, indent=2))


if __name__ == "__main__":
    main()
