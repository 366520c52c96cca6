"""The row exchange every routed layer uses (transformers' and NeMo's expert parallelism, row-parallel tables).

In:  per-destination row counts, rows already sorted by destination rank, a process group.
Out: :func:`exchange_counts` -> the counts every peer sends here; :func:`all_to_all_rows` -> the rows received
(``[sum(recv_splits), *row shape]``), in source-rank order. Both are collectives: every rank of the group enters
them, also with zero rows for some peer (or none at all). The return trip is the same call with the splits swapped.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def exchange_counts(send_counts: torch.Tensor, group: Any) -> torch.Tensor:
    """``send_counts [world, ...]`` (rows for each destination) -> what each source sends here, same shape."""
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    return recv_counts


def all_to_all_rows(rows: torch.Tensor, send_splits: list[int], recv_splits: list[int], group: Any) -> torch.Tensor:
    """Send ``rows`` (grouped by destination, ``send_splits[r]`` for rank r); return the ``sum(recv_splits)`` rows
    received."""
    received = rows.new_empty(sum(recv_splits), *rows.shape[1:])
    dist.all_to_all_single(received, rows.contiguous(), recv_splits, send_splits, group=group)
    return received
