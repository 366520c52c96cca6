"""Preemption and Ctrl-C: SIGTERM or SIGINT on any rank stops every rank at the same micro-batch boundary.

In:  the signals this process receives while a run is under way (:class:`StopOnSignal`, entered by the runner
     around the whole run) and, at the top of every loop step, every rank's ballot (:meth:`StopVote.cast`; the
     drivers cast theirs through ``session.Lockstep``, whose ballots carry the step's micro-batches too).
Out: ``True`` from ``should_stop`` on every rank at the same step once any rank received a signal; the runner
     then lets the writer finish the shards whose rows are all written (with their checksum sidecars), deletes
     the ``.tmp`` of the others, and raises :class:`Interrupted` (a ``SystemExit`` with
     ``errors.RERUN_EXIT_CODE``, 75), which unwinds through the lock release and the process-group teardown.

Why a vote: a rank must not stop alone (its peers would wait for it in the next collective until the timeout),
and Slurm signals every task but not at the same instant. Each step every rank all-gathers its ballot
``[got SIGINT, got SIGTERM, ...]`` over a gloo side group, asynchronously, and reads the ballots cast
``VOTE_LAG_STEPS`` steps earlier: every rank reads the same sums at the same step,
the read waits on an all-gather that finished long ago (no device sync, no stall of the forward), and ranks of
a data-parallel job can still drift that many steps apart as they could before. The same collective carries what
the drivers' ranks agree on each step (:class:`ds_capture.session.Lockstep`): one control collective a step.

A second signal ends the process at once: the first restores the default action. No Python runs then, but no
final name can hold a partial file (every file is written to ``<name>.tmp`` and renamed whole), and the lock
left behind names a dead pid, so the rerun reclaims it. Once the stop is safe on disk (the writer closed), a
further signal exits 75 at once instead (:meth:`StopOnSignal.finishing`): launchers (torchrun, ``deepspeed``,
``srun --kill-on-bad-exit``) SIGTERM the ranks still running when the first one exits, and those are then only
tearing down; their exit code must still say "rerun". A signal during model loading takes effect at the
first step (nothing but the manifest and target weights, both atomic, is written before it).
"""

from __future__ import annotations

import os
import signal
import threading
from collections import deque
from typing import Sequence

from ds_capture.errors import RERUN_EXIT_CODE

SIGNALS = (signal.SIGINT, signal.SIGTERM)
VOTE_LAG_STEPS = 2
"""Steps between a rank casting its ballot and every rank reading the sum (the stop latency, in micro-batches)."""


class Interrupted(SystemExit):
    """The run stopped early at a step boundary, everything on disk consistent: rerun the same command to continue.

    A ``SystemExit`` (code :data:`~ds_capture.errors.RERUN_EXIT_CODE`) so no ``except Exception`` on the way out
    mistakes it for a failure to report to the peers (they stopped at the same step)."""

    def __init__(self, message: str) -> None:
        super().__init__(RERUN_EXIT_CODE)
        self.message = message

    def __str__(self) -> str:
        return self.message


class StopOnSignal:
    """While entered: the first SIGTERM / SIGINT is recorded (:attr:`received`), the second ends the process.

    Only the main thread can install handlers; entered elsewhere (a library caller's worker thread) it
    installs none and the signals keep their previous meaning."""

    def __init__(self, *, announce: bool) -> None:
        self.announce = announce
        """Print one line when the signal arrives (rank 0 only: every task of a preempted job gets one)."""
        self.received: int | None = None
        """The first signal's number, once one arrived."""
        self._previous: dict[int, object] = {}
        self._finishing = False

    def __enter__(self) -> "StopOnSignal":
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        # After a stop the process is on its way out with exit 75: a launcher's SIGTERM (sent to the ranks still
        # running when the first one exits) must not turn that into a death by signal, so the handler stays.
        if not self._finishing:
            for sig, handler in self._previous.items():
                signal.signal(sig, handler)
        self._previous.clear()

    def finishing(self) -> None:
        """The stop is on disk: from now on (also after the run returns) a signal ends the process with the
        rerun code, at once."""
        if self._previous:
            self._finishing = True
            for sig in SIGNALS:
                signal.signal(sig, _exit_for_rerun)

    def _handle(self, signum: int, frame) -> None:
        if self.received is not None:  # only reached if the default action could not be restored
            os._exit(128 + signum)
        self.received = signum
        # The next one is the kernel's: the process ends at once, whatever Python is doing.
        for sig in SIGNALS:
            signal.signal(sig, signal.SIG_DFL)
        if self.announce:
            # os.write, not print: the main thread may be inside a write to stderr right now.
            os.write(2, f"ds-capture: {signal.Signals(signum).name} received; stopping every rank at the next "
                        "micro-batch boundary (send it again to stop at once)\n".encode())


