"""EAGLE-3 vs DSpark cache: bytes per sample on disk and the throughput cost of the distribution.

In: the demo target (``ds_capture.demo.ensure_demo_target``: qwen3_moe, hidden 128, 4 layers, vocab 2048)
and the first ``--samples`` demo conversations. Out: one JSON object on stdout, side by side, medians of
``--repeats`` interleaved runs of ``run_capture`` into fresh directories, single process:

- ``dspark``: the DSpark v1 cache (layers [1, 2, 3], the default rule for L=4);
- ``eagle3_full``: the EAGLE-3 v2 cache, aux layers [1, 2, 3], ``--draft-vocab-size`` columns of target_probs;
- ``eagle3_topk``: the same with ``--topk`` (values + int32 indices).

For each: ``bytes_per_sample`` (shard bytes / samples, measured), ``tokens_per_s`` (the capture loop:
forwards, hooks, the distribution, writes), and ``ratio_vs_dspark`` of the throughput. ``components``
times the same micro-batches (the runner's plan) in-process in this thread's CPU time, which a shared
box disturbs less than wall time: the hooked forward alone, and the distribution (full, top-k) on its
final hidden states; ``distribution_over_forward`` is the cost the EAGLE-3 kind adds. ``formula`` gives
the bytes per sample of each layout for a real target (default: Qwen3-8B, H 4096, S 2048, bf16,
draft vocab 32000, top-64), from the shard layouts (DESIGN §3 / EAGLE3_CACHE.md §3).

    DS_CAPTURE_HOME=/tmp/ds_capture_home python benchmarks/eagle3_cost.py [--samples 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import torch

# Runs from a checkout without `pip install -e .`: the repository root holds the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/common.py

_DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


def formula(*, hidden: int, seq_length: int, dtype: str, dspark_layers: int, draft_vocab: int, topk: int) -> dict:
    """Bytes per sample of each shard layout (headers aside)."""
    b = _DTYPE_BYTES[dtype]
    dspark = seq_length * (8 + 8 + hidden * dspark_layers * b + hidden * b)
    common = seq_length * (8 * 3 + 3 * hidden * b + 1)  # input_ids, attention_mask, loss_mask; aux; position_mask
    return {"dspark": dspark, "eagle3_full": common + seq_length * draft_vocab * b,
            "eagle3_topk": common + seq_length * topk * (b + 4)}


def _components(args) -> dict:
    """Thread CPU seconds of the hooked forward and of the distribution over the runner's micro-batches."""
    import time

    from common import TRIMMED, workload

    from ds_capture.cache.common.identity import read_target_weights
    from ds_capture.cache.eagle3.draft_distribution import DraftDistribution
    from ds_capture.capture.hooks import capture_hidden_states

    work = workload(args)
    model = work.model()
    batches = work.plan(TRIMMED)
    _embed, lm_head = read_target_weights(work.target)
    selected = list(range(args.draft_vocab_size))  # the vocabulary's content does not change the cost
    distributions = {"full": DraftDistribution(lm_head.float(), selected, target_probs_topk=0, cache_dtype=torch.bfloat16),
                     "topk": DraftDistribution(lm_head.float(), selected, target_probs_topk=args.topk,
                                               cache_dtype=torch.bfloat16)}
    seconds: dict[str, list[float]] = {"forward": [], "full": [], "topk": []}
    for _ in range(args.repeats):
        totals = dict.fromkeys(seconds, 0.0)
        with torch.no_grad(), capture_hidden_states(model, work.target.family, [1, 2, 3],
                                                    work.target.num_hidden_layers, pre_norm_last=True) as hooks:
            for batch in batches:
                inputs = batch.model_inputs()
                hooks.reset()
                started = time.thread_time()
                model(**inputs, use_cache=False, logits_to_keep=1)
                _aux, last = hooks.collect(torch.float32)
                totals["forward"] += time.thread_time() - started
                for name, distribution in distributions.items():
                    started = time.thread_time()
                    distribution.compute(last, batch.loss_mask, batch.num_tokens, args.seq_length)
                    totals[name] += time.thread_time() - started
        for name, value in totals.items():
            seconds[name].append(value)
    median = {name: statistics.median(values) for name, values in seconds.items()}
    return {"cpu_seconds": median, "runs": seconds, "tokens": work.num_tokens,
            "distribution_over_forward": {name: median[name] / median["forward"] for name in ("full", "topk")}}


