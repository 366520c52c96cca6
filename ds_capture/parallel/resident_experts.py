"""``capture.expert_storage: checkpoint``: routed experts stay in the checkpoint's quantized format on the device.

In:  a model on meta (plain, expert-parallel or AutoTP-sharded) and its :class:`~ds_capture.target.families.TargetInfo`.
Out: :func:`keep_experts_quantized` replaces every fused routed-experts parameter (``gate_up_proj``,
     ``down_proj``) whose checkpoint pieces are all quantized by a :class:`QuantizedExpertStack`: the loader
     (:func:`~ds_capture.target.checkpoint_reads.fill_from_checkpoint`) puts each owned expert's stored values and
     scales into it unchanged (FP8 + scales, FP4 packed + e8m0, INT4 packed + scales), and ``stack[e]``
     dequantizes expert ``e`` when the experts' own forward indexes it, just before its matmul
     (``F.linear(x, self.gate_up_proj[expert_idx])`` in transformers' eager experts).

The expert math is the model's own and the values are the ones dequantize-on-load produces: the same
fp32 ``value * scale`` (:func:`~ds_capture.target.quant.dequantize`), the same transformers conversion ops
fusing gate and up, one cast to the model dtype. So the cache is bit-identical to ``expert_storage:
dequantized`` in the same layout (tests/unit/test_resident_experts.py). transformers' ``eager`` experts
index one expert at a time (``stack[e]``: one expert dequantized per matmul); ``grouped_mm`` /
``batched_mm`` take the whole stack in one kernel, so for them the layer's local experts are dequantized
together at the start of that layer's experts forward and freed at its end (one layer's experts transient).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ds_capture.errors import CaptureError
from ds_capture.parallel.expert_parallel import moe_experts_modules
from ds_capture.target import quant
from ds_capture.target.families import TargetInfo

EXPERT_STORAGES = ("dequantized", "checkpoint")


class StoredExpertStack(nn.Module):
    """Stands in for one stacked experts parameter ``[E_local, ...]``: this rank's experts kept as the checkpoint
    stores them (values and covering scales), each rebuilt in the model dtype, exactly as dequantize-on-load
    builds it, when the forward indexes it (``stack[e]``). :class:`QuantizedExpertStack` (transformers' fused
    experts) and :class:`~ds_capture.parallel.packed_grouped_experts.PackedExpertStack` (NeMo's GroupedExperts)."""

    def __init__(self, name: str, like: torch.Tensor) -> None:
        super().__init__()
        self.name, self.dtype, self.shape = name, like.dtype, tuple(like.shape)
        self.num_local = self.shape[0]

    def numel(self) -> int:
        return self.num_local * int(torch.Size(self.shape[1:]).numel())

    @staticmethod
    def read_stored(qt: quant.QuantTensor, *, clip_cols: bool = False) -> tuple[quant.QuantTensor, quant.Region,
                                                                                tuple[Any, ...], int]:
        """One whole checkpoint piece as stored: ``(qt with its shape resolved, region, (stored, scale, origin,
        scale_origin), bytes read)``; ``clip_cols`` clips the region to the logical columns (packed FP4)."""
        qt, num_bytes = quant.resolve_shape(qt)
        region = quant.region_of(qt, None, 0, 0)
        if clip_cols and region.cols[1] > qt.shape[1]:
            region = quant.Region(region.rows, (region.cols[0], qt.shape[1]))
        parts = quant.read_parts(qt, region)
        stored, scale = parts[0], parts[1]
        num_bytes += stored.numel() * stored.element_size() + scale.numel() * scale.element_size()
        return qt, region, parts, num_bytes

    def __getitem__(self, expert: int | torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class QuantizedExpertStack(StoredExpertStack):
    """Stands in for one fused experts parameter: this rank's experts, stored as in the checkpoint."""

    def __init__(self, name: str, like: torch.Tensor) -> None:
        super().__init__(name, like)
        self.register_buffer("_anchor", torch.empty(0, device=like.device), persistent=False)  # follows to_empty
        self.templates: dict[str, quant.QuantTensor] = {}
        """Converter source pattern (gate, up, ...) -> its pieces' layout (every expert's is the same)."""
        self.converter: Any = None

    def put(self, slot: int, pattern: str, qt: quant.QuantTensor, converter: Any) -> int:
        """Read expert ``slot``'s ``pattern`` piece as stored (values + scales) into its slot; the bytes read."""
        qt, _, (stored, scale, _, _), num_bytes = self.read_stored(qt)
        if pattern not in self.templates:
            if self.templates and next(iter(self.templates.values())).scheme != qt.scheme:
                raise CaptureError(f"{qt.key}: the experts of {self.name} mix quantization schemes.")
            self.templates[pattern] = qt
            self.converter = converter
            device = self._anchor.device
            self.register_buffer(f"stored_{len(self.templates) - 1}", torch.empty(
                (self.num_local, *stored.shape), dtype=stored.dtype, device=device), persistent=False)
            self.register_buffer(f"scale_{len(self.templates) - 1}", torch.empty(
                (self.num_local, *scale.shape), dtype=scale.dtype, device=device), persistent=False)
        index = list(self.templates).index(pattern)
        template = self.templates[pattern]
        if template.shape != qt.shape or template.scheme != qt.scheme:
            raise CaptureError(f"{qt.key}: expert shape {list(qt.shape)} ({qt.scheme}) differs from "
                               f"{template.key}'s {list(template.shape)} ({template.scheme}) in {self.name}.")
        getattr(self, f"stored_{index}")[slot].copy_(stored)
        getattr(self, f"scale_{index}")[slot].copy_(scale)
        return num_bytes

    def __getitem__(self, expert: int | torch.Tensor) -> torch.Tensor:
        """Expert ``expert``'s fused weight in the model dtype, dequantized now (as dequantize-on-load does)."""
        from ds_capture.target.checkpoint_reads import convert_pieces

        e = int(expert)
        # One key per pattern that sorts as the checkpoint's keys of one expert do (the loader fuses in that order).
        keys = {pattern: pattern.replace("*", "0") for pattern in self.templates}
        pieces = {keys[pattern]: quant.dequantize(self.templates[pattern], getattr(self, f"stored_{i}")[e],
                                                  getattr(self, f"scale_{i}")[e])
                  for i, pattern in enumerate(self.templates)}
        fused = convert_pieces(self.converter, pieces, {key: pattern for pattern, key in keys.items()}, self.name)
        return fused[0].to(self.dtype)

    def dense(self) -> torch.Tensor:
        """Every local expert dequantized, stacked as the parameter it stands in for (``[E_local, ...]``)."""
        out = torch.empty(self.shape, dtype=self.dtype, device=self._anchor.device)
        for e in range(self.num_local):
            out[e] = self[e]
        return out

    def extra_repr(self) -> str:
        schemes = sorted({qt.scheme for qt in self.templates.values()})
        return f"{self.name}: {self.num_local} experts, {'/'.join(schemes) or 'empty'}, as {self.dtype}"


class ResidentQuantizedExperts(nn.Module):
    """Mixin placed in front of an experts class whose fused parameters are :class:`QuantizedExpertStack` s.

    ``eager`` experts index the stacks one expert at a time; any other implementation (``grouped_mm``,
    ``batched_mm``) gets the dense stacks as instance attributes for the duration of this forward.
    """

    resident_leaves: tuple[str, ...]

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        if (getattr(self.config, "_experts_implementation", None) or "eager") == "eager":
            return super().forward(*args, **kwargs)
        for leaf in self.resident_leaves:  # the instance dict wins over nn.Module's _modules lookup
            self.__dict__[leaf] = self._modules[leaf].dense()
        try:
            return super().forward(*args, **kwargs)
        finally:
            for leaf in self.resident_leaves:
                del self.__dict__[leaf]


_RESIDENT_CLASSES: dict[type, type] = {}


def _resident_class(cls: type) -> type:
    if cls not in _RESIDENT_CLASSES:
        _RESIDENT_CLASSES[cls] = type(f"ResidentQuantized{cls.__name__}", (ResidentQuantizedExperts, cls), {})
    return _RESIDENT_CLASSES[cls]


def keep_experts_quantized(model: nn.Module, target: TargetInfo) -> list[str]:
    """Swap each fused routed-experts parameter whose checkpoint pieces are all quantized for a
    :class:`QuantizedExpertStack` (before the weights load); returns the swapped parameter names.

    Call it after expert parallelism / AutoTP are applied (it keeps the EP rank's experts only).
    """
    from ds_capture.target.key_map import checkpoint_sources

    _, key_map, _ = checkpoint_sources(model, target)
    swapped = []
    for prefix, experts in moe_experts_modules(model, target.family):
        leaves = []
        for leaf, param in list(experts.named_parameters(recurse=False)):
            name = f"{prefix}.{leaf}"
            keys = key_map.sources.get(name, [])
            if not keys or name not in key_map.converter_of or not all(k in key_map.quantized for k in keys):
                continue
            del experts._parameters[leaf]
            experts.add_module(leaf, QuantizedExpertStack(name, param))
            leaves.append(leaf)
            swapped.append(name)
        if leaves:
            experts.__class__ = _resident_class(type(experts))
            experts.resident_leaves = tuple(leaves)
    return swapped


def refuse_resident_experts(family, storage: str, *, partitioned_ep: bool = False) -> None:
    """``checkpoint`` storage needs the transformers experts this module wraps; NeMo's ``GroupedExperts`` take
    dequantized stacked tensors, except in the layouts that partition everything but the experts
    (``partitioned_ep``: ``engine: fsdp2``, or ``engine: deepspeed`` with ZeRO-3, and ``distributed.ep_size`` = the
    world; :mod:`.packed_grouped_experts`)."""
    if storage == "checkpoint" and family.is_nemo and not partitioned_ep:
        raise CaptureError(
            f"capture.expert_storage: checkpoint keeps the routed experts in the checkpoint's format inside "
            f"transformers' fused experts; model_type {family.model_type!r} is built by NeMo AutoModel's class, whose "
            "GroupedExperts hold dequantized stacked tensors, except in the layouts that partition everything but "
            "the experts: engine: fsdp2, or engine: deepspeed with deepspeed_config zero_optimization.stage 3, with "
            "distributed.ep_size = the world size. Use one of those, or capture.expert_storage: dequantized."
        )


def check_expert_storage(storage: str, engine: str, world_size: int, *, ep_size: int = 1) -> None:
    """``checkpoint`` storage runs on the DeepSpeed engine's layouts (and one process), and on FSDP2's
    expert-parallel layout (``ep_size`` = the world: the experts are not sharded by FSDP2); plain FSDP2 is refused."""
    if storage not in EXPERT_STORAGES:
        raise CaptureError(f"capture.expert_storage: must be one of {', '.join(EXPERT_STORAGES)}, got {storage!r}.")
    if storage == "checkpoint" and engine == "fsdp2" and world_size > 1 and ep_size == 1:
        raise CaptureError(
            "capture.expert_storage: checkpoint keeps each rank's routed experts whole in the checkpoint's format, "
            "which FSDP2's dim-0 parameter sharding does not hold. Use engine: deepspeed with distributed.ep_size "
            "to shard the experts, or capture.expert_storage: dequantized with engine: fsdp2."
        )
