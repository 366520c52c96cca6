"""The EAGLE-3 cache contract: NeMo AutoModel 0.7.0's EAGLE-3 offline cache, format v2 (EAGLE3_CACHE.md).

In: the values of one run. Out: a frozen ``Eagle3Manifest`` that serialises to exactly the
``manifest.json`` NeMo's ``precompute_eagle3`` writes (its fields only, sorted keys, two-space
indent, no trailing newline: no ``complete`` flag and none of our bookkeeping), parses such a file
back with errors that name the file and field, and says what every shard must hold. Nothing here
touches the disk.

Files in a cache directory::

    manifest.json                   the Eagle3Manifest, written once, before any shard
    target_embeddings.safetensors   weight [V, H] fp32 (the input embeddings)
    shard-NNNNNN.safetensors        input_ids, attention_mask, loss_mask [n, S] int64;
                                    aux_hidden_states [n, S, 3H]; position_mask [n, S, 1] bool;
                                    target_probs [n, S, Vd]  or  target_probs_values [n, S, k] +
                                    target_probs_indices [n, S, k] int32
    .ds_capture/                    our bookkeeping (checksums, run.json, complete.json); NeMo ignores it

NeMo's cache has no completion flag (complete = every shard present); ours is ``.ds_capture/complete.json``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

import torch

from ds_capture.cache.common.names import DTYPES, num_shards
from ds_capture.errors import CaptureError, parse_json

EAGLE3_FORMAT_VERSION = 2
EMBEDDINGS_NAME = "target_embeddings.safetensors"
RUN_RECORD_NAME = "run.json"
"""``.ds_capture/run.json``: producer, layout and input fingerprints (DSpark keeps these in its manifest)."""
COMPLETE_NAME = "complete.json"
"""``.ds_capture/complete.json``: written after every rank finished; names the manifest it completes."""
COMMON_KEYS = ("input_ids", "attention_mask", "loss_mask", "aux_hidden_states", "position_mask")
FULL_PROBS_KEYS = ("target_probs",)
TOPK_PROBS_KEYS = ("target_probs_values", "target_probs_indices")


@dataclass(frozen=True, kw_only=True)
class Eagle3Manifest:
    """One EAGLE-3 ``manifest.json``: a field per row of EAGLE3_CACHE.md §2 (``format_version`` aside)."""

    target_model: str
    """Target path or hub id as configured (NeMo: ``--target-model``)."""
    target_vocab_size: int
    """V: the config's ``vocab_size`` (not the tokenizer length)."""
    draft_vocab_size: int
    """Vd = len(selected_token_ids)."""
    seq_length: int
    dtype: str
    """``bf16`` / ``fp16`` / ``fp32``: aux_hidden_states and target_probs(_values)."""
    num_samples: int
    shard_size: int
    target_probs_topk: int
    """As configured (0 = off); recorded even where it does not compress (k >= Vd)."""
    aux_hidden_dim: int
    """H x 3."""
    aux_layer_ids: tuple[int, ...]
    """The 3 layers in concatenation order (as given, not sorted)."""
    selected_token_ids: tuple[int, ...]
    """Draft id d -> target id, in selection order."""
    input_data: str
    split: str | None
    shuffle_seed: int
    mask_reasoning_content: bool
    mask_generation_prompt: bool

    def __post_init__(self) -> None:
        object.__setattr__(self, "aux_layer_ids", tuple(self.aux_layer_ids))
        object.__setattr__(self, "selected_token_ids", tuple(self.selected_token_ids))

    # -- JSON -------------------------------------------------------------------------------

    def to_json(self) -> str:
        """NeMo's text: ``json.dump({"format_version": 2, **fields}, indent=2, sort_keys=True)``."""
        obj: dict[str, Any] = {"format_version": EAGLE3_FORMAT_VERSION}
        for name in FIELD_NAMES:
            value = getattr(self, name)
            obj[name] = list(value) if isinstance(value, tuple) else value
        return json.dumps(obj, indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, source: str) -> "Eagle3Manifest":
        """Parse a manifest; ``source`` (the path) is named in every error. NeMo's defaults apply to the mask flags."""
        obj = parse_json(text, source, "An EAGLE-3 cache manifest is a JSON object: delete the cache directory and "
                         "re-run, or point at the right directory.")
        if not isinstance(obj, dict):
            raise CaptureError(f"{source} holds JSON that is not an object; it is not a cache manifest.")
        if obj.get("format_version") != EAGLE3_FORMAT_VERSION:
            raise CaptureError(
                f"{source}: format_version is {json.dumps(obj.get('format_version'))}, an EAGLE-3 cache is format "
                f"{EAGLE3_FORMAT_VERSION} (DSpark caches are format 1). Use cache_kind matching the cache, or a new "
                "cache_output_dir.")
        # NeMo's read_manifest fills the mask flags in for caches written before they existed.
        obj = {"mask_reasoning_content": False, "mask_generation_prompt": False, **obj}
        values = {}
        for name, label in _FIELD_TYPES.items():
            if name not in obj:
                raise CaptureError(f"{source} has no field '{name}' ({label}); it is not a complete EAGLE-3 cache "
                                   "manifest (format v2). Re-create the cache.")
            if not _accepts(label, obj[name]):
                raise CaptureError(f"{source}: field '{name}' is {json.dumps(obj[name])}, expected {label}. "
                                   "The manifest is damaged or from another tool; re-create the cache.")
            values[name] = obj[name]
        if values["dtype"] not in DTYPES:
            raise CaptureError(f"{source}: field 'dtype' is {json.dumps(values['dtype'])}, expected one of "
                               f"{sorted(DTYPES)}.")
        return cls(**values)

    # -- identity ---------------------------------------------------------------------------

    def identity_diff(self, other: "Eagle3Manifest") -> list[str]:
        """Fields that differ: every field is identity (NeMo's --resume requires dict equality)."""
        return [name for name in FIELD_NAMES if getattr(self, name) != getattr(other, name)]

    # -- shards -----------------------------------------------------------------------------

    @property
    def num_shards(self) -> int:
        return num_shards(self.num_samples, self.shard_size)

    @property
    def compressed(self) -> bool:
        """NeMo's ``is_compressed``: top-k is stored iff 0 < k < Vd."""
        return 0 < self.target_probs_topk < self.draft_vocab_size

    def shard_rows(self, index: int) -> int:
        if not 0 <= index < self.num_shards:
            raise IndexError(f"shard index {index} out of range 0..{self.num_shards - 1}")
        return min(self.shard_size, self.num_samples - index * self.shard_size)

    def expected_shard_tensors(self, index: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """name -> (shape, dtype) of the tensors shard ``index`` must hold."""
        n, S, cache_dtype = self.shard_rows(index), self.seq_length, DTYPES[self.dtype]
        tensors = {
            "input_ids": ((n, S), torch.int64),
            "attention_mask": ((n, S), torch.int64),
            "loss_mask": ((n, S), torch.int64),
            "aux_hidden_states": ((n, S, self.aux_hidden_dim), cache_dtype),
            "position_mask": ((n, S, 1), torch.bool),
        }
        if self.compressed:
            k = self.target_probs_topk
            tensors["target_probs_values"] = ((n, S, k), cache_dtype)
            tensors["target_probs_indices"] = ((n, S, k), torch.int32)
        else:
            tensors["target_probs"] = ((n, S, self.draft_vocab_size), cache_dtype)
        return tensors

    def expected_embedding_tensors(self, hidden_size: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {"weight": ((self.target_vocab_size, hidden_size), torch.float32)}

    @property
    def hidden_size(self) -> int:
        return self.aux_hidden_dim // 3

    def consistency_problems(self) -> list[str]:
        """Contradictions between fields (a manifest from a buggy or foreign writer)."""
        problems = []
        if self.shard_size < 1 or self.num_samples < 0 or self.seq_length < 1:
            problems.append(f"shard_size {self.shard_size}, num_samples {self.num_samples} and seq_length "
                            f"{self.seq_length} must be >= 1, >= 0 and >= 1")
        ids = self.aux_layer_ids
        if len(ids) != 3 or len(set(ids)) != 3 or min(ids, default=0) < 0:
            problems.append(f"aux_layer_ids {list(ids)} must be 3 distinct ids >= 0")
        if self.aux_hidden_dim % 3:
            problems.append(f"aux_hidden_dim {self.aux_hidden_dim} is not 3 x hidden_size")
        selected = self.selected_token_ids
        if len(selected) != self.draft_vocab_size:
            problems.append(f"draft_vocab_size {self.draft_vocab_size} != len(selected_token_ids) {len(selected)}")
        if len(set(selected)) != len(selected) or any(not 0 <= i < self.target_vocab_size for i in selected):
            problems.append(f"selected_token_ids must be distinct ids in 0..{self.target_vocab_size - 1}")
        if self.target_probs_topk < 0:
            problems.append(f"target_probs_topk {self.target_probs_topk} must be >= 0")
        return problems


def _accepts(label: str, value: Any) -> bool:
    is_int = isinstance(value, int) and not isinstance(value, bool)
    checks = {
        "int": is_int,
        "str": isinstance(value, str),
        "bool": isinstance(value, bool),
        "str or null": value is None or isinstance(value, str),
        "list of int": isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value),
    }
    return checks[label]


_FIELD_TYPES: dict[str, str] = {
    "target_model": "str", "target_vocab_size": "int", "draft_vocab_size": "int", "seq_length": "int",
    "dtype": "str", "num_samples": "int", "shard_size": "int", "target_probs_topk": "int", "aux_hidden_dim": "int",
    "aux_layer_ids": "list of int", "selected_token_ids": "list of int", "input_data": "str",
    "split": "str or null", "shuffle_seed": "int", "mask_reasoning_content": "bool", "mask_generation_prompt": "bool",
}
FIELD_NAMES: tuple[str, ...] = tuple(f.name for f in fields(Eagle3Manifest))
assert set(FIELD_NAMES) == set(_FIELD_TYPES)


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """NeMo's EAGLE-3 default ``[1, L//2 - 1, L - 4]`` (needs L >= 7 for 3 distinct in-bounds ids)."""
    return [1, num_layers // 2 - 1, num_layers - 4]


def resolve_aux_layer_ids(configured: tuple[int, ...] | None, num_layers: int, *, source: str) -> list[int]:
    """The configured ids checked against the target's depth, or NeMo's default rule (refused where it fails)."""
    if configured is None:
        ids = default_aux_layer_ids(num_layers)
        if len(set(ids)) != 3 or min(ids) < 0 or max(ids) >= num_layers:
            raise CaptureError(
                f"{source}: the target has {num_layers} decoder layers, too shallow for NeMo's default EAGLE-3 aux "
                f"layers {ids} ([1, L//2 - 1, L - 4] needs L >= 7). Set `recipe_args.aux_layer_ids` to 3 distinct "
                f"ids in 0..{num_layers - 1}, matching the draft's num_aux_hidden_states.")
        return ids
    bad = [i for i in configured if not 0 <= i < num_layers]
    if bad:
        raise CaptureError(
            f"{source}: `recipe_args.aux_layer_ids` {list(configured)} has ids outside 0..{num_layers - 1} "
            f"({', '.join(map(str, bad))}); the target has {num_layers} decoder layers (id i is the output of "
            "decoder layer i, before the final norm).")
    return list(configured)
