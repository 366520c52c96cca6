"""Every distributed test leaves nothing behind for the next one: no process, no listening port, no shm buffer.

After each test (autouse): a process it started that still runs below pytest (a rank, a launcher, an mpirun)
is killed and the test fails naming it; so does a socket of this process still listening on a port the test's launches
reserved, and a DeepSpeed ``/dev/shm`` all-reduce buffer named after such a port (removed). Each port is
checked while its reservation flock is held again, so a concurrent suite that reserved it since (and may be
using it) is skipped, never inspected or cleaned.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

from tests.distributed import launchers


def _running_descendants() -> list[int]:
    return [pid for pid in launchers.descendants(os.getpid()) if launchers._alive(pid)]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:160]
    except OSError:
        return "?"


def _launcher_modules() -> list:
    """The helpers are imported both as ``tests.distributed.launchers`` and (from sys.path) as ``launchers``."""
    return [module for name in ("tests.distributed.launchers", "launchers") if (module := sys.modules.get(name))]


def _own_listening_ports() -> set[int]:
    """Ports a socket of this process listens on (``/proc/net/tcp*`` rows whose inode is one of our fds)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


@pytest.fixture(autouse=True)
def nothing_left_behind():
    # Processes of module/session fixtures (set up before this) are theirs to stop; their launches' ports and
    # buffers are checked at the end of the first test.
    before = set(_running_descendants())
    yield
    handed_out = []
    for module in _launcher_modules():
        handed_out += module.HANDED_OUT
        module.HANDED_OUT.clear()
    problems = []
    leftover = [pid for pid in _running_descendants() if pid not in before]
    if leftover:
        problems.append("processes still running: " + "; ".join(f"{pid} {_cmdline(pid)}" for pid in leftover))
        launchers.send_signal(leftover, signal.SIGKILL)
    ports = sorted({first + offset for first, count in handed_out for offset in range(count)})
    listening = sorted(set(ports) & _own_listening_ports())
    if listening:
        problems.append(f"this process still listens on ports {listening}")
    buffers = []
    for port in ports:
        held = launchers._lock_block(port, 1)
        if held is None:
            continue  # reserved again since, by a run that may be using it: not ours to judge
        try:
            buffers += launchers.shm_buffers(port)
            for path in launchers.shm_buffers(port):
                path.unlink(missing_ok=True)
        finally:
            os.close(held[0])
    if buffers:
        problems.append(f"shm buffers left in /dev/shm: {[str(p) for p in buffers]}")
    assert not problems, "the test left things behind: " + " | ".join(problems)
