"""Liveness without a process group: heartbeat threads over an in-process store (torch's HashStore), peers
played by the test. A neighbour that stops beating, a verdict published by another rank, a store that stops
answering (its host frozen) and this rank waking from a freeze each end the rank with RERUN_EXIT_CODE and the
exact message; the frozen rank publishes nothing. The config key is validated; real frozen ranks are
tests/distributed/test_frozen_ranks.py's."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest
from torch.distributed import HashStore

import ds_capture.capture.liveness as liveness
from ds_capture.capture.liveness import Liveness
from ds_capture.errors import RERUN_EXIT_CODE, CaptureError
from ds_capture.parallel.dist import DistEnv
from ds_capture.recipe.config import parse_config

LIMIT_S = 1.0
HOST = socket.gethostname()


def env(rank: int, world_size: int) -> DistEnv:
    return DistEnv(rank, world_size, rank, world_size, "127.0.0.1", 29999, "torchrun")


class Exits:
    """The injected exit: records (code, when); the thread that called it then unwinds with SystemExit."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, float]] = []
        self.called = threading.Event()

    def __call__(self, code: int) -> None:
        self.calls.append((code, time.monotonic()))
        self.called.set()


class FrozenableStore:
    """A HashStore whose calls block forever once ``freeze()`` is called (a stopped store host), and that
    records every key set (what this rank published)."""

    def __init__(self) -> None:
        self.inner, self.frozen, self.sets = HashStore(), threading.Event(), []

    def freeze(self) -> None:
        self.frozen.set()

    def _gate(self) -> None:
        if self.frozen.is_set():
            threading.Event().wait()  # never returns: the thread is a daemon

    def set(self, key, value):
        self._gate()
        self.sets.append(key)
        return self.inner.set(key, value)

    def __getattr__(self, name):
        method = getattr(self.inner, name)

        def gated(*args, **kwargs):
            self._gate()
            return method(*args, **kwargs)

        return gated


@pytest.fixture(autouse=True)
def no_active_liveness():
    yield
    liveness._ACTIVE = None


def beat_forever(store, key: str, stop: threading.Event, period_s: float = 0.05) -> threading.Thread:
    """A live peer: its counter changes every ``period_s`` until ``stop``."""
    def run() -> None:
        count = 0
        while not stop.wait(period_s):
            count += 1
            store.set(key, str(count))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_a_neighbour_that_stops_beating_ends_the_rank_after_the_limit(capfd):
    store, exits = FrozenableStore(), Exits()
    store.set("ds_capture/liveness/1/host/1", "node-b")
    store.set("ds_capture/liveness/1/beat/1", "1")  # rank 1 beat once, then froze
    started = time.monotonic()
    with pytest.raises(SystemExit):  # the main thread, leaving on an error, waits for the watchdog's exit
        with Liveness(env(0, 2), limit_s=LIMIT_S, store=store, exit=exits):
            assert exits.called.wait(timeout=10)
            raise RuntimeError("Connection closed by peer")  # what the main thread sees once peers leave
    (code, when), = exits.calls
    elapsed = when - started
    assert code == RERUN_EXIT_CODE and LIMIT_S < elapsed < LIMIT_S + 1.5, elapsed
    err = capfd.readouterr().err
    line, = [line for line in err.splitlines() if line.startswith("ds-capture: rank 0 stopping:")]
    assert line.startswith("ds-capture: rank 0 stopping: rank 1 (host node-b) stopped answering: no heartbeat for 1.")
    assert line.endswith(", over dist_env.heartbeat_timeout_seconds (1 s). Rerun the same command to continue: "
                         "finished shards are kept, only the rest is recomputed."), line
    verdict = json.loads(store.inner.get("ds_capture/liveness/1/verdict"))
    assert (verdict["rank"], verdict["host"], verdict["reporter"]) == (1, "node-b", 0)


def test_a_verdict_of_another_rank_ends_a_rank_that_does_not_watch_the_frozen_one(capfd):
    """World 4: rank 0 watches 1 and 3 (alive); rank 2 froze and rank 1 published the verdict. Rank 0 (the
    store's host under most launchers) leaves only once ranks 1 and 3 have counted themselves as stopping."""
    store, exits, stop = FrozenableStore(), Exits(), threading.Event()
    for peer in (1, 3):
        beat_forever(store.inner, f"ds_capture/liveness/1/beat/{peer}", stop)
    acked = []

    def peers_stop_late() -> None:  # ranks 1 and 3 read the verdict 1.5 s after it is out (a loaded host)
        time.sleep(1.5)
        acked.append(time.monotonic())
        store.inner.add("ds_capture/liveness/1/stopping", 2)

    try:
        with Liveness(env(0, 4), limit_s=10, store=store, exit=exits) as live:
            assert live.watched == [1, 3]
            started = time.monotonic()
            store.inner.set("ds_capture/liveness/1/verdict", json.dumps(
                {"rank": 2, "host": "node-c", "seconds": 30.4, "reporter": 1}))
            threading.Thread(target=peers_stop_late, daemon=True).start()
            assert exits.called.wait(timeout=20)
            # Read within an interval (1 s here); left once the other two live ranks were stopping, not before.
            assert acked and acked[0] <= exits.calls[0][1] < acked[0] + 2.0  # (polls every 0.1 s; a loaded host)
            assert exits.calls[0][1] - started < live.interval_s + 1.5 + 3.0
    except SystemExit:
        pass
    finally:
        stop.set()
    assert exits.calls[0][0] == RERUN_EXIT_CODE
    assert int(store.inner.get("ds_capture/liveness/1/stopping")) == 3
    assert ("ds-capture: rank 0 stopping: rank 2 (host node-c) stopped answering: no heartbeat for 30.4 s, over "
            "dist_env.heartbeat_timeout_seconds (10 s).") in capfd.readouterr().err


