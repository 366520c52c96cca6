"""Liveness: every rank publishes a heartbeat; a rank whose peer (or the store's host) stops answering stops.

In: this rank's :class:`~ds_capture.parallel.dist.DistEnv` (rank, world, master address and port) and the limit
(``dist_env.heartbeat_timeout_seconds``). Out, while :class:`Liveness` is entered (one per distributed session):

- a *beat* thread: every ``interval_s`` it sets this rank's counter in the job's TCP store, over a client
  connection of its own (the process group's store calls are not shared, so a hung call blocks only it), and
  reads its two ring neighbours' counters and the job's *verdict* key;
- a *watch* thread that never touches the store and only compares times: a neighbour whose counter has not
  changed for longer than the limit, or a store that has not answered for that long (its host, rank 0 or
  torchrun's agent, is frozen: every call to it hangs, whatever the client's timeout), is a peer that stopped
  answering. The rank prints once which rank and host stopped answering and that rerunning the same command
  continues, publishes the verdict (so ranks that do not watch that peer stop too), counts itself as stopping
  and waits (bounded) until every rank but the one named has counted itself too, releases the output lock and
  exits with ``RERUN_EXIT_CODE``. The wait matters: a rank that left early would close its sockets (and rank 0
  the store), and a peer that had not read the verdict yet would report that echo as the failure.

A frozen rank that wakes up after its peers gave up must not publish or write anything. Its last published
heartbeat is then older than the limit (peers saw it no earlier than it was sent), and its watch thread
overslept: :func:`refuse_if_frozen`, called before every file the writer starts, every write into a shard, every
rename and by the heartbeat and fail-fast paths before they publish, exits at once with a message and writes
nothing. (SIGSTOP stops each thread wherever it is, so the writer thread can resume mid-shard: it is checked
before each write, not only before the rename. Only a system call already under way when the stop came can
still complete.) Times are this host's
``time.monotonic`` (it keeps counting while a process is stopped); no clock is compared across hosts.

Heartbeats come from threads, so they continue while the main thread loads a model for many minutes; a main
thread that hangs inside a collective is the collective timeout's business (and NCCL's watchdog's), not this.

    with Liveness(env, limit_s=cfg.dist_env.heartbeat_timeout_seconds):
        ...  # the capture; refuse_if_frozen() before each write
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta

from ds_capture.errors import RERUN_EXIT_CODE
from ds_capture.parallel.dist import DistEnv, remove_shm_buffers

DONE = "done"
"""The counter's last value when a rank leaves on its own (finished, or raised): no longer watched."""
CONFIG_KEY = "dist_env.heartbeat_timeout_seconds"
_PREFIX = "ds_capture/liveness"

# The one active instance of this process, for refuse_if_frozen() (the writer cannot be handed it without
# threading it through every cache kind).
_ACTIVE: "Liveness | None" = None


def beat_interval(limit_s: float) -> float:
    """Seconds between heartbeats: a tenth of the limit, at most 2 s (stop = limit + ~3 intervals)."""
    return min(2.0, max(0.1, limit_s / 10))


def stopping() -> bool:
    """This process's watchdog is stopping it (its exit code is RERUN_EXIT_CODE): what a peer's sockets or the
    store closing meanwhile look like is the echo of that stop, not news."""
    return _ACTIVE is not None and _ACTIVE.giving_up


def refuse_if_frozen() -> None:
    """Exit at once, writing nothing, if this process was stopped long enough for its peers to give up on it.

    Call before every rename of a shard or manifest and before publishing anything; a no-op outside a
    distributed session. A live rank whose store stopped answering gives up here too (with the store's host
    named), so it writes nothing that its peers will not see completed."""
    if _ACTIVE is not None:
        _ACTIVE.judge()


# The output locks this process holds (safety.OutputLock adds itself while it holds one). A stop that cannot
# unwind (this watchdog's os._exit) removes them, so the rerun it asks for can start at once.
HELD_LOCKS: set = set()


def release_held_locks() -> None:
    """Remove the lock files this process holds, from any thread, without joining anything."""
    for lock in list(HELD_LOCKS):
        lock.abandon()


