"""Preemption: SIGTERM to a running 2-rank capture (launch/torchrun.sh's process group, the deepspeed launcher's
ranks) stops every rank at the same step with exit 75, which the launcher passes on; finished shards keep their
sidecars, nothing partial sits under a final name, the lock is released, and the rerun ends byte-identical to an
uninterrupted cache. Also the vote itself: a signal
on one rank only stops both ranks at the same step.

The reference cache is made once per module (forked ranks, as ``test_crash_resume``); the launched jobs run the
real ``python -m ds_capture run``: its ``entry`` leaves with ``os._exit``, and that matters here (a launcher
SIGTERMs the ranks still tearing down once one exits; interpreter finalization would restore the default
handler and turn that into a death by signal).
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest

from tests.distributed import _kill_helpers as kh
from tests.distributed.launchers import descendants, ensure_shm_op_built, free_port, run_launcher
from tests.distributed.test_crash_resume import write_recipe

pytestmark = [pytest.mark.distributed]

NUM_SAMPLES, SHARD_SIZE = 96, 4  # 24 steps per rank at 2 ranks: room for the signal to land mid-run
NUM_SHARDS = NUM_SAMPLES // SHARD_SIZE  # 24: 12 per DP rank, 24 forwards each
DATA = Path(__file__).resolve().parents[2] / "ds_capture" / "demo_data" / "conversations.jsonl"
CLI = ["-m", "ds_capture", "run", "--no-progress", "-c"]


@pytest.fixture(scope="module")
def setup(tiny_target, tmp_path_factory) -> dict:
    import ds_capture.runner  # noqa: F401  (imported once, so each forked rank starts at once)

    ensure_shm_op_built()  # the launched ranks load DeepSpeed's shm op: built here, outside their timeout
    kh.disable_shm_op()  # the forked reference ranks do not need it
    root = tmp_path_factory.mktemp("preempt")
    target = tiny_target("qwen3_moe", seed=0)
    data = root / "data.jsonl"
    data.write_text("".join(DATA.read_text().splitlines(keepends=True)[:NUM_SAMPLES]))
    reference = root / "reference"
    cfg = write_recipe(root / "reference.yaml", target, data, reference)
    result = kh.run_forked_ranks(2, cfg, log_path=root / "reference.log", timeout_s=200)
    assert result["codes"] == [0, 0], (root / "reference.log").read_text()[-3000:]
    return {"target": target, "data": data, "reference": kh.cache_digests(reference)}


def rank_pids(launcher_pid: int) -> list[int]:
    """The processes below a launcher that run ``ds-capture`` (the ranks, not torchrun's or deepspeed's own)."""
    ranks = []
    for pid in descendants(launcher_pid):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        # `python -u -m ds_capture [--local_rank=N] run ...`; the launchers' own command lines name it too.
        is_rank = any(argv[i:i + 2] == [b"-m", b"ds_capture"] for i in range(len(argv)))
        if is_rank and b"torch.distributed.run" not in argv and b"deepspeed.launcher.launch" not in argv:
            ranks.append(pid)
    return ranks


def assert_stopped_cleanly(out: Path, log: str) -> set[int]:
    """What a stopped run must leave: finished shards only (each with its matching sidecar), no .tmp, no lock,
    the manifest still ``complete: false``, and the stop said once. Returns the finished shards."""
    finished = kh.finished_shards(out)
    assert {int(name[6:12]) for name in kh.shard_files(out)} == finished, "a shard without its matching sidecar"
    assert 0 < len(finished) < NUM_SHARDS, f"stopped with {sorted(finished)} finished: not mid-run"
    assert not list(out.rglob("*.tmp")), sorted(map(str, out.rglob("*.tmp")))
    assert not (out / ".ds_capture" / "lock").exists()
    assert kh.manifest_complete(out) is False
    stops = [line for line in log.splitlines() if "rerun the same command to continue" in line]
    # "on N of 2 ranks": those whose signal had arrived by the vote that decided (both got one).
    assert len(stops) == 1 and re.search(r"stopped by SIGTERM on [12] of 2 ranks", stops[0]), log[-4000:]
    assert f"{len(finished)} of {NUM_SHARDS} shards are finished" in stops[0], stops
    return finished


def sigterm_ranks_mid_run(kind: str, cfg: Path, out: Path, log_path: Path) -> tuple[int, str]:
    """Launch through ``kind``, SIGTERM every rank once 2 shards are finished; (launcher's exit code, log).

    ``torchrun_script`` (launch/torchrun.sh) gets what Slurm's preemption sends: SIGTERM to the job's process
    group, which holds the script and torchrun, not the ranks (torchrun starts each in a session of its own)."""
    proc, port = kh.launch(kind, 2, [*CLI, str(cfg)], None, log_path)
    try:
        deadline = time.monotonic() + 150
        while len(kh.finished_shards(out) if out.is_dir() else ()) < 2:
            assert proc.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, "no shard finished in 150 s"
            time.sleep(0.02)
        ranks = rank_pids(proc.pid)
        assert len(ranks) == 2, ranks
        if kind == "torchrun_script":
            os.killpg(proc.pid, signal.SIGTERM)
        else:
            for pid in ranks:
                os.kill(pid, signal.SIGTERM)
        code = proc.wait(timeout=60)
    finally:
        kh.wait_and_reap(proc, port, timeout_s=30)
    return code, log_path.read_text()


@pytest.mark.timeout(400)
# CI cut: torchrun through launch/torchrun.sh (what Slurm preempts); the deepspeed launcher runs with --full.
@pytest.mark.parametrize("kind", ["torchrun_script", pytest.param("deepspeed", marks=pytest.mark.slow)])
def test_sigterm_to_every_rank_stops_at_a_boundary_and_the_rerun_is_byte_identical(setup, tmp_path, kind) -> None:
    out = tmp_path / "cache"
    cfg = write_recipe(tmp_path / "run.yaml", setup["target"], setup["data"], out)
    started = time.monotonic()
    code, log = sigterm_ranks_mid_run(kind, cfg, out, tmp_path / "stopped.log")
    stop_seconds = time.monotonic() - started
    # Each rank exits 75, and so does the launcher: the deepspeed launcher passes it on; launch/torchrun.sh's
    # wrapper reads the ranks' records where torchrun itself would exit 1 with a SignalException traceback.
    assert code == 75, log[-4000:]
    assert "Traceback" not in log and "ds-capture run: error" not in log, log[-4000:]
    if kind == "torchrun_script":
        assert log.count("ds_capture: every rank on this node stopped with 75 (torchrun got signal SIGTERM); "
                         "so does torchrun\n") == 1, log[-4000:]
    else:
        assert "Signal 15" not in log, log[-4000:]
    finished = assert_stopped_cleanly(out, log)

    rerun = run_launcher(kind, 2, [*CLI, str(cfg)], None, timeout_s=150)
    assert rerun.returncode == 0, rerun.stdout[-3000:]
    assert kh.summary_counts(rerun.stdout) == (NUM_SHARDS - len(finished), len(finished)), rerun.stdout[-2000:]
    assert kh.cache_digests(out) == setup["reference"]
    assert rerun.leftover_shm == []
    print(f"{kind}: SIGTERM after 2 shards; stopped with {sorted(finished)} finished ({stop_seconds:.1f} s from "
          f"launch to exit); rerun wrote {NUM_SHARDS - len(finished)}")


def _vote_rank(rank: int, port: int, signal_at: int | None, steps: int, result_path: Path) -> None:
    """One forked rank: a gloo group, then ``steps`` votes; SIGTERM to itself before vote ``signal_at``."""
    import torch.distributed as torch_dist

    from ds_capture.capture.interrupt import StopOnSignal, StopVote

    torch_dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    with StopOnSignal(announce=False) as stop:
        vote = StopVote(stop)
        stopped_at = None
        for step in range(steps):
            if step == signal_at:
                os.kill(os.getpid(), signal.SIGTERM)
            if rank == 1:
                time.sleep(0.01)  # rank 1 runs behind: the vote must still agree
            if vote.should_stop():
                stopped_at = step
                break
        vote.close()
    result_path.write_text(f"{stopped_at} {vote.reason()}")
    torch_dist.barrier()
    torch_dist.destroy_process_group()


@pytest.mark.timeout(60)
def test_a_signal_on_one_rank_stops_both_at_the_same_step(tmp_path: Path) -> None:
    from ds_capture.capture.interrupt import VOTE_LAG_STEPS

    port, pids = free_port(), []
    for rank in range(2):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                _vote_rank(rank, port, 5 if rank == 1 else None, 50, tmp_path / f"rank{rank}.txt")
                code = 0
            finally:
                os._exit(code)
        pids.append(pid)
    codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
    assert codes == [0, 0]
    results = [(tmp_path / f"rank{rank}.txt").read_text() for rank in range(2)]
    # The signal came before vote 5 on rank 1; that ballot is read VOTE_LAG_STEPS votes later, on both ranks.
    assert results == [f"{5 + VOTE_LAG_STEPS} SIGTERM on 1 of 2 ranks"] * 2, results
