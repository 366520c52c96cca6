"""Datasets at scale: validation and tokenisation rows/s and peak RSS per rank, ours next to NeMo's ChatDataset.

    python benchmarks/data_scale.py                      # 100k and 1M rows, world 2, seq_length 512
    python benchmarks/data_scale.py --rows 100000 --world 4 --nemo-python /work/nemo_venv/bin/python

Synthetic rows: the 300 bundled demo conversations cycled (each first user message tagged with its row number),
written once as JSONL. Every rank runs as its own process, one after another (peak RSS is per process):

- ours: ``open_dataset`` validates every row, streaming (every rank reads the whole file: the same first error
  everywhere), then ``conversations(range)`` + ``tokenize_conversations`` for the rank's contiguous range
  (``ParallelLayout.sample_range``), capped at ``--tokenize-rows`` rows (tokenisation is the cost that scales
  with the range; its rows/s does not depend on the cap);
- NeMo AutoModel 0.7.0 (``--nemo-python``, a side environment with nemo_automodel installed): ``ChatDataset``
  exactly as its precompute builds it (every rank loads and parses the whole file), then ``dataset[i]`` for the
  same rows. NeMo has no validation pass: its "validate" column is the load, and a bad row surfaces only when
  ``__getitem__`` reaches it.

The same rows are tokenised on both sides and their ``input_ids`` / ``loss_mask`` digests must agree (printed).
Prints one JSON object (medians are not needed: one run per cell, the figures are throughput over >= 1,000
rows); ``--out`` also writes it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_NEMO = "/work/nemo_venv/bin/python"


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _digest(rows_ids, rows_mask) -> str:
    h = hashlib.sha256()
    for ids, mask in zip(rows_ids, rows_mask):
        h.update(json.dumps([list(map(int, ids)), list(map(int, mask))]).encode())
    return h.hexdigest()


# ----------------------------------------------------------------------------- one rank, ours


def run_ours(args) -> dict:
    sys.path.insert(0, str(ROOT))
    from transformers import AutoTokenizer

    from ds_capture.data.reading import open_dataset
    from ds_capture.data.tokenization import resolve_chat_template, tokenize_conversations
    from ds_capture.parallel.layout import build_layout

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_dir)
    template = resolve_chat_template(tokenizer, None)
    base_rss = _peak_rss_mb()
    started = time.perf_counter()
    dataset = open_dataset(args.data, split=None, shuffle_seed=42)
    validate_s = time.perf_counter() - started
    plan = build_layout(world_size=args.world, rank=args.rank, tp_size=1, ep_size=1, num_experts=None,
                      num_attention_heads=4, num_key_value_heads=4)
    samples = plan.sample_range(len(dataset), args.shard_size)
    stop = min(samples.stop, samples.start + args.tokenize_rows)
    started = time.perf_counter()
    conversations = dataset.conversations(samples.start, stop)
    rows = tokenize_conversations(conversations, tokenizer, chat_template=template, seq_length=args.seq_length,
                                  mask_reasoning_content=False, mask_generation_prompt=False)
    tokenize_s = time.perf_counter() - started
    ids, masks = rows.input_ids.tolist(), rows.loss_mask.tolist()  # padded to seq_length, as NeMo's
    return {"rows": len(dataset), "rank_range": [samples.start, samples.stop], "validate_s": validate_s,
            "validate_rows_per_s": len(dataset) / validate_s, "tokenized_rows": stop - samples.start,
            "tokenize_s": tokenize_s, "tokenize_rows_per_s": (stop - samples.start) / tokenize_s,
            "peak_rss_mb": _peak_rss_mb(), "rss_before_data_mb": base_rss, "digest": _digest(ids, masks),
            "first_row": samples.start}


# ----------------------------------------------------------------------------- one rank, NeMo's ChatDataset


def run_nemo(args) -> dict:
    from nemo_automodel._transformers.auto_tokenizer import NeMoAutoTokenizer
    from nemo_automodel.components.datasets.llm.chat_dataset import ChatDataset

    tokenizer = NeMoAutoTokenizer.from_pretrained(args.tokenizer_dir)
    base_rss = _peak_rss_mb()
    started = time.perf_counter()
    dataset = ChatDataset(args.data, tokenizer, seq_length=args.seq_length, padding="max_length", truncation=True,
                          unshifted=True)
    load_s = time.perf_counter() - started
    first, count = args.first_row, args.tokenize_rows
    started = time.perf_counter()
    samples = [dataset[i] for i in range(first, first + count)]
    tokenize_s = time.perf_counter() - started
    ids, masks = [s["input_ids"] for s in samples], [s["loss_mask"] for s in samples]
    return {"rows": len(dataset), "load_s": load_s, "load_rows_per_s": len(dataset) / load_s,
            "tokenized_rows": count, "tokenize_s": tokenize_s, "tokenize_rows_per_s": count / tokenize_s,
            "peak_rss_mb": _peak_rss_mb(), "rss_before_data_mb": base_rss, "digest": _digest(ids, masks)}


# ----------------------------------------------------------------------------- driver


def make_data(path: Path, num_rows: int) -> None:
    sys.path.insert(0, str(ROOT))
    from ds_capture.demo import demo_data_path

    demo = [json.loads(line) for line in demo_data_path().read_text().splitlines()]
    with path.open("w", encoding="utf-8") as handle:
        for i in range(num_rows):
            row = json.loads(json.dumps(demo[i % len(demo)]))
            first_user = next(m for m in row["messages"] if m["role"] == "user")
            first_user["content"] += f" (#{i})"
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")


def save_tokenizer(directory: Path) -> None:
    sys.path.insert(0, str(ROOT))
    from ds_capture.demo import demo_tokenizer

    demo_tokenizer().save_pretrained(str(directory))


def _child(python: str, mode: str, args, **extra) -> dict:
    argv = [python, str(Path(__file__).resolve()), mode, "--data", str(extra.pop("data")), "--tokenizer-dir",
            str(extra.pop("tokenizer_dir")), "--seq-length", str(args.seq_length), "--tokenize-rows",
            str(args.tokenize_rows), "--shard-size", str(args.shard_size), "--world", str(args.world)]
    for key, value in extra.items():
        argv += [f"--{key.replace('_', '-')}", str(value)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    if mode == "_nemo":
        env.pop("PYTHONPATH", None)
    done = subprocess.run(argv, capture_output=True, text=True, env=env, check=False)
    if done.returncode:
        raise SystemExit(f"{mode} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", nargs="?", default="bench", choices=["bench", "_ours", "_nemo"])
    parser.add_argument("--rows", type=int, nargs="+", default=[100_000, 1_000_000])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--seq-length", type=int, default=512)
    parser.add_argument("--shard-size", type=int, default=256)
    parser.add_argument("--tokenize-rows", type=int, default=1000)
    parser.add_argument("--nemo-python", default=DEFAULT_NEMO if Path(DEFAULT_NEMO).exists() else None)
    parser.add_argument("--work-dir", default=None, help="keep the synthetic files here (default: a temp dir)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--data"), parser.add_argument("--tokenizer-dir"), parser.add_argument("--rank", type=int)
    parser.add_argument("--first-row", type=int, default=0)
    args = parser.parse_args()
    if args.mode == "_ours":
        print(json.dumps(run_ours(args)))
        return
    if args.mode == "_nemo":
        print(json.dumps(run_nemo(args)))
        return

    work = Path(args.work_dir or tempfile.mkdtemp(prefix="data_scale_"))
    work.mkdir(parents=True, exist_ok=True)
    tokenizer_dir = work / "tokenizer"
    if not (tokenizer_dir / "tokenizer.json").is_file():
        save_tokenizer(tokenizer_dir)
    report = {"benchmark": "data_scale", "world": args.world, "seq_length": args.seq_length,
              "tokenize_rows_per_rank": args.tokenize_rows, "tokenizer": "demo (bundled, marker-free template)",
              "cells": []}
    for num_rows in args.rows:
        data = work / f"rows{num_rows}.jsonl"
        if not data.is_file():
            make_data(data, num_rows)
        cell = {"rows": num_rows, "file_mb": data.stat().st_size / 2**20, "ours": [], "nemo": None}
        for rank in range(args.world):
            cell["ours"].append({"rank": rank, **_child(sys.executable, "_ours", args, data=data,
                                                        tokenizer_dir=tokenizer_dir, rank=rank)})
        if args.nemo_python:
            # Every NeMo rank loads the whole file the same way: one process measures each rank's cost.
            cell["nemo"] = _child(args.nemo_python, "_nemo", args, data=data, tokenizer_dir=tokenizer_dir,
                                  first_row=cell["ours"][0]["first_row"])
            cell["same_ids_and_masks"] = cell["nemo"]["digest"] == cell["ours"][0]["digest"]
        report["cells"].append(cell)
        print(json.dumps(_summary(cell)), file=sys.stderr)
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


def _summary(cell: dict) -> dict:
    ours, nemo = cell["ours"], cell["nemo"] or {}
    return {"rows": cell["rows"],
            "ours_validate_rows_per_s": min(r["validate_rows_per_s"] for r in ours),
            "ours_tokenize_rows_per_s": min(r["tokenize_rows_per_s"] for r in ours),
            "ours_peak_rss_mb_per_rank": [round(r["peak_rss_mb"]) for r in ours],
            "nemo_load_rows_per_s": nemo.get("load_rows_per_s"), "nemo_tokenize_rows_per_s":
                nemo.get("tokenize_rows_per_s"), "nemo_peak_rss_mb_per_rank": nemo.get("peak_rss_mb"),
            "same_ids_and_masks": cell.get("same_ids_and_masks")}


if __name__ == "__main__":
    main()
