"""Shared helpers for the throughput benchmarks (writer_overlap, length_mix, end_to_end).

In: the demo target (``ds_capture.demo.ensure_demo_target``, built under ``$DS_CAPTURE_HOME`` or
``~/.cache/ds_capture`` on first use) and the bundled demo conversations. Out: tokenised rows, the
loaded model, the runner's micro-batch plan, a capture loop that mirrors the runner's, and timing
helpers (interleaved repeats, medians, ratios). Nothing here writes outside a temp directory.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

# Runs from a checkout without `pip install -e .`: the repository root holds the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ds_capture.recipe.config import CaptureOptions  # noqa: E402

TRIMMED = CaptureOptions()  # the defaults: length sorted within a shard, padded to a multiple of 64
FIXED = CaptureOptions(pad_to_multiple_of=0, sort_by_length=False)


def base_parser(doc: str, *, samples: int = 128, shard_size: int = 16, repeats: int = 3) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=samples)
    parser.add_argument("--seq-length", type=int, default=512)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--shard-size", type=int, default=shard_size)
    parser.add_argument("--repeats", type=int, default=repeats)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: steadier ratios)")
    return parser


@dataclass
class Workload:
    target_dir: Path
    target: object  # ds_capture.target.families.TargetInfo
    rows: object  # ds_capture.data.tokenization.TokenizedRows
    split: str
    seq_length: int
    micro_batch_size: int
    shard_size: int
    layer_ids: list[int]

    @property
    def num_tokens(self) -> int:
        return int(self.rows.num_tokens.sum())

    @property
    def num_samples(self) -> int:
        return len(self.rows.input_ids)

    def shard_rows(self) -> list[tuple[int, tuple]]:
        out = []
        for lo in range(0, self.num_samples, self.shard_size):
            out.append((lo // self.shard_size, tuple(
                t[lo:lo + self.shard_size] for t in (self.rows.input_ids, self.rows.loss_mask, self.rows.num_tokens))))
        return out

    def plan(self, options: CaptureOptions) -> list:
        """The runner's own micro-batches (``capture.micro_batches.plan_micro_batches``) for every shard, in order."""
        from ds_capture.capture.micro_batches import plan_micro_batches

        return [batch for index, rows in self.shard_rows()
                for batch in plan_micro_batches(index, rows, self.micro_batch_size, self.seq_length, options)]

    def manifest(self):
        from ds_capture.cache.dspark.format import Manifest

        t = self.target
        return Manifest(
            target_model=str(self.target_dir), target_model_type=t.model_type, target_vocab_size=t.vocab_size,
            hidden_size=t.hidden_size, num_hidden_layers=t.num_hidden_layers, seq_length=self.seq_length,
            dtype="fp32", num_samples=self.num_samples, shard_size=self.shard_size,
            target_hidden_dim=t.hidden_size * len(self.layer_ids), target_last_hidden_dim=t.hidden_size,
            target_layer_ids=tuple(self.layer_ids), train_data_path="demo:conversations", train_split=self.split,
            shuffle_seed=42, mask_reasoning_content=False, mask_generation_prompt=False, chat_template_sha256="",
        )

    def describe(self) -> dict:
        """The workload's fields every benchmark's JSON starts with."""
        return {
            "model_type": self.target.model_type,
            "samples": self.num_samples,
            "seq_length": self.seq_length,
            "micro_batch_size": self.micro_batch_size,
            "shard_size": self.shard_size,
            "threads": torch.get_num_threads(),
            "dtype": "fp32",
            "tokens": self.num_tokens,
        }

    def model(self) -> torch.nn.Module:
        from ds_capture.parallel.single import build_single_model

        return build_single_model(self.target, dtype=torch.float32, attn_implementation=None)


def workload(args: argparse.Namespace) -> Workload:
    """Demo target + the first ``args.samples`` demo conversations tokenised as the runner does."""
    from transformers import AutoTokenizer

    from ds_capture.capture.hooks import resolve_layer_ids
    from ds_capture.data.tokenization import read_conversations, resolve_chat_template, tokenize_conversations
    from ds_capture.demo import demo_data_path, ensure_demo_target
    from ds_capture.target.families import read_target_info

    torch.set_num_threads(args.threads)
    target_dir = ensure_demo_target()
    target = read_target_info(target_dir)
    split = f"train[:{args.samples}]"
    tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
    rows = tokenize_conversations(
        read_conversations(str(demo_data_path()), split=split, shuffle_seed=42), tokenizer,
        chat_template=resolve_chat_template(tokenizer, None), seq_length=args.seq_length,
        mask_reasoning_content=False, mask_generation_prompt=False)
    layer_ids = resolve_layer_ids(None, target.num_hidden_layers, 5, source="benchmark")
    return Workload(target_dir=target_dir, target=target, rows=rows, split=split, seq_length=args.seq_length,
                    micro_batch_size=args.micro_batch_size, shard_size=args.shard_size, layer_ids=layer_ids)


def capture_loop(model: torch.nn.Module, work: Workload, batches: list, sink: Callable | None = None) -> float:
    """The runner's compute loop (hooks, forward, collect) over ``batches``; ``sink(batch, hidden, last)``
    gets each result (e.g. a shard writer's ``put``). Returns seconds."""
    from ds_capture.capture.hooks import capture_hidden_states

    target = work.target
    started = time.perf_counter()
    with torch.no_grad(), capture_hidden_states(model, target.family, work.layer_ids,
                                                target.num_hidden_layers) as hooks:
        for batch in batches:
            inputs = batch.model_inputs()
            hooks.reset()
            model(**inputs, use_cache=False)
            hidden, last = hooks.collect(torch.float32)
            if sink is not None:
                sink(batch, hidden, last)
    return time.perf_counter() - started


def micro_batch(batch, hidden: torch.Tensor, last: torch.Tensor):
    from ds_capture.cache.common.async_writer import MicroBatch

    return MicroBatch(shard_index=batch.shard_index, rows=batch.rows, num_tokens=batch.num_tokens,
                      tensors={"input_ids": batch.input_ids, "loss_mask": batch.loss_mask,
                               "target_hidden_states": hidden, "target_last_hidden_states": last})


def interleaved(variants: dict[str, Callable[[int], float]], repeats: int) -> dict[str, list[float]]:
    """Run every variant once per repeat, in turn (machine-load drift hits all alike); seconds per run."""
    seconds: dict[str, list[float]] = {name: [] for name in variants}
    for repeat in range(repeats):
        for name, run in variants.items():
            seconds[name].append(run(repeat))
    return seconds


def median(values: list[float]) -> float:
    return statistics.median(values)


def summary(seconds: list[float], tokens: int) -> dict:
    return {"seconds": [round(s, 3) for s in seconds], "median_seconds": round(median(seconds), 3),
            "median_tokens_per_s": round(tokens / median(seconds), 1)}
