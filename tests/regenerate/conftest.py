"""The real server of the regenerate tests, started once, and a check that every test leaves nothing behind.

- ``served_demo_target``: ``transformers serve`` serving the demo target (built in code under the session's
  DS_CAPTURE_HOME) on a reserved port, offline, started once per session and stopped at its end; a test may
  stop and start it again (a restart listens on a new port).
- After each test (autouse): a process the test started below pytest that still runs and is not that server fails
  the test and is killed.
"""

from __future__ import annotations

import os
import signal

import pytest

from tests.distributed import launchers
from tests.regenerate.server import TransformersServe

_SERVERS: list[TransformersServe] = []


@pytest.fixture(scope="session")
def served_demo_target(tmp_path_factory: pytest.TempPathFactory) -> TransformersServe:
    from ds_capture.demo import ensure_demo_target

    server = TransformersServe(ensure_demo_target(), tmp_path_factory.mktemp("transformers_serve"))
    _SERVERS.append(server)
    try:
        server.start()
        yield server
    finally:
        server.stop()
        _SERVERS.remove(server)


def _server_processes() -> set[int]:
    pids = {server.pid for server in _SERVERS if server.pid is not None}
    return pids | {child for pid in pids for child in launchers.descendants(pid)}


@pytest.fixture(autouse=True)
def nothing_left_behind():
    # What was running before the test is not its doing (an earlier module's session fixture, e.g. the Slurm
    # daemons of tests/distributed/test_slurm.py, lives on below pytest until the session ends).
    before = set(launchers.descendants(os.getpid()))
    yield
    leftover = [pid for pid in launchers.descendants(os.getpid())
                if launchers._alive(pid) and pid not in _server_processes() and pid not in before]
    if leftover:
        launchers.send_signal(leftover, signal.SIGKILL)
    assert not leftover, f"the test left processes running: {leftover}"