class Liveness:
    """Heartbeat + watchdog of one rank for one distributed session (no-op in a world of 1)."""

    def __init__(self, env: DistEnv, *, limit_s: float, store=None, exit: Callable[[int], None] = os._exit,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.env, self.rank, self.limit_s = env, env.rank, float(limit_s)
        self.interval_s = beat_interval(self.limit_s)
        self._store, self._exit_process, self._clock = store, exit, clock
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._give_up_lock = threading.Lock()
        self._exited = threading.Event()  # set only where an injected exit returned (tests)
        self.giving_up = False
        # Ring neighbours: any set of frozen ranks short of all has a live neighbour; the verdict reaches the rest.
        self.watched = sorted({(self.rank - 1) % env.world_size, (self.rank + 1) % env.world_size} - {self.rank})
        self._seen: dict[int, bytes] = {}
        self._hosts: dict[int, str] = {}

    # ------------------------------------------------------------------ lifecycle (main thread)

    def __enter__(self) -> "Liveness":
        global _ACTIVE
        if self.env.world_size == 1:
            return self
        if self._store is None:
            self._store = _connect(self.env, self.interval_s)
        # Each session on one store gets fresh keys: every rank counts its own sessions, all in lockstep.
        generation = self._store.add(f"{_PREFIX}/generation/{self.rank}", 1)
        self._prefix = f"{_PREFIX}/{generation}"
        self._store.set(self._key("host", self.rank), socket.gethostname())
        now = self._clock()
        # A neighbour that never publishes is judged from now (every rank enters right after the rendezvous).
        self._changed = {peer: now for peer in self.watched}
        self._last_published = self._last_store_ok = self._last_watch = now
        self._threads = [threading.Thread(target=_quiet(self._beat), name="ds_capture-heartbeat", daemon=True),
                         threading.Thread(target=_quiet(self._watch), name="ds_capture-watchdog", daemon=True)]
        for thread in self._threads:
            thread.start()
        _ACTIVE = self
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        global _ACTIVE
        if not self._threads:
            return
        from ds_capture.parallel.dist import AgreedError

        if exc is not None and not isinstance(exc, (AgreedError, KeyboardInterrupt, SystemExit)):
            # An error here may be the echo of a peer that gave up (its sockets closed before this rank read the
            # verdict): give the beat thread two intervals to read it, so this rank stops with the cause.
            deadline = self._clock() + 2 * self.interval_s + 0.5
            while self._clock() < deadline and not self.giving_up:
                time.sleep(0.05)
            if self.giving_up:
                self._halt()  # the give-up path exits the process
        self._stop.set()  # the beat thread publishes DONE on its way out
        for thread in self._threads:
            thread.join(timeout=self.interval_s + 2)
        self._threads = []
        _ACTIVE = None

    # ------------------------------------------------------------------ judgement (any thread, no store I/O)

    def judge(self) -> None:
        """Exit if this rank was frozen past the limit, or if its store stopped answering; else return."""
        now = self._clock()
        frozen = now - self._last_watch > self.limit_s / 2  # the watch thread sleeps a fraction of an interval
        if now - self._last_published > self.limit_s:
            if frozen:
                self._exit_frozen(now)
            self._give_up_on_store(now - self._last_published)

    def _watch(self) -> None:
        while not self._stop.wait(self.interval_s / 2):
            now = self._clock()
            self.judge()
            self._last_watch = now
            store_silent = now - self._last_store_ok
            if store_silent > self.limit_s:
                self._give_up_on_store(store_silent)
            for peer in self.watched:
                stale = now - self._changed[peer]
                if self._seen.get(peer) == DONE.encode() or stale <= self.limit_s:
                    continue
                if store_silent > min(2 * self.interval_s + 1, self.limit_s / 2):
                    # The beat thread is stuck in a store call: the store's host froze, and that is why no
                    # heartbeat arrives (a peer's heartbeat is read a little before the store's last answer).
                    self._give_up_on_store(max(stale, store_silent))
                self._give_up({"rank": peer, "host": self._hosts.get(peer, "unknown host"), "seconds": round(stale, 1)})

    def _give_up_on_store(self, seconds: float) -> None:
        # torchrun hosts the store in its agent process (rank 0 then is watched like any rank); else rank 0 does.
        agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        self._give_up({"rank": 0, "host": self._hosts.get(0, self.env.master_addr),
                       "seconds": round(seconds, 1),
                       "store": f"{self.env.master_addr}:{self.env.master_port}",
                       "store_host": "torchrun's agent" if agent else "rank 0"},
                      publish=False)  # nobody can read a store that does not answer

    # ------------------------------------------------------------------ the beat thread (store I/O)

    def _beat(self) -> None:
        counter = 0
        while not self._stop.is_set():
            started = self._clock()
            self.judge()  # woken from a freeze: exit before the first heartbeat could say otherwise
            counter += 1
            try:
                self._store.set(self._key("beat", self.rank), str(counter))
                self._last_published = started  # peers saw it no earlier than this: the frozen check's bound
                self._read_peers()
                self._last_store_ok = self._clock()
            except Exception:  # noqa: BLE001 - a slow or lost store: the watch thread judges for how long
                pass
            self._stop.wait(self.interval_s)
        try:
            self._store.set(self._key("beat", self.rank), DONE)
        except Exception:  # noqa: BLE001 - leaving anyway
            pass

    def _read_peers(self) -> None:
        store = self._store
        if store.check([self._key("verdict")]):
            self._give_up(json.loads(store.get(self._key("verdict"))), publish=False)
        # multi_get waits for missing keys: read only neighbours that have published.
        present = [peer for peer in self.watched if store.check([self._key("beat", peer)])]
        now = self._clock()
        for peer, value in zip(present, store.multi_get([self._key("beat", peer) for peer in present])):
            if value != self._seen.get(peer):
                self._seen[peer], self._changed[peer] = value, now
        for peer in [0, *self.watched]:
            if peer not in self._hosts and peer != self.rank and store.check([self._key("host", peer)]):
                self._hosts[peer] = store.get(self._key("host", peer)).decode()

    def _key(self, *parts) -> str:
        return "/".join([self._prefix, *map(str, parts)])

    # ------------------------------------------------------------------ stopping

    def _give_up(self, verdict: dict, *, publish: bool = True) -> None:
        """Print once, publish the verdict, let the other ranks read it, release the lock, exit RERUN_EXIT_CODE."""
        if not self._give_up_lock.acquire(blocking=False):
            self._halt()  # another thread of this rank is already stopping it
        self.giving_up = True
        print(f"ds-capture: rank {self.rank} stopping: {describe(verdict, self.limit_s)} Rerun the same command to "
              "continue: finished shards are kept, only the rest is recomputed.", file=sys.stderr, flush=True)
        if verdict.get("store"):
            # Nobody can read a store that does not answer: nothing to publish or wait for.
            time.sleep(2 * self.interval_s + 0.5)
        else:
            # In a thread of its own: a store call may hang, and this rank must stop anyway.
            record = json.dumps({**verdict, "reporter": self.rank}) if publish else None
            waiter = threading.Thread(target=self._publish_and_wait_for_peers, args=(record,), daemon=True)
            waiter.start()
            waiter.join(timeout=self.stop_wait_s() + 1.0)
        self._leave(RERUN_EXIT_CODE)

    def stop_wait_s(self) -> float:
        """How long a stopping rank waits, at most, for every other live rank to have read the verdict."""
        return 4 * self.interval_s + 3.0

    def _publish_and_wait_for_peers(self, record: str | None) -> None:
        """Publish the verdict (``record``, if this rank reports it), count this rank as stopping, and wait until
        every rank but the one that stopped answering has (or ``stop_wait_s``: several may be frozen)."""
        deadline = time.monotonic() + self.stop_wait_s()
        try:
            if record is not None:
                self._store.set(self._key("verdict"), record)
            stopping = self._store.add(self._key("stopping"), 1)
            while stopping < self.env.world_size - 1 and time.monotonic() < deadline:
                time.sleep(min(0.1, self.interval_s / 2))
                stopping = self._store.add(self._key("stopping"), 0)
        except Exception:  # noqa: BLE001 - a store gone quiet: leave anyway
            pass

    def _exit_frozen(self, now: float) -> None:
        if not self._give_up_lock.acquire(blocking=False):
            self._halt()
        self.giving_up = True
        print(f"ds-capture: rank {self.rank} (host {socket.gethostname()}) was stopped or frozen: its last heartbeat "
              f"is {now - self._last_published:.1f} s old, over {CONFIG_KEY} ({self.limit_s:g} s), so its peers have "
              "given up on it; it exits without publishing or writing anything. Rerun the same command to continue.",
              file=sys.stderr, flush=True)
        self._leave(RERUN_EXIT_CODE, release_lock=False)  # the lock is no longer ours to remove

    def _leave(self, code: int, *, release_lock: bool = True) -> None:
        if release_lock:
            release_held_locks()
        if self.env.world_size > 1:  # what distributed_session's teardown would have removed
            remove_shm_buffers(self.env.master_addr, self.env.master_port, ranks=[self.env.rank])
        sys.stdout.flush()
        sys.stderr.flush()
        # The main thread may be blocked in a collective that will never complete: no unwinding.
        self._exit_process(code)
        self._exited.set()  # reached only where an injected exit returned (tests): unwind this thread
        self._halt()

    def _halt(self) -> None:
        """Wait for the thread that is stopping this process (forever, under os._exit)."""
        self._exited.wait()
        raise SystemExit(RERUN_EXIT_CODE)


def describe(verdict: dict, limit_s: float) -> str:
    """One sentence naming who stopped answering, from a verdict record."""
    if verdict.get("store"):
        who = "rank 0" if verdict["store_host"] == "rank 0" else verdict["store_host"]
        return (f"{who} (host {verdict['host']}), which hosts the job's store at {verdict['store']}, stopped "
                f"answering: no reply for {verdict['seconds']:.1f} s, over {CONFIG_KEY} ({limit_s:g} s).")
    return (f"rank {verdict['rank']} (host {verdict['host']}) stopped answering: no heartbeat for "
            f"{verdict['seconds']:.1f} s, over {CONFIG_KEY} ({limit_s:g} s).")


def _connect(env: DistEnv, interval_s: float):
    """A client connection of our own to the job's TCP store (rank 0's or torchrun's agent's)."""
    from torch.distributed import TCPStore

    return TCPStore(env.master_addr, env.master_port, is_master=False, wait_for_workers=False,
                    timeout=timedelta(seconds=max(10.0, 5 * interval_s)))


def _quiet(target: Callable[[], None]) -> Callable[[], None]:
    """A thread body whose SystemExit (``_halt`` under an injected exit) ends the thread without a report."""
    def run() -> None:
        try:
            target()
        except SystemExit:
            pass

    return run
