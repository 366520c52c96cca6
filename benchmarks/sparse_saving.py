"""Disk saved by sparse shards (padding tails left as holes) on three targets, issue 16.1.

In: nothing (it builds what it needs). Out: one JSON object, per case: logical bytes of the shards,
bytes written, bytes on disk (``st_blocks * 512``) and the saving ``1 - on_disk / logical``:

- ``demo``: the demo capture (``configs/demo.yaml``: 300 rows at seq 512, hidden 128, 3 layers, bf16);
- ``write_path``: the issue-16 workload (192 rows at seq 1024, hidden 256, 3 layers, bf16);
- ``wide``: a writer-only run for a wide target: hidden 4096, 4 captured layers + the last state
  (40 KiB of bf16 per position), seq 4096, ``--wide-rows`` rows whose lengths are spread evenly so that
  46% of the positions are real, random states written through the real shard writer.

Holes save space only where a row's padded tail spans whole filesystem blocks: a row of the demo's
[512, 512] states has 1 KiB per position, so the tail after the last real position loses up to one block.

    python benchmarks/sparse_saving.py [--wide-rows 8] [--root /tmp/ds_capture_sparse]
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from write_path_workload import build_workload

CHECKOUT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--wide-rows", type=int, default=8)
    parser.add_argument("--root", type=Path, default=Path("/tmp/ds_capture_sparse"))
    parser.add_argument("--skip-runs", action="store_true", help="only the writer-only wide case")
    args = parser.parse_args()
    args.root.mkdir(parents=True, exist_ok=True)
    cases = {}
    if not args.skip_runs:
        from ds_capture.recipe.config import load_config
        from ds_capture.runner import run_capture

        work = build_workload(args.root)
        recipes = {"demo": (CHECKOUT / "configs" / "demo.yaml", args.root / "demo"),
                   "write_path": (work.recipe(args.root / "write_path"), args.root / "write_path")}
        for name, (recipe, out) in recipes.items():
            shutil.rmtree(out, ignore_errors=True)
            summary = run_capture(load_config(recipe, overrides=[f"recipe_args.cache_output_dir={out}"]),
                                  show_progress=False)
            cases[name] = _case(summary.logical_bytes, summary.bytes_written, summary.disk_bytes)
            cases[name]["padding_fraction_of_positions"] = _position_padding(out)
            shutil.rmtree(out, ignore_errors=True)
    cases["wide"] = _wide(args.root / "wide", args.wide_rows)
    print(json.dumps({"benchmark": "sparse_saving", "block_bytes": _block_size(args.root), "cases": cases}, indent=2))


def _case(logical: int, written: int, disk: int) -> dict:
    return {"logical_bytes": logical, "bytes_written": written, "disk_bytes": disk,
            "saving": round(1 - disk / logical, 4), "written_over_logical": round(written / logical, 4)}


def _position_padding(cache: Path) -> float:
    from ds_capture.cache.registry import inspect_cache

    return inspect_cache(cache)["padding_fraction"]


def _wide(out: Path, rows: int) -> dict:
    from ds_capture.cache.dspark.format import Manifest
    from ds_capture.cache.dspark.writer import DSparkShards

    H, k, S = 4096, 4, 4096
    manifest = Manifest(target_model="wide", target_model_type="synthetic", target_vocab_size=32000, hidden_size=H,
                        num_hidden_layers=32, seq_length=S, dtype="bf16", num_samples=rows, shard_size=rows,
                        target_hidden_dim=H * k, target_last_hidden_dim=H, target_layer_ids=(1, 10, 20, 31),
                        train_data_path="synthetic", train_split=None, shuffle_seed=0, mask_reasoning_content=False,
                        mask_generation_prompt=False, chat_template_sha256="0" * 64)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    # Evenly spread lengths with a mean of 46% of S (the issue-16 workload's real fraction).
    lengths = [round(2 * 0.46 * S * (i + 0.5) / rows) for i in range(rows)]
    kind = DSparkShards(out, manifest)
    shard = kind.open(0)
    for row, length in enumerate(lengths):  # one row per micro-batch: 160 MiB of states at full length
        hidden = torch.randn(1, length, H * k).to(torch.bfloat16)
        ids = torch.zeros(1, S, dtype=torch.long)
        shard.write_rows(torch.tensor([row]), {"input_ids": ids, "loss_mask": ids, "target_hidden_states": hidden,
                                               "target_last_hidden_states": hidden[..., -H:].contiguous()},
                         torch.tensor([length]))
    written = kind.finish(0, shard)
    case = _case(written.logical_bytes, written.bytes_written, written.disk_bytes)
    case.update(hidden_size=H, captured_layers=k, seq_length=S, rows=rows,
                padding_fraction_of_positions=round(1 - sum(lengths) / (rows * S), 4))
    shutil.rmtree(out, ignore_errors=True)
    return case


def _block_size(path: Path) -> int:
    import os

    return os.statvfs(path).f_bsize


if __name__ == "__main__":
    main()
