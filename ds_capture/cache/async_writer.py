"""Asynchronous shard writer: assembles micro-batches into shards and writes them off the forward loop.

In: per micro-batch, the shard index, the rows' positions inside that shard and the captured
tensors (on any device, trimmed to the batch's computed length). Out: shards written with
:func:`ds_capture.cache.writer.write_shard` by one background thread, in the order they complete.

Memory is bounded: the queue holds at most ``queue_shards`` shards' worth of micro-batches
(``put`` blocks when it is full: back-pressure on the forward loop), plus the one shard being
assembled and the one being written. A writer error is re-raised in the forward loop at the next
``put`` (or at ``close``), with its cause, so a full disk stops the run instead of being lost.
Device-to-host copies happen in the writer thread too.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ds_capture.cache.format import Manifest
from ds_capture.cache.writer import write_shard

_STOP = object()


@dataclass
class MicroBatch:
    """One forward's rows: row positions inside shard ``shard_index`` and the captured tensors.

    Shapes (B rows, T = computed length <= S): input_ids / loss_mask [B, S] int64,
    hidden [B, T, H*k], last [B, T, H], num_tokens [B]. Positions >= num_tokens are padding and are
    written as 0 in both hidden-state tensors, so the cache does not depend on how rows were batched.
    """

    shard_index: int
    rows: torch.Tensor
    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    num_tokens: torch.Tensor
    hidden: torch.Tensor
    last: torch.Tensor


class _Shard:
    def __init__(self, manifest: Manifest, index: int) -> None:
        self.index = index
        self.tensors = {name: torch.zeros(shape, dtype=dtype)
                        for name, (shape, dtype) in manifest.expected_shard_tensors(index).items()}
        self.remaining = manifest.shard_rows(index)

    def put(self, batch: MicroBatch) -> None:
        length = batch.hidden.shape[1]
        # Zero the padding positions: [B, T] mask of content positions.
        content = (torch.arange(length)[None, :] < batch.num_tokens[:, None]).unsqueeze(-1)
        hidden = batch.hidden.cpu() * content
        last = batch.last.cpu() * content
        rows = batch.rows
        self.tensors["input_ids"][rows] = batch.input_ids
        self.tensors["loss_mask"][rows] = batch.loss_mask
        self.tensors["target_hidden_states"][rows, :length] = hidden
        self.tensors["target_last_hidden_states"][rows, :length] = last
        self.remaining -= len(rows)


class AsyncShardWriter:
    """Background writer with a bounded queue; use as a context manager (``close`` joins it)."""

    def __init__(self, out_dir: Path, manifest: Manifest, *, queue_shards: int, batches_per_shard: int,
                 synchronous: bool = False) -> None:
        self.out_dir = Path(out_dir)
        self.manifest = manifest
        self.synchronous = synchronous
        self.bytes_written = 0
        self.shards_written = 0
        self.write_seconds = 0.0
        self._shards: dict[int, _Shard] = {}
        self._error: BaseException | None = None
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, queue_shards * batches_per_shard))
        self._thread = None
        if not synchronous:
            self._thread = threading.Thread(target=self._loop, name="ds_capture-writer", daemon=True)
            self._thread.start()

    @property
    def queue_depth(self) -> int:
        return self._queue.qsize()

    def put(self, batch: MicroBatch) -> None:
        """Hand one micro-batch over; blocks while the queue is full; raises a pending writer error."""
        self._raise_pending()
        if self.synchronous:
            self._consume(batch)
            return
        while True:
            try:
                self._queue.put(batch, timeout=0.5)
                return
            except queue.Full:
                self._raise_pending()

    def close(self) -> None:
        """Write everything queued, stop the thread, and raise a writer error if there was one."""
        if self._thread is not None and self._thread.is_alive():
            self._queue.put(_STOP)
            self._thread.join()
        self._raise_pending()
        incomplete = [index for index, shard in self._shards.items() if shard.remaining]
        assert not incomplete, f"shards {incomplete} were never completed"

    def __enter__(self) -> "AsyncShardWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        elif self._thread is not None and self._thread.is_alive():
            # Already failing: stop the thread without writing half-assembled shards.
            self._error = self._error or exc
            self._queue.put(_STOP)
            self._thread.join(timeout=60)

    def _raise_pending(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"the shard writer failed: {self._error}") from self._error

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            if self._error is not None:
                continue  # drain without writing after a failure
            try:
                self._consume(item)
            except BaseException as error:  # noqa: BLE001 - reported to the forward loop
                self._error = error

    def _consume(self, batch: MicroBatch) -> None:
        shard = self._shards.get(batch.shard_index)
        if shard is None:
            shard = self._shards[batch.shard_index] = _Shard(self.manifest, batch.shard_index)
        shard.put(batch)
        if shard.remaining == 0:
            started = time.perf_counter()
            self.bytes_written += write_shard(self.out_dir, shard.index, shard.tensors, self.manifest)
            self.write_seconds += time.perf_counter() - started
            self.shards_written += 1
            del self._shards[shard.index]
