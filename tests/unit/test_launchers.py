"""The test launchers' ports: reserved outside the kernel's ephemeral range, never shared by two runs, and a
start that failed with EADDRINUSE (a real torch TCPStore on a port taken after it was reserved, the way a
gloo connection or store client of a concurrent job takes one) retried on a new port; other failures are not."""

from __future__ import annotations

import random
import socket
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
import launchers  # noqa: E402

# A rank 0 in miniature: host the job's TCP store on the reserved master port, as init_process_group does.
STORE_HOST = ("import os, datetime, torch.distributed as d; first = int(os.environ['DS_CAPTURE_TEST_PORTS']."
              "split(':')[0]); d.TCPStore('127.0.0.1', first, is_master=True, wait_for_workers=False, "
              "timeout=datetime.timedelta(seconds=5)); print('listening on', first)")


def ephemeral_range() -> range:
    low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    return range(low, high + 1)


class Draws:
    """An rng for reserve_ports that draws ``values`` first, then random ports."""

    def __init__(self, *values: int) -> None:
        self.values, self.rest = list(values), random.Random(0)

    def randrange(self, start: int, stop: int) -> int:
        return self.values.pop(0) if self.values else self.rest.randrange(start, stop)


def test_reserved_ports_are_outside_the_ephemeral_range_and_never_handed_out_twice():
    with launchers.reserve_ports(4) as first:
        block = set(range(first, first + 4))
        assert not block & set(ephemeral_range())
        # Another run drawing the very same block (and blocks overlapping it) is moved elsewhere meanwhile.
        with launchers.reserve_ports(4, rng=Draws(first, first + 3, first - 3)) as other:
            assert other not in (first, first + 3, first - 3) and not set(range(other, other + 4)) & block
    # Released: the block can be reserved again.
    with launchers.reserve_ports(4, rng=Draws(first)) as again:
        assert again == first


def test_a_port_someone_listens_on_is_not_reserved():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", launchers.reservable_ports().start))
        busy.listen()
        taken = busy.getsockname()[1]
        with pytest.raises(RuntimeError, match="no 1 consecutive free ports"):
            with launchers.reserve_ports(1, rng=Draws(taken, taken, taken), tries=3):
                pass


def occupy_after_reservation(monkeypatch, times: int) -> tuple[list[int], list[socket.socket]]:
    """The race of issue 21: the first ``times`` reserved ports get taken (a connected socket's local end, as a
    gloo pair's) after the reservation checked them and before the job binds. Returns the ports reserved and
    the sockets sitting on them."""
    reserved, sockets = [], []
    real_bindable = launchers._bindable

    def bindable_then_taken(port: int) -> bool:
        free = real_bindable(port)
        if not free:
            return False  # busy already (another job on this box): the reservation moves on; not counted
        if len(reserved) < times:
            server = socket.socket()
            server.bind(("127.0.0.1", 0))
            server.listen()
            client = socket.socket()
            client.bind(("127.0.0.1", port))  # the local end of an outgoing connection sits on the port
            client.connect(server.getsockname())
            sockets.extend([server, client])
        reserved.append(port)
        return True

    monkeypatch.setattr(launchers, "_bindable", bindable_then_taken)
    return reserved, sockets


def test_a_start_that_failed_with_eaddrinuse_is_retried_on_a_new_port(monkeypatch):
    reserved, sockets = occupy_after_reservation(monkeypatch, times=1)
    try:
        result = launchers.run_launcher("single", 1, ["-c", STORE_HOST], timeout_s=60)
    finally:
        for sock in sockets:
            sock.close()
    assert result.returncode == 0 and result.attempts == 2, result.stdout[-2000:]
    assert result.master_port == reserved[1] != reserved[0]
    assert f"listening on {reserved[1]}" in result.stdout


def test_retries_are_bounded_and_the_last_failure_is_returned(monkeypatch):
    reserved, sockets = occupy_after_reservation(monkeypatch, times=launchers.START_ATTEMPTS)
    try:
        result = launchers.run_launcher("single", 1, ["-c", STORE_HOST], timeout_s=60)
    finally:
        for sock in sockets:
            sock.close()
    assert result.attempts == launchers.START_ATTEMPTS and result.returncode != 0
    assert f"port: {reserved[-1]}, useIpv6: false, code: -98, name: EADDRINUSE" in result.stdout, result.stdout[-2000:]


def test_other_failures_are_not_retried():
    result = launchers.run_launcher("single", 1, ["-c", "import sys; print('bad config'); sys.exit(2)"], timeout_s=30)
    assert (result.returncode, result.attempts) == (2, 1)
    assert not launchers.start_failed_on_port(result)
    assert launchers.start_failed_on_port(subprocess.CompletedProcess([], 1, "... name: EADDRINUSE, message: ...", ""))


def test_torchrun_wrapper_exits_75_only_when_every_rank_of_the_node_recorded_75(tmp_path, monkeypatch):
    from ds_capture.parallel.torchrun_exit import EXIT_DIR_ENV, ranks_stopped_to_rerun, record_exit_code

    monkeypatch.setenv(EXIT_DIR_ENV, str(tmp_path))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert not ranks_stopped_to_rerun(tmp_path)  # no rank said anything: torchrun's own code stands
    for rank, code in ((0, 75), (1, 75)):
        monkeypatch.setenv("RANK", str(rank))
        record_exit_code(code)
    assert (tmp_path / "rank-1").read_text() == "75 2\n"
    assert ranks_stopped_to_rerun(tmp_path)
    (tmp_path / "rank-1").unlink()  # one rank never got to record (killed): not a clean stop of the node
    assert not ranks_stopped_to_rerun(tmp_path)
    monkeypatch.setenv("RANK", "1")
    record_exit_code(2)
    assert not ranks_stopped_to_rerun(tmp_path)