def _exit_for_rerun(signum: int, frame) -> None:
    os._exit(RERUN_EXIT_CODE)


class StopVote:
    """The per-step, collective decision to stop; every rank of the default group must create it and cast a
    ballot at every step, padding steps included (it is a collective).

    A ballot is this rank's stop flags ``[got SIGINT, got SIGTERM]`` followed by ``width`` integers of the
    driver's own (:class:`ds_capture.session.Lockstep` puts the step's micro-batch shape there), all-gathered:
    one small integer collective a step carries the stop vote and whatever else the ranks must agree on."""

    def __init__(self, stop: StopOnSignal, *, lag: int = VOTE_LAG_STEPS, width: int = 0) -> None:
        import torch.distributed as torch_dist

        self.stop = stop
        self.width = width
        self.world_size = torch_dist.get_world_size() if torch_dist.is_initialized() else 1
        # A gloo side group: CPU tensors whatever the backend (an NCCL vote would sync the device every step),
        # and nothing in flight on the group the forward's collectives use.
        self._group = torch_dist.new_group(backend="gloo") if self.world_size > 1 else None
        self.lag = lag if self._group is not None else 0
        """Casts between a ballot and its reading (0 alone: nothing to wait for)."""
        self._pending: deque = deque()
        self.counts: tuple[int, int] = (0, 0)
        """Ranks that had received SIGINT, SIGTERM, as of the last ballots read."""

    def cast(self, payload: Sequence[int] = ()) -> None:
        """Start this rank's ballot: its stop flags and ``payload`` (``width`` integers); asynchronous."""
        import torch
        import torch.distributed as torch_dist

        ballot = torch.tensor([self.stop.received == signal.SIGINT, self.stop.received == signal.SIGTERM,
                               *payload], dtype=torch.int64)
        assert ballot.numel() == 2 + self.width, (len(payload), self.width)
        if self._group is None:
            self._pending.append((None, [ballot]))
            return
        gathered = [torch.empty_like(ballot) for _ in range(self.world_size)]
        self._pending.append((torch_dist.all_gather(gathered, ballot, group=self._group, async_op=True), gathered))

    def read(self) -> "torch.Tensor | None":
        """Every rank's ballot cast ``lag`` casts ago, ``[world_size, 2 + width]`` by rank (the same on every
        rank); None while fewer casts were made. Sets :attr:`counts`."""
        import torch

        if len(self._pending) <= self.lag:
            return None
        work, gathered = self._pending.popleft()
        if work is not None:
            work.wait()  # usually finished long ago: the ballot was cast `lag` steps earlier
        ballots = torch.stack(gathered)
        self.counts = (int(ballots[:, 0].sum()), int(ballots[:, 1].sum()))
        return ballots

    @property
    def stopping(self) -> bool:
        """Some rank had received a signal, as of the last ballots read (the same answer on every rank)."""
        return sum(self.counts) > 0

    def should_stop(self) -> bool:
        """Cast this rank's ballot (no payload); True on every rank at the same step once some rank received a
        signal."""
        self.cast()
        return self.read() is not None and self.stopping

    def reason(self) -> str:
        """``"SIGTERM on 2 of 2 ranks"`` for the vote that decided to stop."""
        parts = [f"{name} on {count} of {self.world_size} rank{'s' if self.world_size > 1 else ''}"
                 for name, count in zip(("SIGINT", "SIGTERM"), self.counts) if count]
        return " and ".join(parts) or "no signal"

    def close(self) -> None:
        """Wait for the ballots still in flight (every rank cast the same ones) and free the side group."""
        import torch.distributed as torch_dist

        while self._pending:
            work, _ = self._pending.popleft()
            if work is not None:
                work.wait()
        if self._group is not None:
            torch_dist.destroy_process_group(self._group)
            self._group = None
