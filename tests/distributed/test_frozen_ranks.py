"""Liveness with real gloo ranks: one rank SIGSTOPped mid-run (frozen, not dead: its sockets stay open) ends
every other rank within the heartbeat limit plus a few seconds, with exit code 75 and one line naming the rank
and host that stopped answering; the rerun completes the cache byte-identical to an uninterrupted run.

Cases (tiny qwen3_moe, engine deepspeed, 24 samples in 6 shards, limit 6 s): DP=2 with rank 1 frozen and then
woken with SIGCONT after its peer gave up (in DP its forward has no collective, so it would go on writing
shards: it must exit instead, writing nothing); DP=2 with rank 0 frozen (it hosts the job's TCP store, so every
store call to it hangs); TP=2 x EP=2 (4 ranks) with rank 3 frozen (ranks 0 and 2 watch it, rank 1 learns from
their verdict). The frozen rank stops itself inside its k-th forward (``_kill_helpers``' ``stop`` action); the
ranks are forks of this process with a launcher's environment (rank 0 hosts the store, as under ``deepspeed``).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import yaml

from tests.distributed import _kill_helpers as kh

pytestmark = [pytest.mark.distributed]

LIMIT_S = 6
SLACK_S = 6  # "a few seconds": detection granularity (0.6 s), two intervals for the verdict, a loaded host
NUM_SAMPLES, SHARD_SIZE, MICRO_BATCH = 24, 4, 2
NUM_SHARDS = NUM_SAMPLES // SHARD_SIZE
DATA = Path(__file__).resolve().parents[2] / "ds_capture" / "demo_data" / "conversations.jsonl"
STOPPING = "ds-capture: rank {rank} stopping: "
RERUN_HINT = " Rerun the same command to continue: finished shards are kept, only the rest is recomputed."


def write_recipe(path: Path, target: Path, data: Path, out: Path, **distributed) -> Path:
    recipe = {"engine": "deepspeed", "recipe_args": dict(
        target_model_name_or_path=str(target), train_data_path=str(data), cache_output_dir=str(out),
        seq_length=48, micro_batch_size=MICRO_BATCH, cache_shard_size=SHARD_SIZE, cache_dtype="fp32",
        mask_generation_prompt=False, mask_reasoning_content=False),
        "dist_env": {"timeout_minutes": 2, "heartbeat_timeout_seconds": LIMIT_S}}
    if distributed:
        recipe["distributed"] = distributed
    path.write_text(yaml.safe_dump(recipe))
    return path


LAYOUTS = {"dp2": (2, {}), "tp2ep2": (4, {"tp_size": 2, "ep_size": 2})}


@pytest.fixture(scope="module")
def setup(tiny_target, tmp_path_factory) -> dict:
    """Target, data, and one uninterrupted reference cache per layout (built on first use, shared)."""
    import ds_capture.runner  # noqa: F401  (imported once here, so each forked rank starts at once)

    kh.disable_shm_op()
    root = tmp_path_factory.mktemp("liveness")
    data = root / "data.jsonl"
    data.write_text("".join(DATA.read_text().splitlines(keepends=True)[:NUM_SAMPLES]))
    return {"root": root, "target": tiny_target("qwen3_moe", seed=0), "data": data, "references": {}}


def reference(setup: dict, layout: str) -> dict[str, str]:
    if layout not in setup["references"]:
        world_size, distributed = LAYOUTS[layout]
        out = setup["root"] / f"reference-{layout}"
        cfg = write_recipe(setup["root"] / f"reference-{layout}.yaml", setup["target"], setup["data"], out,
                           **distributed)
        result = kh.run_forked_ranks(world_size, cfg, log_path=setup["root"] / f"reference-{layout}.log",
                                     timeout_s=200)
        assert result["codes"] == [0] * world_size, (setup["root"] / f"reference-{layout}.log").read_text()[-3000:]
        setup["references"][layout] = kh.cache_digests(out)
        assert len(setup["references"][layout]) == NUM_SHARDS + 2
    return setup["references"][layout]


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0]
    except (FileNotFoundError, IndexError):
        return "?"


class FreezeWatch:
    """Notes when the frozen rank stopped and when each other rank ended; once all of them have, snapshots the
    output directory and sends the frozen rank ``wake`` (SIGCONT: it resumes; SIGKILL: it dies)."""

    def __init__(self, frozen_rank: int, wake: int, out: Path) -> None:
        self.frozen_rank, self.wake, self.out = frozen_rank, wake, out
        self.stopped_at: float | None = None
        self.woken_at: float | None = None
        self.ended_at: dict[int, float] = {}
        self.snapshot: dict | None = None

    def __call__(self, pids: list[int], status: dict[int, int]) -> None:
        now = time.monotonic()
        frozen = pids[self.frozen_rank]
        if self.stopped_at is None and _state(frozen) == "T":
            self.stopped_at = now
        for rank, pid in enumerate(pids):
            if pid in status and rank not in self.ended_at:
                self.ended_at[rank] = now
        others = [rank for rank in range(len(pids)) if rank != self.frozen_rank]
        if self.woken_at is None and self.stopped_at is not None and all(r in self.ended_at for r in others):
            self.snapshot = output_state(self.out)
            os.kill(frozen, self.wake)
            self.woken_at = now

    def seconds_to_end(self) -> dict[int, float]:
        return {rank: round(at - self.stopped_at, 1) for rank, at in sorted(self.ended_at.items())
                if rank != self.frozen_rank}


def output_state(out: Path) -> dict:
    """Every file of the output directory (bookkeeping and ``.tmp`` files included, metrics aside) with its
    inode, size and modification time: a rename, a new file or a row written into a ``.tmp`` all show."""
    return {str(p.relative_to(out)): (p.stat().st_ino, p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(out.rglob("*")) if p.is_file() and p.name != "metrics.jsonl"}


def run_frozen(setup: dict, tmp_path: Path, layout: str, frozen_rank: int, k: int, wake: int):
    world_size, distributed = LAYOUTS[layout]
    out = tmp_path / "cache"
    cfg = write_recipe(tmp_path / "run.yaml", setup["target"], setup["data"], out, **distributed)
    watch = FreezeWatch(frozen_rank, wake, out)
    result = kh.run_forked_ranks(world_size, cfg, kill=f"forward:{k}:{frozen_rank}:stop", log_path=tmp_path / "frozen.log",
                                 timeout_s=150, watch=watch, cli_argv=["run", "-c", str(cfg), "--no-progress"])
    log = (tmp_path / "frozen.log").read_text()
    assert watch.stopped_at is not None and watch.woken_at is not None and not result["timed_out"], (result, log[-4000:])
    return out, cfg, watch, result, log


def assert_live_ranks_stopped(watch: FreezeWatch, result: dict, log: str, frozen_rank: int, expected: str) -> None:
    """Every other rank: exit code 75 within limit + slack of the freeze, and exactly one line saying why."""
    world_size = len(result["codes"])
    live = [rank for rank in range(world_size) if rank != frozen_rank]
    assert [result["codes"][rank] for rank in live] == [75] * len(live), (result, log[-4000:])
    seconds = watch.seconds_to_end()
    assert all(LIMIT_S - 1 <= s <= LIMIT_S + SLACK_S for s in seconds.values()), (seconds, log[-4000:])
    for rank in live:
        lines = [line for line in log.splitlines() if line.startswith(STOPPING.format(rank=rank))]
        assert len(lines) == 1, (rank, log[-4000:])
        assert lines[0].startswith(STOPPING.format(rank=rank) + expected) and lines[0].endswith(
            f"over dist_env.heartbeat_timeout_seconds ({LIMIT_S} s).{RERUN_HINT}"), lines[0]
    # Nothing else went wrong on a live rank (no traceback, no second message).
    assert "Traceback" not in log and not any(line.startswith(f"rank {r}:") for r in live for line in log.splitlines()), \
        log[-4000:]


def rerun_completes_identically(setup: dict, tmp_path: Path, layout: str, out: Path, cfg: Path) -> dict:
    world_size, _ = LAYOUTS[layout]
    done_before = kh.finished_shards(out)
    assert 0 < len(done_before) < NUM_SHARDS, done_before  # the freeze left real work for the rerun
    rerun = kh.run_forked_ranks(world_size, cfg, log_path=tmp_path / "rerun.log", timeout_s=150)
    assert rerun["codes"] == [0] * world_size, (tmp_path / "rerun.log").read_text()[-3000:]
    summary = rerun["summary"]
    assert (summary["shards_written"], summary["shards_skipped"]) == (NUM_SHARDS - len(done_before), len(done_before))
    assert kh.cache_digests(out) == reference(setup, layout)
    assert not list(out.glob("*.tmp")) and not (out / ".ds_capture" / "lock").exists()
    return summary


@pytest.mark.timeout(420)
def test_dp2_frozen_rank1_stops_rank0_and_writes_nothing_when_woken(setup, tmp_path: Path) -> None:
    reference(setup, "dp2")
    out, cfg, watch, result, log = run_frozen(setup, tmp_path, "dp2", frozen_rank=1, k=4, wake=signal.SIGCONT)
    assert_live_ranks_stopped(watch, result, log, 1, "rank 1 (host ")
    # Woken after its peer gave up: it exits on its own (75), and nothing in the directory changed meanwhile.
    assert result["codes"][1] == 75 and result["signals"][1] == 0, (result, log[-4000:])
    woken, = [line for line in log.splitlines() if line.startswith("ds-capture: rank 1 ")]
    assert " was stopped or frozen: its last heartbeat is " in woken and woken.endswith(
        "it exits without publishing or writing anything. Rerun the same command to continue."), woken
    assert output_state(out) == watch.snapshot
    assert not (out / ".ds_capture" / "lock").exists()  # rank 0 released it on its way out
    summary = rerun_completes_identically(setup, tmp_path, "dp2", out, cfg)
    print(f"dp2, rank 1 frozen: rank 0 ended {watch.seconds_to_end()[0]} s after the freeze (limit {LIMIT_S} s); "
          f"rank 1 woken, exited 75 writing nothing; rerun wrote {summary['shards_written']}, "
          f"kept {summary['shards_skipped']}")


@pytest.mark.timeout(420)
def test_dp2_frozen_rank0_which_hosts_the_store_stops_rank1(setup, tmp_path: Path) -> None:
    reference(setup, "dp2")
    out, cfg, watch, result, log = run_frozen(setup, tmp_path, "dp2", frozen_rank=0, k=3, wake=signal.SIGKILL)
    assert_live_ranks_stopped(watch, result, log, 0, "rank 0 (host ")
    line, = [line for line in log.splitlines() if line.startswith(STOPPING.format(rank=1))]
    assert ", which hosts the job's store at 127.0.0.1:" in line and "no reply for " in line, line
    assert kh.manifest_complete(out) is False
    summary = rerun_completes_identically(setup, tmp_path, "dp2", out, cfg)
    print(f"dp2, rank 0 frozen: rank 1 ended {watch.seconds_to_end()[1]} s after the freeze (limit {LIMIT_S} s); "
          f"rerun wrote {summary['shards_written']}, kept {summary['shards_skipped']}")


@pytest.mark.timeout(480)
def test_tp2ep2_frozen_rank3_stops_the_three_others(setup, tmp_path: Path) -> None:
    reference(setup, "tp2ep2")
    out, cfg, watch, result, log = run_frozen(setup, tmp_path, "tp2ep2", frozen_rank=3, k=3, wake=signal.SIGKILL)
    assert_live_ranks_stopped(watch, result, log, 3, "rank 3 (host ")
    assert all("no heartbeat for " in line for line in log.splitlines() if line.startswith("ds-capture: rank "))
    summary = rerun_completes_identically(setup, tmp_path, "tp2ep2", out, cfg)
    print(f"tp2xep2, rank 3 frozen: ranks ended {watch.seconds_to_end()} s after the freeze (limit {LIMIT_S} s); "
          f"rerun wrote {summary['shards_written']}, kept {summary['shards_skipped']}")