def main() -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--seq-length", type=int, default=512)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--shard-size", type=int, default=16)
    parser.add_argument("--draft-vocab-size", type=int, default=512)
    parser.add_argument("--topk", type=int, default=16)
    parser.add_argument("--cache-dtype", default="bf16")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from ds_capture.demo import ensure_demo_target
    from ds_capture.recipe.config import parse_config
    from ds_capture.runner import run_capture
    from ds_capture.target.families import read_target_info

    target_dir = ensure_demo_target()
    target = read_target_info(target_dir)
    common = {"target_model_name_or_path": str(target_dir), "train_data_path": "demo:conversations",
              "train_split": f"train[:{args.samples}]", "seq_length": args.seq_length,
              "micro_batch_size": args.micro_batch_size, "cache_shard_size": args.shard_size,
              "cache_dtype": args.cache_dtype}
    kinds = {
        "dspark": {"cache_kind": "dspark", "recipe_args": {"target_layer_ids": [1, 2, 3]}},
        "eagle3_full": {"cache_kind": "eagle3", "recipe_args": {"aux_layer_ids": [1, 2, 3],
                                                                "draft_vocab_size": args.draft_vocab_size}},
        "eagle3_topk": {"cache_kind": "eagle3", "recipe_args": {"aux_layer_ids": [1, 2, 3],
                                                                "draft_vocab_size": args.draft_vocab_size,
                                                                "target_probs_topk": args.topk}},
    }
    runs: dict[str, list[dict]] = {name: [] for name in kinds}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for name, spec in kinds.items():  # interleaved: drift on a shared box hits every kind alike
                out = Path(tmp) / f"{name}-{repeat}"
                raw = {"cache_kind": spec["cache_kind"],
                       "capture": {"compute_dtype": "fp32", "cpu_threads": args.threads},
                       "recipe_args": {**common, **spec["recipe_args"], "cache_output_dir": str(out)}}
                summary = run_capture(parse_config(raw, source=name, base_dir=Path(".")), show_progress=False)
                shard_bytes = sum(p.stat().st_size for p in out.glob("shard-*.safetensors"))
                runs[name].append({"tokens_per_s": summary.tokens_per_s, "bytes_per_sample": shard_bytes / summary.num_samples,
                                   "capture_seconds": summary.capture_seconds})
                shutil.rmtree(out)
    components = _components(args)
    base = statistics.median(r["tokens_per_s"] for r in runs["dspark"])
    result = {
        "workload": {"target": "demo:qwen3_moe_tiny", "hidden_size": target.hidden_size, "vocab_size": target.vocab_size,
                     "num_hidden_layers": target.num_hidden_layers, "samples": args.samples,
                     "seq_length": args.seq_length, "micro_batch_size": args.micro_batch_size,
                     "cache_dtype": args.cache_dtype, "compute_dtype": "fp32", "draft_vocab_size": args.draft_vocab_size,
                     "topk": args.topk, "threads": args.threads, "repeats": args.repeats},
        "kinds": {name: {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in rs),
                         "bytes_per_sample": statistics.median(r["bytes_per_sample"] for r in rs),
                         "ratio_vs_dspark": statistics.median(r["tokens_per_s"] for r in rs) / base,
                         "runs": rs} for name, rs in runs.items()},
        "components": components,
        "formula_this_workload": formula(hidden=target.hidden_size, seq_length=args.seq_length, dtype=args.cache_dtype,
                                         dspark_layers=3, draft_vocab=args.draft_vocab_size, topk=args.topk),
        "formula_qwen3_8b": {"hidden_size": 4096, "seq_length": 2048, "dtype": "bf16", "dspark_layers": 5,
                             "draft_vocab_size": 32000, "topk": 64,
                             "bytes_per_sample": formula(hidden=4096, seq_length=2048, dtype="bf16", dspark_layers=5,
                                                         draft_vocab=32000, topk=64)},
    }
    return result


if __name__ == "__main__":
    import os

    # DeepSpeed logs to stdout at import: stdout carries only the JSON.
    json_out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    json_out.write(json.dumps(main(), indent=2) + "\n")
