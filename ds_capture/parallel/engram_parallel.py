"""Row-parallel lookup tables (DeepSeek-V4.1's Engram): a table's rows split over a group, every lookup exact.

In:  a plain (NeMo-built) causal LM on ``meta``, its :class:`~ds_capture.target.family.Family` (the decoder-layer-
     relative ``row_parallel_tables``) and the group / size / this rank's index in it (the DeepSpeed engine: WORLD,
     DP ranks included; ``ds-capture plan``: no group, the layout's world size).
Out: the same model, every such table (``embed(ids [...]) -> [..., D]``, weight ``[rows, D]``) replaced by a
     :class:`RowParallelTable` holding rows ``[rank * R, (rank + 1) * R)``, ``R = ceil(rows / size)`` (the last
     rank's rows past the table stay zero); the loader reads them from the shard spec (:mod:`.shard_spec`).

Its forward is a collective (every rank of the group calls it the same number of times, with ids of any shape):

1. each id goes to the rank owning its row (``all_to_all_single`` with uneven splits, the counts exchanged first),
2. the owner copies its rows out (``F.embedding``),
3. the rows come back along the reversed splits and are put back in request order.

Each value is a copy of the owner's row (nothing is summed, so even ``-0.0`` and NaN survive): the result is
bitwise the whole table's lookup. Sending each id to its owner alone moves ``N x D`` values per rank, where
all-gathering every rank's ids and summing partial lookups would move ``size x N x D``.

Legend: N = ids on this rank, M = ids received from all ranks, D = embedding dim.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ds_capture.parallel.all_to_all import all_to_all_rows, exchange_counts
from ds_capture.target.family import Family, get_submodule


class RowParallelTable(nn.Module):
    """One table's rows ``[row_start, row_start + rows_per_rank)``; the lookup is a collective over the group."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, group: Any, group_size: int, group_rank: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.group_size, self.group_rank = group_size, group_rank
        # NeMo's DeepseekV41Engram all-reduces its id check over `embed.process_group`: every rank fails together.
        self.process_group = group
        self.rows_per_rank = -(-num_embeddings // group_size)
        self.row_start = group_rank * self.rows_per_rank
        self.num_owned_rows = max(0, min(self.rows_per_rank, num_embeddings - self.row_start))
        self.weight = nn.Parameter(torch.empty(self.rows_per_rank, embedding_dim, dtype=dtype, device=device),
                                   requires_grad=False)

    @property
    def owned_rows(self) -> dict[str, tuple[int, int]]:
        """Leaf -> ``(first row, rows)`` of the checkpoint table this rank holds (the loader reads only those;
        the local rows past them are padding, kept zero)."""
        return {"weight": (self.row_start, self.num_owned_rows)}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        shape = ids.shape
        flat = ids.reshape(-1).long()  # [N]
        owner = torch.div(flat, self.rows_per_rank, rounding_mode="floor")
        order = torch.argsort(owner, stable=True)
        send_counts = torch.bincount(owner, minlength=self.group_size)
        # Every rank of the group must enter these all-to-alls, also with no ids for some peer (or none at all).
        recv_counts = exchange_counts(send_counts, self.process_group)
        send_splits, recv_splits = send_counts.tolist(), recv_counts.tolist()
        recv_ids = all_to_all_rows(flat[order], send_splits, recv_splits, self.process_group)  # [M]
        rows = F.embedding(recv_ids - self.row_start, self.weight)  # [M, D]: only rows this rank owns
        back = all_to_all_rows(rows, recv_splits, send_splits, self.process_group)  # [N, D], in owner order
        out = torch.empty_like(back)
        out[order] = back
        return out.view(*shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return (f"rows [{self.row_start}, {self.row_start + self.num_owned_rows}) of {self.num_embeddings}, "
                f"dim {self.embedding_dim}, group {self.group_rank}/{self.group_size}")


def row_parallel_tables(model: nn.Module, family: Family) -> list[tuple[str, nn.Module]]:
    """``(qualified name, table)`` of every ``family.row_parallel_tables`` entry present in a decoder layer."""
    found = []
    for index, layer in get_submodule(model, family.layers).named_children():
        for path in family.row_parallel_tables:
            try:
                found.append((f"{family.layers}.{index}.{path}", layer.get_submodule(path)))
            except AttributeError:
                continue  # this layer has no such table (V4.1: Engram at layers 1 and 14 only)
    return found


def apply_engram_row_parallel(model: nn.Module, family: Family, *, group: Any, group_size: int,
                              group_rank: int) -> nn.Module:
    """Replace every ``family.row_parallel_tables`` table of the meta ``model`` by this rank's
    :class:`RowParallelTable` (``group`` None: a meta layout for ``ds-capture plan``, never run).
    ``group_size == 1`` or a family without such tables returns the model unchanged."""
    if group_size == 1 or not family.row_parallel_tables:
        return model
    tables = row_parallel_tables(model, family)
    if not tables:
        raise AssertionError(f"family {family.model_type!r}: no table {family.row_parallel_tables} in any layer "
                             f"of {family.layers}")
    for name, table in tables:
        weight = table.weight
        assert weight.is_meta and weight.dim() == 2, (name, weight.device, tuple(weight.shape))
        parent, _, leaf = name.rpartition(".")
        replacement = RowParallelTable(weight.shape[0], weight.shape[1], group=group, group_size=group_size,
                                       group_rank=group_rank, dtype=weight.dtype, device=weight.device)
        setattr(model.get_submodule(parent), leaf, replacement)
    return model
