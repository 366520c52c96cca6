"""Helpers shared by the EAGLE-3 tests and the fixture generator (tools/nemo_oracle/make_eagle3_fixtures.py).

``build_fixture_target(spec, name, out)`` rebuilds a target of ``tests/fixtures/eagle3/spec.json``
deterministically (a small-vocabulary tokenizer trained on the demo conversations, then
``ds_capture.demo.build_tiny_target``); ``load_cache(dir)`` reads a cache's shards concatenated per key.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "eagle3"


def read_spec() -> dict:
    return json.loads((FIXTURES / "spec.json").read_text())


def build_fixture_target(spec: dict, name: str, out: Path) -> Path:
    from ds_capture.demo import _conversation_texts, build_tiny_target, demo_data_path, train_tokenizer

    entry = spec["targets"][name]
    tokenizer = train_tokenizer(_conversation_texts(demo_data_path()), vocab_size=spec["tokenizer_vocab_size"])
    return build_tiny_target(Path(out), entry["model_type"], seed=entry["seed"], tokenizer=tokenizer,
                             **entry["overrides"])


def load_cache(cache_dir: Path) -> dict[str, torch.Tensor]:
    """Every shard's tensors, concatenated along rows, per key."""
    from safetensors.torch import load_file

    shards = [load_file(str(path)) for path in sorted(Path(cache_dir).glob("shard-*.safetensors"))]
    return {key: torch.cat([shard[key] for shard in shards]) for key in shards[0]}
