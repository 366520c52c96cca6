"""The queue between the HTTP threads and the lockstep loop: bounded admission, and what one forward takes.

In: ``generate`` requests from any number of trainer processes (:meth:`Scheduler.submit`, from the HTTP
server's threads). Out, to the loop on the listening rank (:meth:`Scheduler.take`): the oldest waiting request,
alone (the default: every request is forwarded in a computation of its own shape, so its answer is byte-identical
to the answer an idle service gives it, whatever else is in flight), or with ``batch=True`` (``--batch-requests``)
plus the requests behind it of the same sequence length, up to ``max_rows`` rows in all, in arrival order. A
request's rows then share a GEMM with other requests' rows; on a CPU a GEMM's row results can change with its row
count, so batched answers can differ from idle ones in the last bits (measured: docs/serve.md).

Admission (:meth:`Scheduler.hold` / :meth:`Scheduler.try_admit`): the queue holds at most ``max_queued_rows`` rows and ``max_queued_bytes``
request bytes. A request that does not fit waits for room (back-pressure: its connection is held, as NeMo's client
waits for any slow answer); only past ``hard_limit`` waiting or queued requests is it refused (503 with
``Retry-After``), a number no NeMo trainer reaches (each trainer keeps at most one request in flight per URL).

Every job taken by the loop is resolved exactly once (:func:`resolve`): answered, failed, or skipped when its
future was cancelled; :meth:`Scheduler.close` fails the queued ones *and* the taken ones not yet answered.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field

from ds_capture.serve.protocol import GenerateRequest
from ds_capture.serve.supervision import VocabMapping


@dataclass
class Job:
    """One ``generate`` waiting for (or in) a forward."""

    request: GenerateRequest
    mapping: VocabMapping
    nbytes: int = 0
    """The request body's size (what it holds in the queue)."""
    future: Future = field(default_factory=Future)
    enqueued: float = field(default_factory=time.monotonic)


_RESOLVING = threading.Lock()


def resolve(future: Future, *, result=None, error: BaseException | None = None) -> bool:
    """Set ``future``'s outcome once, cancel-safe: False (nothing raised) if it was cancelled or is resolved."""
    with _RESOLVING:  # the loop answering and close() failing the same taken job may race
        if future.done():
            return False
        if not future.running() and not future.set_running_or_notify_cancel():
            return False  # cancelled while pending: nobody waits for it
        if error is not None:
            future.set_exception(error if isinstance(error, Exception) else RuntimeError(str(error)))
        else:
            future.set_result(result)
    return True


def _start(future: Future) -> bool:
    """Mark a taken job's future running (False: it was cancelled, drop the job)."""
    with _RESOLVING:
        return future.set_running_or_notify_cancel()


class Stopping(RuntimeError):
    """The service is stopping: the request is answered 503."""


class QueueFull(Exception):
    """Past the hard limit: the request is refused with ``Retry-After``."""


