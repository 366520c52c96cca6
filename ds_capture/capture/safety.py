"""Safety for long runs: exclusive ownership of the output directory, fail-fast across ranks, input fingerprints.

In: the output directory, the process group's store, the dataset/tokenizer paths. Out:
- :class:`OutputLock`: ``.ds_capture/lock`` created with O_EXCL by rank 0 (host, pid, start time,
  refreshed as a heartbeat). A second job is refused; a lock left by a dead job (same host: its pid is
  gone; any host: heartbeat older than ``STALE_AFTER_S``) is reclaimed with a message saying so.
- :class:`FailFast`: a rank that fails publishes its error in the c10d store; a watchdog thread on
  every rank polls the store and ends the process within ``POLL_S`` seconds with the root cause, so
  a dead peer costs seconds, not the collective timeout. The failing rank prints the cause once.
- :func:`input_fingerprints`: sha256 of the dataset's bytes and of the tokenizer files, recorded in
  the manifest's bookkeeping so a rerun over changed inputs under the same paths is refused.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ds_capture.capture.liveness import HELD_LOCKS, refuse_if_frozen, stopping
from ds_capture.errors import CaptureError

_LOG = logging.getLogger("ds_capture")

# This project's bookkeeping inside a cache directory (the lock, checksum sidecars, the kinds' run records); NeMo
# ignores it. Defined here, where the lock is taken; the cache kinds name it through cache.common.names.
BOOKKEEPING_DIR = ".ds_capture"
LOCK_NAME = "lock"
STALE_AFTER_S = 600.0
STARTING_GRACE_S = 60.0
HEARTBEAT_S = 30.0
POLL_S = 1.0
_ABORT_KEY = "ds_capture/abort"


class OutputLock:
    """Exclusive ownership of a cache directory for one job (taken by rank 0 only)."""

    def __init__(self, out_dir: Path) -> None:
        self.path = Path(out_dir) / BOOKKEEPING_DIR / LOCK_NAME
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        record = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}
        self._stop.clear()  # the same lock may be taken again after a release
        for _attempt in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                self._reclaim_if_stale()
                continue
            with os.fdopen(fd, "w") as handle:
                json.dump(record, handle)
            self._thread = threading.Thread(target=self._heartbeat, name="ds_capture-lock", daemon=True)
            self._thread.start()
            HELD_LOCKS.add(self)
            return
        raise CaptureError(f"could not take the lock {self.path}; another job is starting in the same directory.")

    def release(self) -> None:
        HELD_LOCKS.discard(self)
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self.path.unlink(missing_ok=True)
            self._thread = None

    def abandon(self) -> None:
        """Remove the lock file from any thread, joining nothing: for a rank that stops with ``os._exit``."""
        self._stop.set()
        self.path.unlink(missing_ok=True)
        HELD_LOCKS.discard(self)

    def __enter__(self) -> "OutputLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                os.utime(self.path)
            except FileNotFoundError:
                return

    def _reclaim_if_stale(self) -> None:
        """Remove the lock if its job is dead; raise CaptureError naming the job if it is alive.

        Check and removal happen under an flock of ``lock.reclaim``: two jobs that both found the same
        stale lock must not both remove "it" (the second would remove the first one's new, live lock).
        """
        with _flocked(self.path.with_name(self.path.name + ".reclaim")):
            try:
                text = self.path.read_text()
                age = time.time() - self.path.stat().st_mtime
            except FileNotFoundError:
                return  # released meanwhile: O_EXCL decides who takes it next
            try:
                holder = json.loads(text)
            except json.JSONDecodeError:
                if age < STARTING_GRACE_S:  # created, its record not yet written: a job is starting
                    raise CaptureError(f"could not take the lock {self.path}; another job is starting in the "
                                       "same directory.") from None
                holder = {}  # a torn record left by a job killed while starting
            same_host = holder.get("host") == socket.gethostname()
            # A live job refreshes the lock every HEARTBEAT_S: an old heartbeat means a dead job, even
            # where its pid has been reused by another process since.
            alive = age < STALE_AFTER_S and (_pid_alive(holder.get("pid")) if same_host else bool(holder))
            if alive:
                started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("started", 0)))
                raise CaptureError(
                    f"{self.path.parent.parent} is in use by another ds_capture job (host {holder.get('host')}, "
                    f"pid {holder.get('pid')}, started {started}). Wait for it to finish, or use another "
                    f"cache_output_dir. If that job is dead on another host, delete {self.path}."
                )
            _LOG.warning("reclaiming a stale lock %s left by a dead job (host %s, pid %s, last heartbeat %.0f s ago)",
                         self.path, holder.get("host"), holder.get("pid"), age)
            self.path.unlink(missing_ok=True)


@contextmanager
def _flocked(path: Path) -> Iterator[None]:
    """An exclusive flock on ``path`` (created if missing); a filesystem without flock gets none."""
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:  # e.g. a shared filesystem mounted without lock support
            pass
        yield
    finally:
        os.close(fd)  # closing releases the flock


def _pid_alive(pid) -> bool:
    if not isinstance(pid, int):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class FailFast:
    """Publish a local failure to every rank; end every rank within seconds of any rank's failure."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.store = _default_store()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "FailFast":
        if self.store is not None:
            self._thread = threading.Thread(target=self._watch, name="ds_capture-failfast", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        from ds_capture.parallel.dist import AgreedError

        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * POLL_S)
        if exc is None or self.store is None or isinstance(exc, (KeyboardInterrupt, SystemExit)):
            return
        first = None if isinstance(exc, AgreedError) else self._failure_of_another_rank()
        if first is None:
            self.publish(exc)
            return
        # A peer failed first and this rank's error is its echo (a collective broken by the peer's exit,
        # faster than the watchdog's poll): report the root cause, not the echo.
        raise CaptureError(f"rank {self.rank} stopped because rank {first['rank']} failed: {first['message']}") from exc

    def _failure_of_another_rank(self) -> dict | None:
        try:
            if self.store.check([_ABORT_KEY]):
                failure = json.loads(self.store.get(_ABORT_KEY))
                return failure if failure["rank"] != self.rank else None
        except Exception:  # noqa: BLE001 - the store may be gone with rank 0
            pass
        return None

    def publish(self, error: BaseException) -> None:
        message = str(error) if isinstance(error, CaptureError) else f"{type(error).__name__}: {error}"
        refuse_if_frozen()  # a rank woken after its peers gave up publishes nothing
        try:
            if not self.store.check([_ABORT_KEY]):
                self.store.set(_ABORT_KEY, json.dumps({"rank": self.rank, "message": message}))
        except Exception:  # noqa: BLE001 - the store may already be gone with rank 0
            pass

    def _watch(self) -> None:
        while not self._stop.wait(POLL_S):
            refuse_if_frozen()  # woken from a freeze: the store's silence is its own peers' verdict, not news
            try:
                if not self.store.check([_ABORT_KEY]):
                    continue
                failure = json.loads(self.store.get(_ABORT_KEY))
            except Exception:  # noqa: BLE001 - the store's host (rank 0) died: that is a failure too
                failure = {"rank": 0, "message": "lost contact with rank 0 (the process-group store); it died"}
            if self._stop.is_set() or failure["rank"] == self.rank or stopping():
                return  # (stopping: this rank's watchdog is ending it; a peer leaving meanwhile is that stop's echo)
            print(f"ds-capture: rank {self.rank} stopping because rank {failure['rank']} failed: "
                  f"{failure['message']}", file=sys.stderr, flush=True)
            os._exit(1)  # the main thread may be blocked in a collective that will never complete


def _default_store():
    import torch.distributed as torch_dist

    if not torch_dist.is_initialized():
        return None
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store()
    except Exception:  # noqa: BLE001 - private API; without it we fall back to the launcher's teardown
        return None


def input_fingerprints(data_path: Path, tokenizer_dir: Path, *, invalid_rows: str = "refuse") -> dict[str, str]:
    """sha256 of the dataset's bytes (a file, or every file of a directory) and of the tokenizer files, and
    ``capture.invalid_rows`` (which rows of that dataset the cache holds)."""
    tokenizer_files = [tokenizer_dir / name for name in (
        "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
        "tokenizer.model", "chat_template.jinja", "chat_template.json")]
    return {
        "train_data_sha256": _hash_paths(_files_of(data_path)),
        "tokenizer_sha256": _hash_paths([p for p in tokenizer_files if p.is_file()]),
        "invalid_rows": invalid_rows,
    }


def _files_of(path: Path) -> list[Path]:
    if path.is_dir():
        return sorted(p for p in path.rglob("*") if p.is_file())
    return [path] if path.is_file() else []


def _hash_paths(paths: list[Path]) -> str:
    digest = hashlib.sha256()
    for path in paths:
        digest.update(path.name.encode() + b"\0")
        with open(path, "rb") as handle:
            while chunk := handle.read(1 << 24):
                digest.update(chunk)
    return digest.hexdigest()
