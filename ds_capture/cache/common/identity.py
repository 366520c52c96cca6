"""What ties a cache to the run that made it, for both kinds: a rerun over changed inputs is refused, and the
target's embedding and lm_head are read whole for the weights file.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ds_capture.errors import CaptureError
from ds_capture.target.families import TargetInfo


def refuse_changed_inputs(out_dir: Path, recorded: dict, current: dict) -> None:
    """Refuse a rerun whose inputs differ from those ``out_dir`` was started from (the run's ``inputs`` record:
    dataset and tokenizer sha256, ``capture.invalid_rows``); a name the record lacks (an older cache) passes."""
    changed = [name for name, value in current.items() if name in recorded and recorded[name] != value]
    if "invalid_rows" in changed:
        raise CaptureError(
            f"{out_dir} was started with capture.invalid_rows: {recorded['invalid_rows']}, and this run has "
            f"capture.invalid_rows: {current['invalid_rows']}: the two settings choose different rows of the dataset, "
            "so their shards cannot be mixed. Set capture.invalid_rows back to "
            f"{recorded['invalid_rows']} to continue this cache, use a new cache_output_dir, or pass --restart to "
            "recompute every shard with the new setting."
        )
    if changed:
        what = {"train_data_sha256": "the dataset's content", "tokenizer_sha256": "the tokenizer files"}
        raise CaptureError(
            f"{out_dir} was started from different inputs under the same paths: "
            + " and ".join(what.get(name, name) for name in changed)
            + " changed since (sha256 differs). Mixing them would corrupt the cache silently. Use a new "
            "cache_output_dir, or pass --restart to recompute every shard from the current inputs."
        )


def read_target_weights(target: TargetInfo) -> tuple[torch.Tensor, torch.Tensor]:
    """The full embedding and lm_head straight from the checkpoint files (no engine gathers needed)."""
    from safetensors import safe_open

    family = target.family
    keys = [family.embed_weight_key] + ([] if target.tie_word_embeddings else [family.lm_head_weight_key])
    index_path = target.path / "model.safetensors.index.json"
    if index_path.is_file():
        weight_map = json.loads(index_path.read_text())["weight_map"]
    else:
        weight_map = {key: "model.safetensors" for key in keys}
    tensors = {}
    for key in keys:
        if key not in weight_map:
            raise CaptureError(f"{target.path}: the checkpoint has no tensor {key!r} (needed for target_weights).")
        with safe_open(str(target.path / weight_map[key]), framework="pt") as handle:
            tensors[key] = handle.get_tensor(key).clone()
    embed = tensors[family.embed_weight_key]
    return embed, tensors.get(family.lm_head_weight_key, embed)
