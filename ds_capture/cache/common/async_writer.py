"""Asynchronous shard writer: rows go to their place in the shard file as their micro-batch completes.

In: per micro-batch, the shard index, the rows' positions inside that shard, each row's real length and
the shard kind's tensors for those rows (captured states on any device, trimmed to the batch's computed
length). Out: shards written in place by one background thread through a shard kind
(:class:`ds_capture.cache.dspark.writer.DSparkShards`: ``open(index)`` -> ``ShardFile``, ``write_rows``,
``finish(index, shard)``), each finished as soon as its last row is written.

Memory is bounded independently of the shard size: a micro-batch's states leave the device at ``put``
(:mod:`ds_capture.cache.common.staging`) into one of ``max_in_flight`` host slots, and ``put`` blocks while every
slot is held (back-pressure on the forward loop). A slot is freed as soon as its rows are written, so the
writer holds at most ``max_in_flight`` micro-batches plus one open file descriptor and a 16-byte digest
per row of each open shard; a shard is never assembled in memory. A writer error is re-raised in the
forward loop at the next ``put`` (or at ``close``), with its cause, so a full disk stops the run; the
``.tmp`` files of unfinished shards are then deleted.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from typing import Protocol

import torch

from ds_capture.cache.common.shard_file import ShardFile
from ds_capture.cache.common.staging import HostStaging, Staged

_STOP = object()


@dataclass
class MicroBatch:
    """One forward's rows of shard ``shard_index``: their positions in it, real lengths and tensors.

    Shapes (B rows, T = computed length <= S): ``rows`` and ``num_tokens`` [B]; ``tensors`` maps each of
    the shard kind's tensor names to its rows, e.g. input_ids / loss_mask [B, S] int64, hidden [B, T, H*k],
    last [B, T, H]. Positions >= num_tokens of a zero-tail tensor are never written: they read as 0, so
    the cache does not depend on how rows were batched.
    """

    shard_index: int
    rows: torch.Tensor
    num_tokens: torch.Tensor
    tensors: dict[str, torch.Tensor]


class ShardKind(Protocol):
    """What the writer needs from a cache kind (the DSpark one is ``writer.DSparkShards``)."""

    def rows(self, index: int) -> int: ...
    def open(self, index: int) -> ShardFile: ...
    def finish(self, index: int, shard: ShardFile): ...


class AsyncShardWriter:
    """Background writer over ``staging``'s bounded slots; use as a context manager (``close`` joins it)."""

    def __init__(self, shards: ShardKind, staging: HostStaging, *, synchronous: bool = False) -> None:
        self.shards = shards
        self.staging = staging
        self.synchronous = synchronous
        self.bytes_written = 0
        """Bytes actually written (headers and real rows; padding tails are holes)."""
        self.logical_bytes = 0
        self.disk_bytes = 0
        self.shards_written = 0
        self.busy_seconds = 0.0
        """Time the writer spent writing, hashing and finishing shards (not waiting for work)."""
        self._open: dict[int, tuple[ShardFile, int]] = {}  # index -> (file, rows still to come)
        self._error: BaseException | None = None
        self._queue: queue.Queue = queue.Queue()
        self._thread = None
        if not synchronous:
            self._thread = threading.Thread(target=self._loop, name="ds_capture-writer", daemon=True)
            self._thread.start()

    @property
    def queue_depth(self) -> int:
        return self._queue.qsize()

    def put(self, batch: MicroBatch) -> None:
        """Stage one micro-batch off the device and hand it over; blocks while every slot is held."""
        self._raise_pending()
        while not self.staging.acquire(timeout=0.5):
            self._raise_pending()
        staged = self.staging.stage(batch.tensors)
        if self.synchronous:
            self._consume(batch, staged)
        else:
            self._queue.put((batch, staged))

    def close(self, *, partial: bool = False) -> None:
        """Write everything queued, stop the thread, and raise a writer error if there was one.

        ``partial``: the loop stopped early (a signal): shards that got all their rows are finished as usual,
        the ``.tmp`` of those still missing rows is deleted instead of being an error."""
        if self._thread is not None and self._thread.is_alive():
            self._queue.put(_STOP)
            self._thread.join()
        self._raise_pending()
        if partial:
            self._abort_open()
        assert not self._open, f"shards {sorted(self._open)} were never completed"

    def __enter__(self) -> "AsyncShardWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
            return
        if self._thread is not None and self._thread.is_alive():
            # Already failing: stop the thread without finishing half-written shards.
            self._error = self._error or exc
            self._queue.put(_STOP)
            self._thread.join(timeout=60)
        self._abort_open()

    def _raise_pending(self) -> None:
        if self._error is not None:
            self._abort_open()
            raise RuntimeError(f"the shard writer failed: {self._error}") from self._error

    def _abort_open(self) -> None:
        for shard, _ in self._open.values():
            shard.abort()
        self._open.clear()

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            batch, staged = item
            if self._error is not None:
                staged.release()  # drain without writing after a failure
                continue
            try:
                self._consume(batch, staged)
            except BaseException as error:  # noqa: BLE001 - reported to the forward loop
                self._error = error

    def _consume(self, batch: MicroBatch, staged: Staged) -> None:
        started = time.perf_counter()
        try:
            staged.wait()
            index = batch.shard_index
            if index not in self._open:
                opened = self.shards.open(index)
                self.bytes_written += opened.bytes_written  # its header
                self._open[index] = (opened, self.shards.rows(index))
            shard, remaining = self._open[index]
            before = shard.bytes_written
            shard.write_rows(batch.rows, staged.tensors, batch.num_tokens)
            self.bytes_written += shard.bytes_written - before
        finally:
            staged.release()
        remaining -= len(batch.rows)
        self._open[index] = (shard, remaining)
        if remaining == 0:
            del self._open[index]
            try:
                written = self.shards.finish(index, shard)
            except BaseException:
                shard.abort()
                raise
            self.logical_bytes += written.logical_bytes
            self.disk_bytes += written.disk_bytes
            self.shards_written += 1
        self.busy_seconds += time.perf_counter() - started
