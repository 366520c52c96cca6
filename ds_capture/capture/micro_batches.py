"""The micro-batches of ``run``: which rows each forward takes, and at what computed length.

In: this DP rank's tokenised rows, shard by shard, and the capture options (``sort_by_length``,
``pad_to_multiple_of``). Out: :class:`PlannedBatch` es in forward order. The plan depends only on the shard, so
every layout (single, DP, TP, EP, FSDP2) forwards exactly the same batches.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable

import torch

from ds_capture.parallel.layout import ParallelLayout
from ds_capture.recipe.config import RunConfig
from ds_capture.target.families import TargetInfo

_LOG = logging.getLogger("ds_capture")


@dataclass(frozen=True)
class PlannedBatch:
    """One forward: rows of one shard (their positions in it) computed at ``length`` <= seq_length."""

    shard_index: int
    rows: torch.Tensor
    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    num_tokens: torch.Tensor
    length: int

    def model_inputs(self) -> dict[str, torch.Tensor]:
        """The forward's inputs: the ids at the computed length, and no attention mask.

        Rows are right-padded and the target is causal, so no content position can see a padding
        position: the padding mask changes nothing there (bitwise, on every family's equality test), and
        without it attention takes its causal kernel (SDPA on CPU: ~20% less forward time at seq 1024).
        Padding positions' states are computed but never written."""
        return {"input_ids": self.input_ids[:, :self.length]}


def plan_micro_batches(shard_index: int, rows: tuple, batch_size: int, seq_length: int, options) -> list[PlannedBatch]:
    """The micro-batches of one shard.

    Rows are optionally sorted by length within the shard, and each batch is computed at its longest
    row rounded up to ``pad_to_multiple_of`` (0: at ``seq_length``).
    """
    input_ids, loss_mask, num_tokens = rows
    order = torch.arange(len(input_ids))
    if options.sort_by_length:
        order = torch.sort(num_tokens, descending=True, stable=True).indices
    batches = []
    for lo in range(0, len(order), batch_size):
        picked = order[lo:lo + batch_size]
        length = seq_length
        if options.pad_to_multiple_of:
            multiple = options.pad_to_multiple_of
            longest = max(1, int(num_tokens[picked].max()))
            length = min(seq_length, -(-longest // multiple) * multiple)
        batches.append(PlannedBatch(shard_index=shard_index, rows=picked, input_ids=input_ids[picked],
                                    loss_mask=loss_mask[picked].clone(), num_tokens=num_tokens[picked],
                                    length=length))
    return batches


def micro_batches_to_do(cfg: RunConfig, target: TargetInfo, plan: ParallelLayout, num_shards: int,
                        rows_of: Callable[[int], tuple], done_shards: Iterable[int]) -> tuple[Any, list[PlannedBatch]]:
    """This rank's micro-batches of the shards not done yet (``rows_of(index)``: a shard's rows), and the capture
    options they were planned with (``pad_to_multiple_of`` off where the family computes every row at
    ``seq_length``)."""
    args, options = cfg.recipe_args, cfg.capture
    if target.family.full_width and options.pad_to_multiple_of:
        _LOG.info("capture.pad_to_multiple_of %d does not apply to model_type %r: every row is computed at "
                  "seq_length %d (%s)", options.pad_to_multiple_of, target.model_type, args.seq_length,
                  target.family.width_reason)
        options = replace(options, pad_to_multiple_of=0)
    done = set(done_shards)
    todo = [index for index in plan.shard_range(num_shards) if index not in done]
    return options, [batch for index in todo for batch in plan_micro_batches(
        index, rows_of(index), args.micro_batch_size, args.seq_length, options)]
