"""The read loop every engine shares: this rank's part of every mapped checkpoint tensor, copied into place.

In:  the :class:`~ds_capture.target.key_map.KeyMap` (which keys become which tensor), the destinations (name ->
     this rank's local tensor: a parameter, an FSDP2 chunk, a :class:`~ds_capture.parallel.resident_experts.
     QuantizedExpertStack`) and what the rank owns of each (:class:`OwnedSlice`).
Out: :func:`fill_from_checkpoint` -> every destination filled, and :class:`~ds_capture.target.tensor_io.LoadStats`.
     One tensor is mapped at a time and cloned out of the mapping (DESIGN §6); stacked experts are converted
     (:func:`convert_pieces`: transformers' own ops) and placed one expert at a time; quantized tensors are read
     as this rank's slice dequantized, or as stored into a resident stack; freed heap pages go back to the OS.
"""

from __future__ import annotations

import ctypes
from collections import defaultdict
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ds_capture.errors import CaptureError
from ds_capture.target import quant
from ds_capture.target.key_map import KeyMap
from ds_capture.target.tensor_io import LoadStats


@dataclass(frozen=True)
class OwnedSlice:
    """The part of one parameter this rank holds: ``length`` entries of ``dim`` from ``start`` (None: whole)."""

    dim: int | None = None
    start: int = 0
    length: int = 0
    experts: bool = False
    """``dim`` 0 is the expert dimension (a per-expert checkpoint list is cut instead of a tensor)."""


def _read_slice(handle: Any, key: str, owned: OwnedSlice | None) -> torch.Tensor:
    """This rank's slice of one checkpoint tensor, cloned out of the mapped file."""
    if owned is None:
        return handle.get_tensor(key).clone()
    view = handle.get_slice(key)
    index = [slice(None)] * len(view.get_shape())
    index[owned.dim] = slice(owned.start, owned.start + owned.length)
    return view[tuple(index)].clone()


@dataclass
class _ReadPlan:
    """What :func:`fill_from_checkpoint` reads, per file, and how each read reaches its destination."""

    reads: dict[Path, list[tuple[str, str, OwnedSlice | None]]] = field(default_factory=lambda: defaultdict(list))
    """File -> its reads in order: (checkpoint key, model tensor, this rank's slice of the key)."""
    pieces: dict[str, dict] = field(default_factory=dict)
    """Converted tensor -> the pieces collected so far (stacked experts: expert slot -> that expert's pieces)."""
    num_pieces: dict[str, int] = field(default_factory=dict)
    slot_of: dict[str, int] = field(default_factory=dict)
    """Checkpoint key of a stacked expert -> its slot among this rank's experts (placed one expert at a time, so a
    layer's experts are never held twice: pieces + stacked copy)."""
    num_patterns: dict[str, int] = field(default_factory=dict)
    placed: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    cut_after_convert: dict[str, OwnedSlice] = field(default_factory=dict)
    """A sliced tensor that a converter concatenates from several keys (KDA's q/k/v short convolutions into one
    conv1d) is read whole, converted, then cut: its pieces do not line up with the slice."""


def _plan_reads(index: dict[str, Path], key_map: KeyMap, owned: dict[str, OwnedSlice],
                packed: Collection[str]) -> _ReadPlan:
    """Per file, (checkpoint key, model tensor, slice). A converted tensor (fused experts) gathers one piece per
    owned expert; the pieces may sit in several files."""
    from transformers.core_model_loading import MergeModulelist

    plan = _ReadPlan()
    for name, keys in key_map.sources.items():
        cut = owned.get(name)
        if cut is not None and cut.length == 0:
            continue  # e.g. an FSDP2 rank past the last chunk of a small dim
        if name in packed:  # raw parts, one owned expert at a time
            keys = _owned_expert_keys(keys, key_map.pattern_of, cut)
            plan.slot_of.update(_expert_slots(keys, key_map.pattern_of))
            for key in keys:
                plan.reads[index[key]].append((key, name, None))
            continue
        if name in key_map.converter_of:
            stacked = isinstance(key_map.converter_of[name].operations[0], MergeModulelist)
            if cut is not None and not (cut.experts and stacked):
                plan.cut_after_convert[name], cut = cut, None
            keys = _owned_expert_keys(keys, key_map.pattern_of, cut)
            plan.pieces[name], plan.num_pieces[name], cut = {}, len(keys), None
            if stacked:
                plan.slot_of.update(_expert_slots(keys, key_map.pattern_of))
                plan.num_patterns[name] = len({key_map.pattern_of[key] for key in keys})
        for key in keys:
            plan.reads[index[key]].append((key, name, cut))
    return plan


