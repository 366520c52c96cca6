"""Where the limit is: the figures that say how close a capture runs to its physical floor (issue 16.4).

In: the issue-16 workload (``write_path_workload.py``). Out: one JSON object with, side by side over
interleaved repeats (medians):

- ``computed_over_real_tokens``: positions the forwards compute / real tokens (the padding compute left
  by trimmed, length-sorted micro-batches; 1.0 is the floor, NeMo's fixed padding is S / mean length);
- ``bytes_written_over_real_bytes``: bytes the writer wrote / the bytes that carry information (states at
  real positions, the token-id and loss-mask rows, which are dense by contract, and the headers); and
  ``logical_over_real_bytes``, what a dense writer would write;
- ``writer_busy_fraction``: the writer thread's busy time / the capture loop's time (below 1: writes
  never stall the forward);
- ``capture_loop_over_bare_forward``: ``run_capture``'s forward/write loop vs a bare forward of the same
  model object (the one ``run_capture`` built, run again right after it, warm) over the same micro-batches
  (no hooks, no copies, no writes): the capture's own overhead. The loop's first forward is cold.

    python benchmarks/physical_limits.py [--repeats 3] [--root /tmp/ds_capture_limits]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from pathlib import Path

import torch
from write_path_workload import MICRO_BATCH_SIZE, SEQ_LENGTH, build_workload


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--root", type=Path, default=Path("/tmp/ds_capture_limits"))
    args = parser.parse_args()

    import ds_capture.runner as runner
    from ds_capture.cache.common.names import DTYPES
    from ds_capture.recipe.config import load_config
    from ds_capture.runner import run_capture

    work = build_workload(args.root)
    cfg = load_config(work.recipe(args.root / "out"))
    batches = _batches(cfg, work)
    # The bare forward runs on the very model run_capture built (same build path, same memory), warm.
    models = []
    build = runner._build_model
    runner._build_model = lambda *a, **k: models.append(build(*a, **k)) or models[-1]
    bare, loops, summaries = [], [], []
    for _ in range(args.repeats):
        shutil.rmtree(args.root / "out", ignore_errors=True)
        summary = run_capture(cfg, show_progress=False)
        loops.append(summary.capture_seconds)
        summaries.append(summary)
        bare.append(_bare_forward(models.pop(), batches))
    summary = summaries[-1]
    real_tokens = int(sum(int(b.num_tokens.sum()) for b in batches))
    computed = sum(b.length * len(b.rows) for b in batches)
    manifest_features = summary_features(cfg, work)
    itemsize = DTYPES[cfg.recipe_args.cache_dtype].itemsize
    rows = len(work.data.read_text().splitlines())
    real_bytes = _state_and_int_bytes(real_tokens, manifest_features, itemsize, rows) + _header_bytes(args.root / "out")
    loop, forward = statistics.median(loops), statistics.median(bare)
    print(json.dumps({
        "benchmark": "physical_limits",
        **work.describe(),
        "real_tokens": real_tokens,
        "computed_positions": computed,
        "computed_over_real_tokens": round(computed / real_tokens, 3),
        "fixed_padding_over_real_tokens": round(rows * SEQ_LENGTH / real_tokens, 3),
        "bytes_written": summary.bytes_written,
        "real_bytes": real_bytes,
        "logical_bytes": summary.logical_bytes,
        "disk_bytes": summary.disk_bytes,
        "bytes_written_over_real_bytes": round(summary.bytes_written / real_bytes, 4),
        "logical_over_real_bytes": round(summary.logical_bytes / real_bytes, 3),
        "writer_busy_seconds": [round(s.writer_busy_seconds, 3) for s in summaries],
        "writer_busy_fraction": round(statistics.median(s.writer_busy_seconds / s.capture_seconds
                                                        for s in summaries), 3),
        "capture_loop_seconds": [round(v, 3) for v in loops],
        "bare_forward_seconds": [round(v, 3) for v in bare],
        "capture_loop_over_bare_forward": round(loop / forward, 3),
        "real_tokens_per_s": {"capture_loop": round(real_tokens / loop), "bare_forward": round(real_tokens / forward)},
    }, indent=2))


def summary_features(cfg, work) -> int:
    """Features per position over both state tensors: H * (k + 1)."""
    from ds_capture.capture.hooks import resolve_layer_ids
    from ds_capture.target.families import read_target_info

    target = read_target_info(work.target)
    ids = resolve_layer_ids(cfg.recipe_args.target_layer_ids, target.num_hidden_layers,
                            cfg.recipe_args.draft_num_hidden_layers, source="benchmark")
    return target.hidden_size * (len(ids) + 1)


def _state_and_int_bytes(real_tokens: int, features: int, itemsize: int, rows: int) -> int:
    return real_tokens * features * itemsize + 2 * rows * SEQ_LENGTH * 8


def _header_bytes(cache: Path) -> int:
    """The safetensors headers of the shards, computed from the manifest (not from what was written)."""
    from ds_capture.cache.common.shard_file import SafetensorsLayout
    from ds_capture.cache.dspark.reader import read_manifest

    manifest = read_manifest(cache)
    return sum(len(SafetensorsLayout.build(manifest.expected_shard_tensors(i)).header)
               for i in range(manifest.num_shards))


def _batches(cfg, work):
    from transformers import AutoTokenizer

    from ds_capture.data.tokenization import read_conversations, resolve_chat_template, tokenize_conversations
    from ds_capture.capture.micro_batches import plan_micro_batches

    args = cfg.recipe_args
    tokenizer = AutoTokenizer.from_pretrained(str(work.target))
    rows = tokenize_conversations(read_conversations(str(work.data), split=None, shuffle_seed=42), tokenizer,
                                  chat_template=resolve_chat_template(tokenizer, None), seq_length=SEQ_LENGTH,
                                  mask_reasoning_content=False, mask_generation_prompt=False)
    batches = []
    for index, lo in enumerate(range(0, len(rows.input_ids), args.cache_shard_size)):
        hi = lo + args.cache_shard_size
        shard = (rows.input_ids[lo:hi], rows.loss_mask[lo:hi], rows.num_tokens[lo:hi])
        batches += plan_micro_batches(index, shard, MICRO_BATCH_SIZE, SEQ_LENGTH, cfg.capture)
    return batches


def _bare_forward(model, batches) -> float:
    started = time.perf_counter()
    with torch.no_grad():
        for batch in batches:
            inputs = batch.model_inputs()
            model(**inputs, use_cache=False, logits_to_keep=1)
    return time.perf_counter() - started


if __name__ == "__main__":
    main()
