"""Real gloo ranks through every launcher: discovery, init, all-reduce, TP sub-groups, agreed error, clean exit.

Each test runs tests/distributed/_probe_dist.py (see its docstring) and parses its ``PROBE`` lines.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from launchers import ensure_shm_op_built, have_mpirun, run_launcher  # noqa: E402

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(120)]
PROBE = "tests/distributed/_probe_dist.py"
REFUSAL = "probe refusal on rank 0: output directory belongs to another run"

# Built at collection time, outside every test's 120 s budget (a no-op once cached).
ensure_shm_op_built()


def probes(result) -> list[dict]:
    assert result.returncode == 0, result.stdout[-6000:]
    decoder, text = json.JSONDecoder(), result.stdout
    # ranks share one log: a report may be followed by another rank's output on the same line
    reports = [decoder.raw_decode(text, at + len("PROBE "))[0] for at in _find_all(text, "PROBE {")]
    assert result.leftover_shm == [], "the job left its shm buffers behind"
    return sorted(reports, key=lambda r: r["env"]["rank"])


def _find_all(text: str, needle: str) -> list[int]:
    found, at = [], text.find(needle)
    while at >= 0:
        found.append(at)
        at = text.find(needle, at + 1)
    return found


def check_world(reports: list[dict], world_size: int, launcher: str, local_size: int) -> None:
    assert [r["env"]["rank"] for r in reports] == list(range(world_size))
    for report in reports:
        env = report["env"]
        assert (env["world_size"], env["local_size"], env["launcher"]) == (world_size, local_size, launcher)
        assert env["master_addr"] == "127.0.0.1"
        assert report["world_sum"] == world_size * (world_size + 1) / 2
        assert report["max_rank"] == world_size - 1
        assert report["agreed"] == REFUSAL


# CI cut: the plain deepspeed form; the hostfile form (also launched in CI by test_launch_forms.py's two "nodes") with
# --full.
@pytest.mark.parametrize("kind", ["deepspeed", pytest.param("deepspeed_hostfile", marks=pytest.mark.slow)])
def test_deepspeed_local(kind):
    reports = probes(run_launcher(kind, 2, [PROBE], None, 100))
    check_world(reports, 2, "deepspeed", 2)
    assert all(r["launcher_local_size"] == "2" for r in reports)
    assert all(r["shm_files_during_run"] == 2 for r in reports)  # the shm op was live, and was cleaned


def test_deepspeed_module_with_two_tp_groups_sums_within_each():
    """World 4 = 2 TP groups of 2 on one host: the shm op would sum all four ranks without the repair."""
    reports = probes(run_launcher("deepspeed_module", 4, ["-m", "tests.distributed._probe_dist", "--tp", "2"],
                                  None, 110))
    check_world(reports, 4, "deepspeed", 4)
    assert [r["tp_sum"] for r in reports] == [3.0, 3.0, 7.0, 7.0]
    assert [r["tp_ranks"] for r in reports] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert all(r["shm_level"] == 0 for r in reports)


def test_torchrun_exports_local_size_and_keeps_shm_for_whole_world_tp():
    reports = probes(run_launcher("torchrun", 2, [PROBE, "--tp", "2"], None, 100))
    check_world(reports, 2, "torchrun", 2)
    assert all(r["launcher_local_size"] is None for r in reports)  # torchrun sets LOCAL_WORLD_SIZE only
    assert [r["tp_sum"] for r in reports] == [3.0, 3.0]
    assert all(r["shm_level"] >= 1 for r in reports)  # TP group == world on one host: fast path kept


def test_two_simulated_nodes_do_not_segfault():
    """LOCAL_SIZE=1, world 2: the uninitialised shm op would segfault in inference_all_reduce."""
    reports = probes(run_launcher("deepspeed_two_nodes", 2, [PROBE, "--tp", "2"], None, 100))
    check_world(reports, 2, "deepspeed", 1)
    assert [r["tp_sum"] for r in reports] == [3.0, 3.0]
    assert all(r["shm_files_during_run"] == 0 and r["shm_level"] == 0 for r in reports)


@pytest.mark.skipif(not have_mpirun(), reason="needs openmpi-bin and mpi4py")
def test_mpirun():
    reports = probes(run_launcher("mpirun", 2, [PROBE], None, 100))
    check_world(reports, 2, "openmpi", 2)


def test_error_exit_still_tears_down_cleanly():
    result = run_launcher("torchrun", 2, [PROBE, "--fail"], None, 100)
    assert result.returncode != 0 and result.returncode != 124, result.stdout[-4000:]
    assert result.stdout.count("PROBE {") == 2
    assert "SIGABRT" not in result.stdout and "Segmentation fault" not in result.stdout
    assert result.leftover_shm == []


@pytest.mark.slow
def test_without_repair_the_shm_op_sums_across_tp_groups():
    """The trap itself (DESIGN §6), so the repaired test above is known to be able to fail (--full: it shows a fact
    of DeepSpeed 0.19.8, not of ds_capture)."""
    reports = probes(run_launcher("deepspeed", 4, [PROBE, "--tp", "2", "--no-repair"], None, 110))
    assert [r["tp_sum"] for r in reports] == [10.0, 10.0, 10.0, 10.0]