@torch.no_grad()
def fill_from_checkpoint(index: dict[str, Path], key_map: KeyMap, destinations: dict[str, torch.Tensor],
                         owned: dict[str, OwnedSlice], packed: Collection[str] = ()) -> LoadStats:
    """Copy this rank's part of every mapped checkpoint tensor into ``destinations`` (name -> local tensor).

    ``owned`` gives the slice of a tensor this rank holds (absent: all of it; ``length`` 0: nothing); ``packed``
    names the destinations that keep the stored parts (a resident quantized stack's ``put``). Every
    read is one tensor mapped, sliced and copied; stacked experts are converted and placed one expert at a
    time; freed heap pages go back to the OS as the reads go (:func:`release_freed_memory`).
    """
    plan = _plan_reads(index, key_map, owned, packed)
    stats = LoadStats()
    read_since_trim = 0
    for path in sorted(plan.reads):
        for key, name, cut in plan.reads[path]:
            if read_since_trim >= _TRIM_EVERY_BYTES:
                release_freed_memory()
                read_since_trim = 0
            # One tensor mapped at a time: the pages a read touches count in RSS for as long as the file
            # stays mapped, so a file kept open would add up to its whole owned share to the peak.
            tensor = None
            if name in packed:
                num_bytes = destinations[name].put(plan.slot_of[key], key_map.pattern_of[key],
                                                   key_map.quantized[key], key_map.converter_of[name])
            else:
                tensor, num_bytes = _read_tensor(path, key, cut, key_map)
            stats.bytes_read += num_bytes
            read_since_trim += num_bytes
            stats.bytes_by_param[name] = stats.bytes_by_param.get(name, 0) + num_bytes
            if tensor is not None:
                _deliver(plan, key_map, destinations[name], key, name, tensor)
        stats.num_files += 1
    release_freed_memory()
    assert not plan.pieces, f"incomplete converted tensors: {sorted(plan.pieces)}"
    return stats


def _read_tensor(path: Path, key: str, cut: OwnedSlice | None, key_map: KeyMap) -> tuple[torch.Tensor, int]:
    """This rank's slice of one checkpoint tensor, and the bytes read for it."""
    from safetensors import safe_open

    if key in key_map.quantized:  # the stored bytes and scale blocks covering the slice, dequantized
        qt = key_map.quantized[key]
        region = quant.region_of(qt, cut.dim, cut.start, cut.length) if cut else quant.region_of(qt, None, 0, 0)
        return quant.read_dequantized(qt, region)
    with safe_open(path, framework="pt") as handle:
        tensor = _read_slice(handle, key, cut)
    return tensor, tensor.numel() * tensor.element_size()


def _deliver(plan: _ReadPlan, key_map: KeyMap, destination: torch.Tensor, key: str, name: str,
             tensor: torch.Tensor) -> None:
    """Copy one read into place: a stacked expert once its pieces are in, a converted tensor once all of its
    pieces are, anything else at once."""
    if key in plan.slot_of:
        if _place_expert(destination, plan.pieces[name], key, tensor, plan.slot_of[key], plan.num_patterns[name],
                         key_map.converter_of[name], key_map.pattern_of, name):
            plan.placed[name] += 1
            if plan.placed[name] * plan.num_patterns[name] == plan.num_pieces[name]:
                del plan.pieces[name]  # every owned expert of this tensor is in place
        return
    if name in plan.pieces:
        plan.pieces[name][key] = tensor
        if len(plan.pieces[name]) < plan.num_pieces[name]:
            return
        tensor = convert_pieces(key_map.converter_of[name], plan.pieces.pop(name), key_map.pattern_of, name)
        if name in plan.cut_after_convert:
            after = plan.cut_after_convert[name]
            tensor = tensor.narrow(after.dim, after.start, after.length).clone()
    _copy_checked(destination, tensor, name, key)


