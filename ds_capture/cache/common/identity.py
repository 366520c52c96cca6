"""What ties a cache to the run that made it, for both kinds: a rerun over changed inputs is refused, a rerun
continues with the numerics the cache was begun with (its CPU thread count), and the target's embedding and lm_head
are read whole for the weights file.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ds_capture.cache.common.files import read_numerics
from ds_capture.cache.common.names import BOOKKEEPING_DIR, NUMERICS_NAME
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


def continue_numerics(out_dir: Path, current: dict, *, setting: int | str, resuming: bool,
                      chunk_setting: int | str = "auto") -> tuple[dict, bool]:
    """The numerics this run computes with, and whether they are the cache's recorded ones (rank 0, read-only,
    before anything is written). ``current``: this run's :func:`~ds_capture.cache.common.files.run_numerics`. A
    rerun over a cache begun on CPU (``resuming``: the directory holds this cache and no ``--restart``) takes the
    CPU thread count recorded in ``.ds_capture/numerics.json``, at whatever world size it runs; an explicit
    ``capture.cpu_threads`` (``setting``) other than the recorded count is refused. A GPU forward, a cache without
    a record (an earlier version) and a run that starts the cache keep ``current``.

    The chunked prefill's chunk likewise, on any device: a rerun with ``capture.chunked_prefill: auto`` continues
    with the recorded chunk (a cache recorded without one was made of whole rows); another explicit setting is
    refused, so one cache never mixes two chunk sizes. A compute dtype other than the recorded one is refused too
    (``capture.compute_dtype: auto`` is bf16 on CUDA and fp32 on CPU: a cache begun on one continues on the other
    only with the dtype set)."""
    recorded = (read_numerics(out_dir) if resuming else None) or {}
    if recorded:
        _refuse_other_compute_dtype(out_dir, current["compute_dtype"], recorded.get("compute_dtype"))
        current = _continue_chunk(out_dir, current, recorded.get("chunk_tokens"), chunk_setting)
    threads = recorded.get("cpu_threads")
    if current["device"] != "cpu" or recorded.get("device") != "cpu" or not isinstance(threads, int):
        return current, False
    if setting != "auto" and setting != threads:
        raise CaptureError(
            f"{out_dir} was begun with {threads} CPU thread{'s' * (threads != 1)} per rank "
            f"({BOOKKEEPING_DIR}/{NUMERICS_NAME}), and this run sets capture.cpu_threads: {setting}: the thread count "
            "changes the order of fp32 sums on CPU, so shards computed with the two counts differ in their last bits "
            f"and cannot be mixed in one cache. Set capture.cpu_threads to {threads} (or auto, which continues with "
            "the recorded count) to continue this cache, use a new cache_output_dir, or pass --restart to recompute "
            "every shard with the new count."
        )
    return {**current, "cpu_threads": threads}, True


def _refuse_other_compute_dtype(out_dir: Path, dtype: str, recorded: str | None) -> None:
    if recorded is None or recorded == dtype:
        return
    raise CaptureError(
        f"{out_dir} was begun computing in {recorded} ({BOOKKEEPING_DIR}/{NUMERICS_NAME}), and this run computes in "
        f"{dtype} (capture.compute_dtype; auto is bf16 on CUDA, fp32 on CPU): shards computed in the two dtypes "
        f"differ and cannot be mixed in one cache. Set capture.compute_dtype: {recorded} to continue this cache, use "
        "a new cache_output_dir, or pass --restart to recompute every shard in the new dtype."
    )


def _continue_chunk(out_dir: Path, current: dict, chunk: int | None, setting: int | str) -> dict:
    if current.get("chunk_tokens") == chunk:
        return current
    if setting == "auto":
        return {**current, "chunk_tokens": chunk}
    begun = f"rows in chunks of {chunk} tokens" if chunk else "whole rows"
    keep = chunk if chunk else "off"
    raise CaptureError(
        f"{out_dir} was begun with {begun} ({BOOKKEEPING_DIR}/{NUMERICS_NAME}), and this run sets "
        f"capture.chunked_prefill: {setting}: chunks sum each layer's attention and recurrences in another order, so "
        "shards computed with the two settings differ in their last bits and cannot be mixed in one cache. Set "
        f"capture.chunked_prefill to {keep} (or auto, which continues with the recorded setting) to continue this "
        "cache, use a new cache_output_dir, or pass --restart to recompute every shard with the new setting."
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
