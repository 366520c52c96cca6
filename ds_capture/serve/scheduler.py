"""The queue between the HTTP threads and the lockstep loop, and which waiting requests share one forward.

In: ``generate`` requests from any number of trainer processes (:meth:`Scheduler.submit`, from the HTTP
server's threads). Out, to the loop on the listening rank (:meth:`Scheduler.take`): the oldest waiting request plus the
requests behind it of the same sequence length, up to ``max_rows`` rows in all, in arrival order; each answered
through its own future. Rows are independent in a causal target with its attention mask, so a request's rows give
the same states alone or beside others'; the tests check the answers bit for bit both ways.
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
    future: Future = field(default_factory=Future)
    enqueued: float = field(default_factory=time.monotonic)


class Scheduler:
    """A FIFO of :class:`Job` that batches compatible neighbours (see the module docstring)."""

    def __init__(self, *, max_rows: int, batch: bool = True) -> None:
        self.max_rows = max_rows
        self.batch = batch
        self._jobs: deque[Job] = deque()
        self._cond = threading.Condition()
        self._closed: str | None = None

    def submit(self, job: Job) -> Future:
        with self._cond:
            if self._closed is not None:
                job.future.set_exception(RuntimeError(self._closed))
                return job.future
            self._jobs.append(job)
            self._cond.notify()
        return job.future

    def depth(self) -> int:
        with self._cond:
            return len(self._jobs)

    def take(self, timeout_s: float) -> list[Job]:
        """Waiting jobs for one forward (empty after ``timeout_s`` with nothing to do)."""
        with self._cond:
            if not self._jobs:
                self._cond.wait(timeout_s)
            if not self._jobs:
                return []
            first = self._jobs.popleft()
            taken, rows = [first], first.request.num_rows
            if self.batch:
                kept: deque[Job] = deque()
                while self._jobs:
                    job = self._jobs.popleft()
                    fits = (job.request.seq_length == first.request.seq_length
                            and rows + job.request.num_rows <= self.max_rows)
                    if fits:
                        taken.append(job)
                        rows += job.request.num_rows
                    else:
                        kept.append(job)
                self._jobs = kept
            return taken

    def close(self, reason: str) -> None:
        """Refuse new jobs and fail the waiting ones with ``reason`` (the service is stopping)."""
        with self._cond:
            self._closed = reason
            while self._jobs:
                job = self._jobs.popleft()
                if not job.future.done():
                    job.future.set_exception(RuntimeError(reason))
            self._cond.notify_all()