def test_the_wait_for_the_others_to_stop_is_bounded(capfd):
    """World 3, rank 2 frozen and rank 1 never counting itself as stopping (frozen too, say): rank 0 reports
    rank 2 and leaves after stop_wait_s, not never."""
    store, exits, stop = FrozenableStore(), Exits(), threading.Event()
    store.set("ds_capture/liveness/1/beat/2", "1")
    beat_forever(store.inner, "ds_capture/liveness/1/beat/1", stop)
    try:
        with pytest.raises(SystemExit):
            with Liveness(env(0, 3), limit_s=LIMIT_S, store=store, exit=exits) as live:
                started = time.monotonic()
                assert exits.called.wait(timeout=20)
                raise RuntimeError("Connection closed by peer")
    finally:
        stop.set()
    waited = exits.calls[0][1] - started
    assert LIMIT_S + live.stop_wait_s() - 0.5 < waited < LIMIT_S + live.stop_wait_s() + 3.0, waited
    assert int(store.inner.get("ds_capture/liveness/1/stopping")) == 1
    assert "ds-capture: rank 0 stopping: rank 2 (host unknown host) stopped answering" in capfd.readouterr().err


def test_a_store_that_stops_answering_names_rank_0_and_its_host(capfd):
    """The store's host (rank 0) froze: every store call hangs; the watch thread, which never calls it, decides."""
    store, exits, stop = FrozenableStore(), Exits(), threading.Event()
    store.set("ds_capture/liveness/1/host/0", "node-a")
    # Rank 0 beats slower than rank 1 reads (as with equal intervals, out of phase): its last change is seen
    # up to 0.4 s before the store's last answer.
    beat_forever(store.inner, "ds_capture/liveness/1/beat/0", stop, period_s=0.4)
    try:
        with Liveness(env(1, 2), limit_s=LIMIT_S, store=store, exit=exits):
            time.sleep(1.0)  # a few good rounds: rank 0's host is read
            # Its heartbeat stops with its store (read a little before the store's last answer, so the heartbeat
            # goes stale first): the message must still name the store, the reason no heartbeat arrives.
            stop.set()
            store.freeze()
            frozen_at = time.monotonic()
            assert exits.called.wait(timeout=10)
    except SystemExit:
        pass
    finally:
        stop.set()
    elapsed = exits.calls[0][1] - frozen_at
    assert exits.calls[0][0] == RERUN_EXIT_CODE and LIMIT_S - 0.2 < elapsed < LIMIT_S + 1.5, elapsed
    err = capfd.readouterr().err
    assert ("ds-capture: rank 1 stopping: rank 0 (host node-a), which hosts the job's store at 127.0.0.1:29999, "
            "stopped answering: no reply for 1.") in err, err


