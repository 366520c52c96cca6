"""The write-path workload of issue 16, built once and shared by vs_nemo.py and physical_limits.py.

In: a root directory. Out (cached under it, rebuilt only when missing): a random-init Qwen3-MoE target
(hidden 256, 4 layers, 8 experts; the demo tokenizer and ChatML template), a JSONL of 192 chat rows
whose lengths are spread so that about 46% of the positions at seq 1024 are real tokens (multi-turn rows
stitched from the bundled demo conversations, some truncated at 1024), and a ds_capture recipe
(bf16 cache, micro-batch 4, shards of 32; compute dtype NeMo's rule: fp32 on CPU).

    from write_path_workload import build_workload
    work = build_workload(Path("/tmp/wp"))   # .target, .data, .recipe(out_dir) -> path of a YAML
"""

from __future__ import annotations

import json
import random
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

NUM_ROWS = 192
SEQ_LENGTH = 1024
MICRO_BATCH_SIZE = 4
SHARD_SIZE = 32
CACHE_DTYPE = "bf16"
TARGET_CONFIG = dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=256, head_dim=64,
                     num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=4)


@dataclass(frozen=True)
class WritePathWorkload:
    root: Path
    target: Path
    data: Path

    def recipe(self, out_dir: Path, name: str = "recipe.yaml", **capture) -> Path:
        path = self.root / name
        recipe = {"recipe_args": dict(
            target_model_name_or_path=str(self.target), train_data_path=str(self.data), cache_output_dir=str(out_dir),
            seq_length=SEQ_LENGTH, micro_batch_size=MICRO_BATCH_SIZE, cache_shard_size=SHARD_SIZE,
            cache_dtype=CACHE_DTYPE)}
        if capture:
            recipe["capture"] = capture
        path.write_text(yaml.safe_dump(recipe))
        return path

    def describe(self) -> dict:
        return {"target": "qwen3_moe " + ", ".join(f"{k} {v}" for k, v in TARGET_CONFIG.items()),
                "rows": NUM_ROWS, "seq_length": SEQ_LENGTH, "micro_batch_size": MICRO_BATCH_SIZE,
                "shard_size": SHARD_SIZE, "cache_dtype": CACHE_DTYPE}


def build_workload(root: Path) -> WritePathWorkload:
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    target, data = root / "target_qwen3_moe_h256", root / "rows.jsonl"
    if not (target / "config.json").is_file():
        from ds_capture.demo import build_tiny_target

        build_tiny_target(target, "qwen3_moe", seed=0, **TARGET_CONFIG)
    if not data.is_file():
        _write_rows(data, target)
    return WritePathWorkload(root=root, target=target, data=data)


def _write_rows(path: Path, target: Path) -> None:
    """Rows of demo turns stitched until each reaches a length drawn uniformly from [24, 790] tokens."""
    from transformers import AutoTokenizer

    from ds_capture.demo import demo_data_path

    tokenizer = AutoTokenizer.from_pretrained(str(target))
    turns = []
    for line in demo_data_path().read_text().splitlines():
        messages = json.loads(line)["messages"]
        turns += [messages[i:i + 2] for i in range(len(messages)) if messages[i]["role"] == "user"
                  and i + 1 < len(messages) and messages[i + 1]["role"] == "assistant"]
    rng = random.Random(16)
    rows, cursor = [], 0
    for _ in range(NUM_ROWS):
        goal = rng.randint(24, 790)
        messages = [{"role": "system", "content": "You are a helpful assistant."}]
        while len(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)) < goal:
            messages += [dict(m) for m in turns[cursor % len(turns)]]
            cursor += 1
        rows.append(json.dumps({"messages": messages}))
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("\n".join(rows) + "\n")
    tmp.replace(path)
