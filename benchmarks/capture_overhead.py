"""Capture overhead: tokens/s of a bare forward vs the full capture path, side by side in one run.

In: the demo target (``ds_capture.demo.ensure_demo_target``, built under ``$DS_CAPTURE_HOME`` or
``~/.cache/ds_capture`` on first use) and the first ``--samples`` bundled demo conversations (all 300 by default).
Out: one JSON object on stdout: for each path the median of ``--repeats`` runs (and every run),
and ``ratio`` = capture tokens/s / bare tokens/s (goal: >= 0.9).

- ``bare``: ``model.model(**batch.model_inputs())`` over the same micro-batches the runner
  forwards (``capture.micro_batches.plan_micro_batches``: rows sorted by length within a shard, each batch cut to
  its longest row rounded up), no hooks, no casts, no writes, model already loaded.
- ``capture``: ``run_capture`` into a fresh directory; its capture loop (forwards with hooks, casts,
  asynchronous shard writes with fsync and checksums, until the last shard is on disk) is what the
  ratio compares. The whole call (adding tokenisation, model load, target weights, manifests) is
  reported as ``end_to_end_seconds``.

Tokens are the non-padding tokens of the rows (the same count for both). Run it with:

    . .venv/bin/activate
    DS_CAPTURE_HOME=/tmp/ds_capture_home python benchmarks/capture_overhead.py \\
        [--samples 300] [--seq-length 512] [--micro-batch-size 8] [--repeats 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

# Runs from a checkout without `pip install -e .`: the repository root holds the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # All 300 demo rows (5 shards): the last shard's write cannot overlap any forward, so a 1-2 shard run
    # measures that tail more than the loop.
    parser.add_argument("--samples", type=int, default=300)
    parser.add_argument("--seq-length", type=int, default=512)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--shard-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoTokenizer

    from ds_capture.data.tokenization import read_conversations, resolve_chat_template, tokenize_conversations
    from ds_capture.demo import demo_data_path, ensure_demo_target
    from ds_capture.parallel.single import build_single_model
    from ds_capture.recipe.config import load_config
    from ds_capture.capture.micro_batches import plan_micro_batches
    from ds_capture.runner import run_capture
    from ds_capture.target.families import read_target_info

    target_dir = ensure_demo_target()
    split = f"train[:{args.samples}]"

    def write_recipe(work: Path, repeat: int) -> Path:
        recipe = work / f"recipe{repeat}.yaml"
        recipe.write_text(yaml.safe_dump({"capture": {"cpu_threads": args.threads}, "recipe_args": dict(
            target_model_name_or_path=str(target_dir), train_data_path=str(demo_data_path()), train_split=split,
            cache_output_dir=str(work / f"cache{repeat}"), seq_length=args.seq_length,
            micro_batch_size=args.micro_batch_size, cache_shard_size=args.shard_size, cache_dtype="fp32",
        )}))
        return recipe

    target = read_target_info(target_dir)

    # The rows exactly as the runner tokenises them (default template, no extra masking).
    tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
    template = resolve_chat_template(tokenizer, None)
    conversations = read_conversations(str(demo_data_path()), split=split, shuffle_seed=42)
    rows = tokenize_conversations(conversations, tokenizer, chat_template=template, seq_length=args.seq_length,
                                  mask_reasoning_content=False, mask_generation_prompt=False)
    num_tokens = int(rows.num_tokens.sum())
    # The same micro-batches the runner forwards (its length sorting and padding to a multiple).
    with tempfile.TemporaryDirectory(prefix="capture_overhead-cfg-") as cfg_dir:
        options = load_config(write_recipe(Path(cfg_dir), -1)).capture
    batches = []
    for lo in range(0, len(rows.input_ids), args.shard_size):
        shard_rows = tuple(t[lo:lo + args.shard_size] for t in (rows.input_ids, rows.loss_mask, rows.num_tokens))
        planned = plan_micro_batches(lo // args.shard_size, shard_rows, args.micro_batch_size, args.seq_length,
                                     options)
        batches += [batch.model_inputs() for batch in planned]

    model = build_single_model(target, dtype=torch.float32, attn_implementation=None)

    def bare() -> float:
        started = time.perf_counter()
        with torch.no_grad():
            for inputs in batches:
                model.model(**inputs, use_cache=False)
        return time.perf_counter() - started

    end_to_end_s = []

    def capture(work: Path, repeat: int) -> float:
        recipe = write_recipe(work, repeat)
        cfg = load_config(recipe)
        started = time.perf_counter()
        summary = run_capture(cfg, show_progress=False)
        end_to_end_s.append(time.perf_counter() - started)
        assert summary.num_tokens == num_tokens, (summary.num_tokens, num_tokens)
        return summary.capture_seconds

    bare()  # warm-up: first-call allocations and kernel selection
    with tempfile.TemporaryDirectory(prefix="capture_overhead-") as tmp:
        bare_s, capture_s = [], []
        # Interleaved, so drift in the machine's load hits both paths alike.
        for repeat in range(args.repeats):
            bare_s.append(bare())
            capture_s.append(capture(Path(tmp), repeat))

    bare_tps = num_tokens / statistics.median(bare_s)
    capture_tps = num_tokens / statistics.median(capture_s)
    print(json.dumps({
        "target": str(target_dir),
        "model_type": target.model_type,
        "samples": len(rows.input_ids),
        "seq_length": args.seq_length,
        "micro_batch_size": args.micro_batch_size,
        "dtype": "fp32",
        "threads": args.threads,
        "tokens": num_tokens,
        "repeats": args.repeats,
        "bare_forward": {"seconds": [round(s, 3) for s in bare_s], "median_tokens_per_s": round(bare_tps, 1)},
        "capture": {"seconds": [round(s, 3) for s in capture_s], "median_tokens_per_s": round(capture_tps, 1)},
        "end_to_end_seconds": [round(s, 3) for s in end_to_end_s],
        "ratio": round(capture_tps / bare_tps, 3),
        "goal_ratio": 0.9,
    }, indent=2))


if __name__ == "__main__":
    main()