class Scheduler:
    """A bounded FIFO of :class:`Job` (see the module docstring)."""

    def __init__(self, *, max_rows: int, batch: bool = False, max_queued_rows: int | None = None,
                 max_queued_bytes: int = 1 << 30, hard_limit: int = 256, hard_bytes: int = 4 << 30) -> None:
        self.max_rows = max_rows
        self.batch = batch
        self.max_queued_rows = max_queued_rows if max_queued_rows is not None else 4 * max_rows
        self.max_queued_bytes = max_queued_bytes
        self.hard_limit = hard_limit
        self.hard_bytes = hard_bytes
        self._jobs: deque[Job] = deque()
        self._taken: list[Job] = []
        self._rows = self._bytes = 0
        self._waiting = self._held_bytes = 0  # requests held for room (back-pressure), and their bodies
        self._cond = threading.Condition()
        self._closed: str | None = None

    def _fits(self, job: Job) -> bool:
        if not self._jobs:
            return True  # one request alone always fits (its size is capped by the body and row limits)
        return (self._rows + job.request.num_rows <= self.max_queued_rows
                and self._bytes + job.nbytes <= self.max_queued_bytes)

    def hold(self, nbytes: int = 0) -> None:
        """Count a request waiting for room (its connection held); :class:`QueueFull` past ``hard_limit``
        requests queued or held, or past ``hard_bytes`` of their bodies."""
        with self._cond:
            if self._closed is None and (len(self._jobs) + self._waiting >= self.hard_limit or (
                    self._waiting and self._bytes + self._held_bytes + nbytes > self.hard_bytes)):
                raise QueueFull(f"{len(self._jobs)} requests queued and {self._waiting} held for room "
                                f"({(self._bytes + self._held_bytes) / 2**20:,.0f} MiB of bodies)")
            self._waiting += 1
            self._held_bytes += nbytes

    def unhold(self, nbytes: int = 0) -> None:
        with self._cond:
            self._waiting -= 1
            self._held_bytes -= nbytes

    def try_admit(self, job: Job) -> Future | None:
        """Queue ``job`` if it fits (its future), None while the queue is full; failed at once if closed."""
        with self._cond:
            if self._closed is not None:
                resolve(job.future, error=Stopping(self._closed))
                return job.future
            if not self._fits(job):
                return None
            job.enqueued = time.monotonic()
            self._jobs.append(job)
            self._rows += job.request.num_rows
            self._bytes += job.nbytes
            self._cond.notify_all()
        return job.future

    def submit(self, job: Job) -> Future:
        """:meth:`try_admit`, waiting (this thread) while the queue is full."""
        self.hold(job.nbytes)
        try:
            while True:
                future = self.try_admit(job)
                if future is not None:
                    return future
                with self._cond:
                    self._cond.wait(0.05)
        finally:
            self.unhold(job.nbytes)

    def depth(self) -> int:
        with self._cond:
            return len(self._jobs)

    def held(self) -> int:
        with self._cond:
            return self._waiting

    def take(self, timeout_s: float) -> list[Job]:
        """Waiting jobs for one forward (empty after ``timeout_s`` with nothing to do); they count as taken
        until :meth:`done`."""
        with self._cond:
            if not self._jobs:
                self._cond.wait(timeout_s)
            # A job is marked running as it is taken; one whose future was cancelled while it waited is dropped.
            first = None
            while self._jobs and first is None:
                job = self._jobs.popleft()
                self._release(job)
                if _start(job.future):
                    first = job
            if first is None:
                self._cond.notify_all()
                return []
            taken, rows = [first], first.request.num_rows
            if self.batch:
                kept: deque[Job] = deque()
                while self._jobs:
                    job = self._jobs.popleft()
                    if (job.request.seq_length == first.request.seq_length
                            and rows + job.request.num_rows <= self.max_rows):
                        self._release(job)
                        if _start(job.future):
                            taken.append(job)
                            rows += job.request.num_rows
                    else:
                        kept.append(job)
                self._jobs = kept
            self._taken.extend(taken)
            self._cond.notify_all()  # room for the requests held back
            return taken

    def done(self, jobs: list[Job] | None = None) -> None:
        """Taken ``jobs`` are resolved (answered; None: every taken job). The loop takes the next forward's jobs
        while the last one's are answered, so several takes may be unanswered at once."""
        with self._cond:
            answered = {id(job) for job in jobs or ()}
            self._taken = [] if jobs is None else [job for job in self._taken if id(job) not in answered]

    def _release(self, job: Job) -> None:
        self._rows -= job.request.num_rows
        self._bytes -= job.nbytes

    def close(self, reason: str) -> None:
        """Refuse new jobs and fail the waiting and the taken-but-unanswered ones with ``reason``."""
        with self._cond:
            self._closed = reason
            pending = list(self._taken) + list(self._jobs)
            self._jobs.clear()
            self._taken = []
            self._rows = self._bytes = 0
            self._cond.notify_all()
        for job in pending:
            if not job.future.done():
                resolve(job.future, error=Stopping(reason))
