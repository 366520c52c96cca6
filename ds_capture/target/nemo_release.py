"""Where one release tensor goes in a NeMo-built model: the per-tensor form of NeMo's ``from_hf`` adapters.

In:  nothing (data). Out: :class:`Placement`, what a family's ``release_placement(key, config)`` returns for one
(logical) release key, and :meth:`Placement.apply`, the tensor's own transform before it is copied in place.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Placement:
    """One release tensor's destination: ``native[expert][index] = apply(tensor)``."""

    native: str
    """The NeMo model's state-dict name."""
    expert: int | None = None
    """Global expert id when the release tensor is one expert's piece of a stacked ``[E, ...]`` tensor."""
    index: tuple = ()
    """Slices inside ``native[expert]`` (or ``native``) the tensor fills; ``()``: all of it."""
    transpose: bool = False
    """Transpose the last two dims first (NeMo's stacked experts hold ``W^T``)."""
    narrow: tuple[int, int, int] | None = None
    """``(dim, start, length)`` kept of the release tensor first (Kimi K3's zero-padded ``A_log``)."""

    def apply(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.narrow is not None:
            tensor = tensor.narrow(*self.narrow)
        return tensor.transpose(-2, -1) if self.transpose else tensor