class JumpingClock:
    """time.monotonic plus an offset: ``jump(s)`` is what a process sees after being stopped for s seconds."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.offset


def test_a_rank_woken_from_a_freeze_publishes_and_writes_nothing(capfd):
    store, exits, clock, stop = FrozenableStore(), Exits(), JumpingClock(), threading.Event()
    beat_forever(store.inner, "ds_capture/liveness/1/beat/1", stop)
    try:
        with Liveness(env(0, 2), limit_s=LIMIT_S, store=store, exit=exits, clock=clock):
            time.sleep(0.3)
            # Stopped for 5 limits: every thread of the process wakes at once; before any of them runs, the
            # writer's check refuses the rename (a stand-in for "the threads have not run yet").
            sets_before = len(store.sets)
            clock.offset += 5 * LIMIT_S
            with pytest.raises(SystemExit):
                liveness.refuse_if_frozen()
            assert exits.called.wait(timeout=5)
            time.sleep(0.5)
    except SystemExit:
        pass
    finally:
        stop.set()
    assert [code for code, _ in exits.calls] == [RERUN_EXIT_CODE]
    assert len(store.sets) == sets_before, store.sets[sets_before:]  # no heartbeat, no verdict
    err = capfd.readouterr().err
    line, = [line for line in err.splitlines() if line.startswith("ds-capture: rank 0 ")]
    assert line.startswith(f"ds-capture: rank 0 (host {HOST}) was stopped or frozen: its last heartbeat is 5.")
    assert line.endswith("s old, over dist_env.heartbeat_timeout_seconds (1 s), so its peers have given up on it; it "
                         "exits without publishing or writing anything. Rerun the same command to continue."), line


def test_a_writer_thread_resuming_mid_shard_after_a_freeze_writes_no_further_byte(tmp_path):
    """SIGSTOP stops every thread wherever it is: the writer may resume with a shard half written, or between a
    shard's rename and its checksum sidecar. Once woken it must neither add rows to the ``.tmp`` nor start the
    sidecar (CI caught a ``shard-000003.checksum.tmp`` appearing after the wake)."""
    import torch

    from ds_capture.cache.common.files import write_checksum_sidecar
    from ds_capture.cache.common.shard_file import SafetensorsLayout, ShardFile

    store, exits, clock, stop = FrozenableStore(), Exits(), JumpingClock(), threading.Event()
    beat_forever(store.inner, "ds_capture/liveness/1/beat/1", stop)
    layout = SafetensorsLayout.build({"x": ((2, 3), torch.float32)})
    try:
        with Liveness(env(0, 2), limit_s=LIMIT_S, store=store, exit=exits, clock=clock):
            shard = ShardFile(tmp_path / "shard-000000.safetensors", layout)
            shard.write_rows(torch.tensor([0]), {"x": torch.ones(1, 3)}, torch.tensor([3]))
            before = shard.tmp.read_bytes()
            clock.offset += 5 * LIMIT_S
            with pytest.raises(SystemExit):
                shard._pwrite(torch.full((3,), 2.0).numpy(), layout.slot("x").offset + 12)
            with pytest.raises(SystemExit):
                write_checksum_sidecar(tmp_path, 0, "xxh3_128rows:" + "0" * 32)
            assert exits.called.wait(timeout=5)
    except SystemExit:
        pass
    finally:
        stop.set()
    assert shard.tmp.read_bytes() == before
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == [
        "shard-000000.safetensors.tmp"]


def test_a_rank_leaving_on_its_own_is_marked_done_and_not_watched():
    store, exits = FrozenableStore(), Exits()
    with Liveness(env(1, 2), limit_s=LIMIT_S, store=store, exit=exits):
        store.inner.set("ds_capture/liveness/1/beat/0", liveness.DONE)  # rank 0 finished first
        time.sleep(2 * LIMIT_S)
    assert exits.calls == []
    assert store.inner.get("ds_capture/liveness/1/beat/1") == b"done"
    assert liveness._ACTIVE is None
    liveness.refuse_if_frozen()  # outside a session: a no-op


def test_sessions_on_one_store_do_not_see_each_others_keys():
    store, exits = FrozenableStore(), Exits()
    for generation in (1, 2):
        with Liveness(env(1, 2), limit_s=LIMIT_S, store=store, exit=exits) as live:
            store.inner.set(f"ds_capture/liveness/{generation}/beat/0", liveness.DONE)
            assert live._prefix == f"ds_capture/liveness/{generation}"
    assert exits.calls == []


def test_a_world_of_one_starts_nothing():
    with Liveness(env(0, 1), limit_s=LIMIT_S) as live:
        assert live._threads == [] and liveness._ACTIVE is None


@pytest.mark.parametrize("value, message", [
    (0.5, "`dist_env.heartbeat_timeout_seconds` must be between 1 and the collective timeout (600 s, "
          "dist_env.timeout_minutes), got 0.5."),
    (601, "`dist_env.heartbeat_timeout_seconds` must be between 1 and the collective timeout (600 s, "
          "dist_env.timeout_minutes), got 601."),
    ("soon", "`dist_env.heartbeat_timeout_seconds` must be a number, got 'soon'."),
])
def test_the_heartbeat_limit_is_validated(tmp_path, value, message):
    raw = {"recipe_args": {"target_model_name_or_path": "t", "train_data_path": "d", "cache_output_dir": "o",
                           "seq_length": 8},
           "dist_env": {"timeout_minutes": 10, "heartbeat_timeout_seconds": value}}
    with pytest.raises(CaptureError) as error:
        parse_config(raw, source="r.yaml", base_dir=tmp_path)
    assert str(error.value) == f"r.yaml: {message}"


def test_the_heartbeat_limit_defaults_to_two_minutes_and_a_misspelling_is_refused(tmp_path):
    raw = {"recipe_args": {"target_model_name_or_path": "t", "train_data_path": "d", "cache_output_dir": "o",
                           "seq_length": 8}}
    assert parse_config(raw, source="r.yaml", base_dir=tmp_path).dist_env.heartbeat_timeout_seconds == 120.0
    with pytest.raises(CaptureError) as error:
        parse_config({**raw, "dist_env": {"heartbeat_timeout": 5}}, source="r.yaml", base_dir=tmp_path)
    assert str(error.value) == ("r.yaml: unknown key `dist_env.heartbeat_timeout`. Valid keys under `dist_env`: "
                                "backend, heartbeat_timeout_seconds, timeout_minutes. Fix the spelling or remove the key.")
