"""The shard spec: what one rank holds of every parameter and buffer, one value the loaders and ``plan`` both read.

In:  filled by the parallel stage from the layout it applied (:func:`ds_capture.parallel.shard_spec.build_shard_spec`,
     on the engine's model or on ``plan``'s meta model); this stage only reads it.
Out: :class:`ShardSpec`: per tensor name its :class:`Placement` (absent: whole on every rank), the tensors kept packed
     as released (:attr:`ShardSpec.packed`) and the gathers the layout does in the forward; :meth:`ShardSpec.cut` ->
     the :class:`~ds_capture.target.checkpoint_reads.OwnedSlice` a loader reads for this rank,
     :meth:`ShardSpec.local_numel` -> the elements any rank holds (``plan`` counts every rank from rank 0's spec).

Placements:
  split  ``sizes[i]`` entries of ``dim`` on member ``i`` of the tensor's group (``tp``: AutoTP or the family's TP
         plan, a row or column slice; ``ep``: a block of experts; ``world``: a row-parallel table, rows padded to
         ``sizes[i]`` of which the checkpoint's first ``total`` rows are read);
  chunk  FSDP2's ``Shard(0)``: dim 0 cut like ``torch.chunk`` over the world;
  flat   ZeRO-3: the flattened tensor, ``ceil(numel / world)`` elements per rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping

from ds_capture.target.checkpoint_reads import OwnedSlice


@dataclass(frozen=True)
class Member:
    """A rank's index in each group a placement may name (``world``: the rank itself)."""

    rank: int = 0
    world_size: int = 1
    tp_rank: int = 0
    ep_rank: int = 0

    def index(self, group: str) -> int:
        return {"tp": self.tp_rank, "ep": self.ep_rank, "world": self.rank}[group]


@dataclass(frozen=True)
class Placement:
    """How one tensor is split over the ranks (see the module docstring)."""

    kind: str
    """``split``, ``chunk`` or ``flat``."""
    dim: int = 0
    sizes: tuple[int, ...] = ()
    group: str = "tp"
    experts: bool = False
    """``dim`` 0 is the expert dimension (a per-expert checkpoint list is cut instead of a tensor)."""
    total: int | None = None
    """``split`` over ``world`` of a row-parallel table: the checkpoint's rows (the last members' rows are padding)."""

    def local_numel(self, shape: tuple[int, ...], member: Member) -> int:
        """Elements ``member`` holds of a tensor built as ``shape`` (see :meth:`ShardSpec.local_numel`)."""
        if self.kind == "flat":
            return -(-math.prod(shape) // member.world_size)
        if self.kind == "chunk":
            return math.prod(shape[1:]) * dim0_chunk(shape[0], member.world_size, member.rank)[1]
        return math.prod(s for d, s in enumerate(shape) if d != self.dim) * self.sizes[member.index(self.group)]

    def describe(self) -> str:
        if self.kind == "split" and self.experts:
            return f"experts/{self.group}"
        if self.kind == "split":
            return f"{('rows', 'columns')[min(self.dim, 1)]}/{self.group}"
        return {"chunk": "dim-0 chunk/world", "flat": "flat partition/world"}[self.kind]


@dataclass(frozen=True)
class ShardSpec:
    """What this rank (``member``) holds: every tensor not in ``placements`` is whole on every rank."""

    placements: Mapping[str, Placement] = field(default_factory=dict)
    packed: frozenset[str] = frozenset()
    """Tensors held as the checkpoint stores them (quantized experts resident, NeMo's experts packed as released):
    the loader puts the stored parts into the module of that name."""
    gathers: tuple[str, ...] = ()
    """What the layout communicates in the forward (all-gathers, all-reduces, all-to-alls), in words."""
    member: Member = Member()

    def placement(self, name: str) -> str:
        """``whole``, ``packed``, or the placement's :meth:`Placement.describe` (``rows/tp``, ``experts/ep``...)."""
        if name in self.placements:
            return self.placements[name].describe() + (" packed" if name in self.packed else "")
        return "packed" if name in self.packed else "whole"

    def cut(self, name: str, rows: int | None = None) -> OwnedSlice | None:
        """The part of checkpoint tensor ``name`` this rank reads (None: all of it; ``length`` 0: nothing).

        ``rows``: the whole tensor's dim 0 (needed by ``chunk`` only). ``flat`` is cut by ZeRO-3's own partitions."""
        place = self.placements.get(name)
        if place is None or place.kind == "flat":
            return None
        if place.kind == "chunk":
            start, length = dim0_chunk(rows, self.member.world_size, self.member.rank)
            return None if length == rows else OwnedSlice(dim=0, start=start, length=length, experts=place.experts)
        index = self.member.index(place.group)
        start, length = sum(place.sizes[:index]), place.sizes[index]
        if place.total is not None:
            length = max(0, min(length, place.total - start))
        return OwnedSlice(dim=place.dim, start=start, length=length, experts=place.experts)

    def rows(self, whole_rows: Mapping[str, int] | None = None) -> dict[str, tuple[int, int]]:
        """Name -> ``(first row, rows)`` of dim 0 read, for every dim-0 cut this rank holds only part of (the NeMo
        loaders' form). ``whole_rows``: the whole tensors' dim 0, for FSDP2's chunks (a chunk not named: skipped)."""
        out = {}
        for name, place in self.placements.items():
            if place.kind == "chunk" and name not in (whole_rows or {}):
                continue
            cut = self.cut(name, (whole_rows or {}).get(name))
            if cut is not None and cut.dim == 0:
                out[name] = (cut.start, cut.length)
        return out

    def local_numel(self, name: str, shape: tuple[int, ...], member: Member | None = None) -> int:
        """Elements ``member`` (default: this spec's) holds of ``name``; ``shape``: the tensor as this spec's model
        built it (a ``split`` tensor's built size along ``dim`` does not matter: ``sizes`` decide)."""
        place = self.placements.get(name)
        return place.local_numel(shape, member or self.member) if place else math.prod(shape)


def dim0_chunk(rows: int, world_size: int, rank: int) -> tuple[int, int]:
    """(first row, number of rows) of dim 0 that ``rank`` holds: ``torch.chunk``'s split, as FSDP2 cuts ``Shard(0)``.

    ``ceil(rows / world_size)`` per rank; the last ranks short or empty."""
    per_rank = -(-rows // world_size)
    start = min(rank * per_rank, rows)
    return start, min(per_rank, rows - start)
