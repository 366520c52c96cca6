"""The cache contract: NeMo AutoModel's DSpark offline cache, format v1 (DESIGN.md §3).

In: the values of one run (target, data, layout of the cache). Out: a frozen ``Manifest`` that
serialises to exactly the ``manifest.json`` NeMo AutoModel 0.7.0 writes (sorted keys, two-space
indent, no trailing newline), parses such a file back with errors that name the file and field,
and answers what every shard must hold (names, shapes, dtypes). Nothing here touches the disk.

Files in a cache directory::

    manifest.json                    the Manifest (written twice: complete false, then true)
    target_weights.safetensors       embed_tokens.weight, lm_head.weight  [V, H]
    shard-NNNNNN.safetensors         input_ids, loss_mask [n, S]; target_hidden_states [n, S, H*k];
                                     target_last_hidden_states [n, S, H]
    .ds_capture/                     this project's bookkeeping (checksum sidecars); NeMo ignores it
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ds_capture.cache.common.names import DTYPES, num_shards
from ds_capture.errors import CaptureError, parse_json

FORMAT_VERSION = 1
TARGET_WEIGHTS_NAME = "target_weights.safetensors"


SHARD_KEYS = ("input_ids", "loss_mask", "target_hidden_states", "target_last_hidden_states")
WEIGHT_KEYS = ("embed_tokens.weight", "lm_head.weight")


@dataclass(frozen=True, kw_only=True)
class Manifest:
    """One ``manifest.json``: a field per row of DESIGN.md §3, plus non-identity bookkeeping."""

    target_model: str
    """Target path or hub id exactly as configured."""
    target_model_type: str
    """``config.model_type`` (for Gemma4 the outer one)."""
    target_vocab_size: int
    """``vocab_size`` of the (text) config, not the tokenizer length."""
    hidden_size: int
    """H of the (text) config."""
    num_hidden_layers: int
    """L of the (text) config."""
    seq_length: int
    """S: every row is padded or truncated to it."""
    dtype: str
    """``bf16``, ``fp16`` or ``fp32``: float dtype of the cached hidden states and weights."""
    num_samples: int
    """Dataset length after split/slicing."""
    shard_size: int
    """Rows per shard (the last shard may be shorter)."""
    target_hidden_dim: int
    """H x len(target_layer_ids)."""
    target_last_hidden_dim: int
    """H."""
    target_layer_ids: tuple[int, ...]
    """Captured layers, in concatenation order (a list in the JSON)."""
    train_data_path: str
    """Dataset path exactly as configured."""
    train_split: str | None
    """Split expression as configured."""
    shuffle_seed: int
    """As configured (recorded even where unused)."""
    mask_reasoning_content: bool
    """Reasoning blocks excluded from loss_mask."""
    mask_generation_prompt: bool
    """Assistant header tokens excluded from loss_mask."""
    chat_template_sha256: str
    """sha256 hex of the UTF-8 effective chat template."""
    complete: bool = False
    """Staged publish flag: a consumer refuses ``false``."""
    format_version: int = FORMAT_VERSION
    """Always 1."""
    bookkeeping: Mapping[str, Any] = field(default_factory=dict)
    """Extra top-level JSON fields that are not part of the run's identity (e.g. ``producer``)."""

    def __post_init__(self) -> None:
        # Frozen: normalise through object.__setattr__ so equal values compare equal.
        object.__setattr__(self, "target_layer_ids", tuple(self.target_layer_ids))
        object.__setattr__(self, "bookkeeping", dict(self.bookkeeping))
        clash = sorted(set(self.bookkeeping) & set(_FIELD_TYPES))
        assert not clash, f"bookkeeping keys {clash} collide with manifest fields"

    # -- JSON -------------------------------------------------------------------------------

    def to_json(self) -> str:
        """The file's text: ``json.dumps(indent=2, sort_keys=True)``, no trailing newline, as NeMo."""
        obj: dict[str, Any] = dict(self.bookkeeping)
        for name in _FIELD_TYPES:
            obj[name] = getattr(self, name)
        obj["target_layer_ids"] = list(self.target_layer_ids)
        return json.dumps(obj, indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, source: str) -> Manifest:
        """Parse a manifest; ``source`` (the file path) is named in every error."""
        obj = parse_json(text, source, "A cache manifest is a JSON object: delete the cache directory and re-run, "
                         "or point at the right directory.")
        if not isinstance(obj, dict):
            raise CaptureError(
                f"{source} holds a JSON {_json_type(obj)}, not an object; it is not a cache manifest."
            )
        values: dict[str, Any] = {}
        for name, kind in _FIELD_TYPES.items():
            if name not in obj:
                raise CaptureError(
                    f"{source} has no field '{name}' ({kind.label}); it is not a complete DSpark cache "
                    f"manifest (format v{FORMAT_VERSION}). Re-create the cache with a current producer."
                )
            value = obj[name]
            if not kind.accepts(value):
                raise CaptureError(
                    f"{source}: field '{name}' is {json.dumps(value)} ({_json_type(value)}), expected {kind.label}. "
                    "The manifest is damaged or from another tool; re-create the cache."
                )
            values[name] = value
        if values["format_version"] != FORMAT_VERSION:
            raise CaptureError(
                f"{source}: format_version is {values['format_version']}, this tool reads and writes "
                f"format {FORMAT_VERSION} only. Use a new cache_output_dir or a matching tool version."
            )
        if values["dtype"] not in DTYPES:
            raise CaptureError(
                f"{source}: field 'dtype' is {json.dumps(values['dtype'])}, expected one of {sorted(DTYPES)}."
            )
        bookkeeping = {k: v for k, v in obj.items() if k not in _FIELD_TYPES}
        return cls(**values, bookkeeping=bookkeeping)

    # -- identity and staging -----------------------------------------------------------------

    def identity_diff(self, other: Manifest) -> list[str]:
        """Names of the identity fields (all but format_version, complete, bookkeeping) that differ."""
        return [name for name in IDENTITY_FIELDS if getattr(self, name) != getattr(other, name)]

    def with_complete(self, complete: bool) -> Manifest:
        return dataclasses.replace(self, complete=complete)

    # -- shards -------------------------------------------------------------------------------

    @property
    def num_shards(self) -> int:
        return num_shards(self.num_samples, self.shard_size)

    def shard_rows(self, index: int) -> int:
        """Rows in shard ``index``: shard_size, except the last which may be shorter."""
        if not 0 <= index < self.num_shards:
            raise IndexError(f"shard index {index} out of range 0..{self.num_shards - 1}")
        return min(self.shard_size, self.num_samples - index * self.shard_size)

    def expected_shard_tensors(self, index: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """name -> (shape, dtype) of the four tensors shard ``index`` must hold, in file order."""
        n, S = self.shard_rows(index), self.seq_length
        cache_dtype = DTYPES[self.dtype]
        return {
            "input_ids": ((n, S), torch.int64),
            "loss_mask": ((n, S), torch.int64),
            "target_hidden_states": ((n, S, self.target_hidden_dim), cache_dtype),
            "target_last_hidden_states": ((n, S, self.target_last_hidden_dim), cache_dtype),
        }

    def expected_weight_tensors(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """name -> (shape, dtype) of the tensors in target_weights.safetensors."""
        shape = (self.target_vocab_size, self.hidden_size)
        return {name: (shape, DTYPES[self.dtype]) for name in WEIGHT_KEYS}

    def consistency_problems(self) -> list[str]:
        """Contradictions between fields (a manifest from a buggy or foreign writer)."""
        H, ids, L = self.hidden_size, self.target_layer_ids, self.num_hidden_layers
        problems = []
        if self.shard_size < 1 or self.num_samples < 0 or self.seq_length < 1:
            problems.append(
                f"shard_size {self.shard_size}, num_samples {self.num_samples} and seq_length "
                f"{self.seq_length} must be >= 1, >= 0 and >= 1"
            )
        if not ids or any(b <= a for a, b in zip(ids, ids[1:])) or ids[0] < -1 or ids[-1] > L - 1:
            problems.append(f"target_layer_ids {list(ids)} must be strictly increasing within -1..{L - 1}")
        if self.target_hidden_dim != H * len(ids):
            problems.append(f"target_hidden_dim {self.target_hidden_dim} != hidden_size {H} x {len(ids)} layer ids")
        if self.target_last_hidden_dim != H:
            problems.append(f"target_last_hidden_dim {self.target_last_hidden_dim} != hidden_size {H}")
        return problems


@dataclass(frozen=True)
class _Kind:
    """A JSON type a manifest field accepts (bool is not an int here, unlike in Python)."""

    label: str

    def accepts(self, value: Any) -> bool:
        is_int = isinstance(value, int) and not isinstance(value, bool)
        if self.label == "int":
            return is_int
        if self.label == "str":
            return isinstance(value, str)
        if self.label == "bool":
            return isinstance(value, bool)
        if self.label == "str or null":
            return value is None or isinstance(value, str)
        if self.label == "list of int":
            return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
        raise AssertionError(self.label)


def _json_type(value: Any) -> str:
    names = {bool: "bool", int: "int", float: "float", str: "str", list: "list", dict: "object", type(None): "null"}
    return names.get(type(value), type(value).__name__)


_INT, _STR, _BOOL = _Kind("int"), _Kind("str"), _Kind("bool")
# Every §3 field and its JSON type, in the table's order.
_FIELD_TYPES: dict[str, _Kind] = {
    "format_version": _INT,
    "target_model": _STR,
    "target_model_type": _STR,
    "target_vocab_size": _INT,
    "hidden_size": _INT,
    "num_hidden_layers": _INT,
    "seq_length": _INT,
    "dtype": _STR,
    "num_samples": _INT,
    "shard_size": _INT,
    "target_hidden_dim": _INT,
    "target_last_hidden_dim": _INT,
    "target_layer_ids": _Kind("list of int"),
    "train_data_path": _STR,
    "train_split": _Kind("str or null"),
    "shuffle_seed": _INT,
    "mask_reasoning_content": _BOOL,
    "mask_generation_prompt": _BOOL,
    "chat_template_sha256": _STR,
    "complete": _BOOL,
}

IDENTITY_FIELDS: tuple[str, ...] = tuple(n for n in _FIELD_TYPES if n not in ("format_version", "complete"))
