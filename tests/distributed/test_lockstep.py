"""The lockstep step (``session.Lockstep``) on two real gloo ranks: one control collective a step, for ``run`` and
``serve`` alike.

Two forked ranks drive the real :class:`~ds_capture.session.Lockstep` over a stand-in model that counts its calls
(no weights: what is judged is the control flow). Every ``torch.distributed`` collective a rank issues is counted
by a wrapper. Both modes of the step run: ``run``'s (every step's ballot known in advance, cast two steps ahead)
and ``serve``'s (each step's ballot cast at the step). Under chunked prefill (chunks of 4 tokens) the ranks' rows
take different numbers of forwards, and a rank with none forwards fillers only. What must hold on both ranks: each
step issues exactly one collective (before this step, ``run`` spent a stop all-reduce, a chunk agreement all-reduce
and every 8 steps a progress all-reduce; ``serve`` a stop all-reduce, an ``all_gather_object`` of pickled headers,
two collectives inside, and two broadcasts under TP); every rank runs the same number of model forwards at every
step (the most any rank's rows need); a signal on one rank stops both at the same step; and the two drivers
construct this same step.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.distributed.launchers import free_port

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(60)]

COLLECTIVES = ("all_gather", "all_reduce", "broadcast", "all_gather_object", "broadcast_object_list",
               "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single", "barrier")
CHUNK = 4
# Per rank, per step: (rows, length) of its micro-batch (0 rows: none). Rank 0's first row takes 4 chunks, rank 1's
# second row 4; rank 1 has nothing at step 2 (run: it ran out of batches; serve: its replica is idle), and at step 3
# no rank has rows (serve's idle tick).
SHAPES = {0: [(1, 16), (2, 4), (1, 4), (0, 0)], 1: [(1, 4), (1, 16), (0, 0), (0, 0)]}
FORWARDS = [4, 4, 1, 0]  # the most any rank's rows need at each step


class _CountingModel(torch.nn.Module):
    """A stand-in target: counts its calls, returns what a chunked forward carries."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, input_ids, **kwargs):
        self.calls += 1
        return SimpleNamespace(cache=None, input_ids=input_ids)


def _counted(counts: dict) -> None:
    """Wrap every collective of torch.distributed to count its calls into ``counts``."""
    import torch.distributed as torch_dist

    for name in COLLECTIVES:
        real = getattr(torch_dist, name)

        def wrapper(*args, _real=real, _name=name, **kwargs):
            counts[_name] = counts.get(_name, 0) + 1
            return _real(*args, **kwargs)

        setattr(torch_dist, name, wrapper)


def _rank(rank: int, port: int, mode: str, signal_at: int | None, out: Path) -> None:
    import torch.distributed as torch_dist

    from ds_capture.session import Ballot, Lockstep, TargetForward

    torch_dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    counts: dict = {}
    _counted(counts)
    model = _CountingModel()
    family = SimpleNamespace(chunk_carriers=None, chunk_query_blocks=None, is_nemo=False, full_width=False)
    hooks = SimpleNamespace(reset=lambda: None, to_host=False)
    forward = TargetForward(model, SimpleNamespace(family=family), hooks, chunk_tokens=CHUNK)
    stop = SimpleNamespace(received=None)
    ballots = [Ballot(rows=rows, length=length) for rows, length in SHAPES[rank]]
    steps = len(ballots) + 4  # past the shapes: every rank idle (serve) / fillers of nobody (run: no rows)
    lockstep = Lockstep(forward, stop, device=torch.device("cpu"), seq_length=16,
                        schedule=ballots if mode == "run" else None)
    records = []
    for step in range(steps):
        if step == signal_at:
            stop.received = signal.SIGTERM
        before, calls = sum(counts.values()), model.calls
        agreed = lockstep.agree(None if mode == "run" else (ballots[step] if step < len(ballots) else Ballot()))
        if agreed.stop:
            records.append({"step": step, "stopped": lockstep.reason()})
            break
        rows, length = SHAPES[rank][step] if step < len(ballots) else (0, 0)
        inputs = {"input_ids": torch.zeros(rows, length, dtype=torch.long)} if rows else None
        if agreed.num_forwards:
            lockstep.forward(agreed, inputs)
        records.append({"step": step, "collectives": sum(counts.values()) - before, "forwards": model.calls - calls,
                        "agreed": agreed.num_forwards, "shapes": [list(shape) for shape in agreed.shapes]})
    lockstep.close()
    out.write_text(json.dumps(records))
    torch_dist.destroy_process_group()


def _two_ranks(tmp_path: Path, mode: str, signal_at: int | None = None) -> list[list[dict]]:
    port, pids = free_port(), []
    for rank in range(2):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                _rank(rank, port, mode, signal_at if rank == 1 else None, tmp_path / f"{mode}{rank}.json")
                code = 0
            finally:
                os._exit(code)
        pids.append(pid)
    codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
    assert codes == [0, 0]
    return [json.loads((tmp_path / f"{mode}{rank}.json").read_text()) for rank in range(2)]


@pytest.mark.parametrize("mode", ["run", "serve"])
def test_each_step_is_one_collective_and_every_rank_forwards_alike(tmp_path, mode) -> None:
    records = _two_ranks(tmp_path, mode)
    for rank, steps in enumerate(records):
        assert [record["collectives"] for record in steps] == [1] * len(steps), (rank, steps)
        assert [record["agreed"] for record in steps] == FORWARDS + [0] * (len(steps) - len(FORWARDS)), steps
        # Every rank runs the step's forwards, fillers included (run's steps past the shapes have none either).
        assert [record["forwards"] for record in steps] == [record["agreed"] for record in steps], (rank, steps)
        # Every rank learns every rank's shape (a TP group's ranks read their listener's).
        assert [record["shapes"] for record in steps[:len(FORWARDS)]] == [
            [list(SHAPES[0][step]), list(SHAPES[1][step])] for step in range(len(FORWARDS))]


@pytest.mark.parametrize("mode, lag", [("run", 2), ("serve", 0)])
def test_a_signal_on_one_rank_stops_both_at_the_same_step(tmp_path, mode, lag) -> None:
    records = _two_ranks(tmp_path, mode, signal_at=1)
    assert [steps[-1] for steps in records] == [{"step": 1 + lag, "stopped": "SIGTERM on 1 of 2 ranks"}] * 2, records


def test_run_and_serve_drive_the_same_step() -> None:
    import ds_capture.runner as runner
    import ds_capture.serve.loop as loop
    import ds_capture.session as session

    assert runner.Lockstep is loop.Lockstep is session.Lockstep
    # Neither driver keeps a stop vote, a filler or a header exchange of its own.
    for module in (runner, loop):
        source = Path(module.__file__).read_text()
        for own in ("StopVote", "all_gather_object", "num_forwards=", "torch.zeros(1, 8"):
            assert own not in source, (module.__name__, own)