def release_freed_memory() -> None:
    """Hand freed heap pages back to the OS (glibc ``malloc_trim``; elsewhere a no-op).

    Here: every read is a short-lived copy (a slice, an expert's gate/up pieces and their fused stack). glibc serves
    them from its heap once they outgrow its mmap threshold and keeps the freed pages, fragmented between
    long-lived allocations: without this, ~0.06 of the checkpoint stayed resident on top of the parameters
    (benchmarks/load_memory.py). Called every ``_TRIM_EVERY_BYTES`` read and at the end. ``serve`` calls it
    every few seconds: its requests' tensors of every shape, freed by several threads, leave glibc's per-thread
    arenas fragmented, and a long-lived service's RSS crept up by ~1 MiB a minute without it.
    """
    global _MALLOC_TRIM
    if _MALLOC_TRIM is None:
        try:
            _MALLOC_TRIM = ctypes.CDLL(None).malloc_trim
        except (OSError, AttributeError):
            _MALLOC_TRIM = False
    if _MALLOC_TRIM:
        _MALLOC_TRIM(0)


_MALLOC_TRIM = None
_TRIM_EVERY_BYTES = 4 << 20


def _owned_expert_keys(keys: list[str], pattern_of: dict[str, str], cut: OwnedSlice | None) -> list[str]:
    """The checkpoint keys of this rank's experts: per source pattern (gate, up, ...), entries [start, +length)."""
    if cut is None:
        return keys
    by_pattern: dict[str, list[str]] = defaultdict(list)
    for key in keys:  # natural order: expert 0, 1, ..., E-1 within each pattern
        by_pattern[pattern_of[key]].append(key)
    return [key for group in by_pattern.values() for key in group[cut.start : cut.start + cut.length]]


def _expert_slots(keys: list[str], pattern_of: dict[str, str]) -> dict[str, int]:
    """Checkpoint key -> the index of its expert among this rank's (natural order within each pattern)."""
    seen: dict[str, int] = defaultdict(int)
    slots = {}
    for key in keys:
        slots[key] = seen[pattern_of[key]]
        seen[pattern_of[key]] += 1
    return slots


def _place_expert(destination: torch.Tensor, pieces: dict, key: str, tensor: torch.Tensor, slot: int,
                  num_patterns: int, converter: Any, pattern_of: dict[str, str], name: str) -> bool:
    """Collect one expert's pieces (gate, up, ...); once complete, convert and copy them into its slot.

    Returns True when the expert was placed."""
    group = pieces.setdefault(slot, {})
    group[key] = tensor
    if len(group) < num_patterns:
        return False
    fused = convert_pieces(converter, pieces.pop(slot), pattern_of, name)  # [1, ...]: one expert, stacked
    _copy_checked(destination[slot : slot + 1], fused, name, key)
    return True


def convert_pieces(converter: Any, pieces: dict[str, torch.Tensor], pattern_of: dict[str, str], name: str) -> torch.Tensor:
    """Run transformers' conversion ops (stack experts, concatenate gate/up) on this rank's pieces."""
    from transformers.core_model_loading import dot_natural_key

    collected: dict[str, list[torch.Tensor]] = defaultdict(list)
    for key in sorted(pieces, key=dot_natural_key):  # pieces arrive in file order, experts stack in index order
        collected[pattern_of[key]].append(pieces[key])
    result: dict[str, Any] = dict(collected)
    for op in converter.operations:
        result = op.convert(result, source_patterns=converter.source_patterns,
                            target_patterns=converter.target_patterns, full_layer_name=name)
    (tensor,) = result.values()
    return tensor


def _copy_checked(destination: torch.Tensor, tensor: torch.Tensor, name: str, key: str) -> None:
    if destination.shape != tensor.shape:
        raise CaptureError(
            f"{key}: checkpoint slice has shape {tuple(tensor.shape)} but {name} on this rank is "
            f"{tuple(destination.shape)}; the checkpoint does not match its config.json."
        )
    destination.copy_(tensor)  # casts to the model's dtype, as from_pretrained(dtype=...) does
