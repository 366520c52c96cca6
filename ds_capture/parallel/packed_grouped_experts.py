"""``capture.expert_storage: checkpoint`` for NeMo's ``GroupedExperts`` (Kimi K3's MXFP4, DeepSeek-V4.1's FP4 experts).

In:  an expert-parallel meta model (:mod:`.grouped_experts`: each ``GroupedExperts`` holds its rank's E/ep experts
     ``gate_and_up_projs [L, D, 2I]`` and ``down_projs [L, I, D]``).
Out: :func:`keep_grouped_experts_packed` replaces those two parameters by :class:`PackedExpertStack` modules: the
     loader (:func:`~ds_capture.target.nemo_models.fill_from_release`) hands each owned expert's release pieces
     (``w1`` / ``w3`` / ``w2``, or V4.1's ``w1`` / ``w3`` / ``w2``) to :meth:`PackedExpertStack.put`, which keeps their
     stored bytes and scales as released; ``stack[l]`` rebuilds local expert ``l`` in the model dtype when the
     expert-parallel forward indexes it (one expert's scratch, freed after its two GEMMs).

The rebuild is the dequantize-on-load path, piece by piece: :func:`~ds_capture.target.quant.dequantize` over the
same stored window (fp32 ``value * scale``), cut to the region, cast to the model dtype
(:func:`~ds_capture.target.nemo_release.read_release_tensor`), narrowed / transposed
(:func:`~ds_capture.target.nemo_release.transform`) and copied into its region of the expert. Elementwise the same
operations on the same values, so the expert is bitwise the one the dequantized path holds, and so is the cache
(tests/distributed/test_nemo_family_layouts.py). The expert-parallel forward reads experts only by ``stack[l]``
(``.to(dtype)`` returns a view that casts each expert as it is built).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ds_capture.errors import CaptureError
from ds_capture.parallel.resident_experts import StoredExpertStack
from ds_capture.target import quant

STACKED = ("gate_and_up_projs", "down_projs")


class PackedExpertStack(StoredExpertStack):
    """Stands in for one stacked ``GroupedExperts`` parameter: this rank's experts as stored in the release."""

    def __init__(self, name: str, like: torch.Tensor, first_expert: int) -> None:
        super().__init__(name, like)
        self.first_expert = first_expert
        self.device = like.device
        """Where the packed parts and the rebuilt experts live: set by the loader (no buffer: nothing to init)."""
        self.pieces: list[list[tuple[Any, ...]]] = [[] for _ in range(self.num_local)]

    def put(self, placement: Any, qt: quant.QuantTensor, dtype: torch.dtype) -> tuple[int, int]:
        """Keep one release piece of an owned expert as stored (values + covering scales); (bytes read, elements
        of the expert it fills). ``dtype``: the model dtype the dequantized path rounds to first."""
        if placement.expert is None or placement.narrow is not None:
            raise AssertionError(f"{self.name}: a packed expert piece must be one whole expert tensor ({placement})")
        qt, region, (stored, scale, origin, scale_origin), num_bytes = self.read_stored(qt, clip_cols=True)
        device = self.device
        piece = (placement, qt, region, stored.to(device), scale.to(device), origin, scale_origin, dtype)
        self.pieces[placement.expert - self.first_expert].append(piece)
        return num_bytes, (region.rows[1] - region.rows[0]) * (region.cols[1] - region.cols[0])

    def packed_bytes(self) -> int:
        return sum(p[3].numel() * p[3].element_size() + p[4].numel() * p[4].element_size()
                   for pieces in self.pieces for p in pieces)

    def __getitem__(self, local: int | torch.Tensor) -> torch.Tensor:
        """Local expert ``local`` in the model dtype, rebuilt now exactly as dequantize-on-load placed it."""
        from ds_capture.target.nemo_release import transform

        out = torch.empty(self.shape[1:], dtype=self.dtype, device=self.device)
        for placement, qt, region, stored, scale, origin, scale_origin, dtype in self.pieces[int(local)]:
            window = quant.dequantize(qt, stored, scale, origin, scale_origin)
            r0, c0 = region.rows[0] - origin[0], region.cols[0] - origin[1]
            value = window[r0 : r0 + region.rows[1] - region.rows[0], c0 : c0 + region.cols[1] - region.cols[0]]
            value = transform(placement, value.to(dtype))
            (out[placement.index] if placement.index else out).copy_(value)
        return out

    def to(self, *args: Any, **kwargs: Any) -> Any:  # noqa: D102 - the forward's ``stack.to(compute_dtype)``
        dtype = args[0] if args and isinstance(args[0], torch.dtype) else kwargs.get("dtype")
        if dtype is None:
            return super().to(*args, **kwargs)
        return _CastView(self, dtype)

    def extra_repr(self) -> str:
        return f"{self.name}: {self.shape[0]} experts from {self.first_expert}, {list(self.shape[1:])} {self.dtype}"


class _CastView:
    """``stack.to(dtype)``: expert ``l`` rebuilt, then cast (the dequantized path casts the whole stack)."""

    def __init__(self, stack: PackedExpertStack, dtype: torch.dtype) -> None:
        self.stack, self.dtype = stack, dtype

    def __getitem__(self, local: int | torch.Tensor) -> torch.Tensor:
        return self.stack[local].to(self.dtype)


def keep_grouped_experts_packed(model: nn.Module) -> list[str]:
    """Replace the stacked expert parameters of every expert-parallel ``GroupedExperts`` by a
    :class:`PackedExpertStack` (on meta, before loading); the replaced names, for the loader."""
    from ds_capture.parallel.grouped_experts import ExpertParallelGroupedExperts

    replaced = []
    for name, module in model.named_modules():
        if not isinstance(module, ExpertParallelGroupedExperts):
            continue
        for leaf in STACKED:
            like = getattr(module, leaf)
            delattr(module, leaf)
            setattr(module, leaf, PackedExpertStack(f"{name}.{leaf}", like, module.expert_start))
            replaced.append(f"{name}.{leaf}")
    if not replaced:
        raise CaptureError("capture.expert_storage: checkpoint: the model has no expert-parallel GroupedExperts; "
                           "NeMo-built families keep their experts packed only with engine: fsdp2 and "
                           "distributed.ep_size equal to the world size.")
    return replaced


def packed_stacks(model: nn.Module) -> dict[str, PackedExpertStack]:
    """Native name -> stack, for every :class:`PackedExpertStack` of ``model``."""
    return {name: module for name, module in model.named_modules() if isinstance(module, PackedExpertStack)}
