"""discover_env over each launcher's variable set (pure dicts), its refusals, and the no-process-group helpers."""

from __future__ import annotations

import pytest

from ds_capture.errors import CaptureError
from ds_capture.parallel.dist import (
    DistEnv,
    agree_on_error,
    all_reduce_max_int,
    discover_env,
    expand_tasks_per_node,
    first_slurm_host,
    shm_buffer_glob,
)

MASTER = {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29600"}


def test_no_launcher_is_single_process():
    assert discover_env({}) == DistEnv(0, 1, 0, 1, "127.0.0.1", 29500, "single")


def test_deepspeed_launcher():
    environ = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_SIZE": "2", "CROSS_RANK": "1",
               "CROSS_SIZE": "2", **MASTER}
    assert discover_env(environ) == DistEnv(3, 4, 1, 2, "10.0.0.1", 29600, "deepspeed")


def test_torchrun():
    environ = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0",
               "TORCHELASTIC_RUN_ID": "none", **MASTER}
    assert discover_env(environ) == DistEnv(1, 2, 1, 2, "10.0.0.1", 29600, "torchrun")


def test_torchrun_inside_slurm_uses_torchrun_ranks():
    environ = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "SLURM_PROCID": "1",
               "SLURM_NTASKS": "2", "SLURM_LOCALID": "0", "SLURM_NTASKS_PER_NODE": "1", **MASTER}
    assert discover_env(environ) == DistEnv(5, 8, 1, 4, "10.0.0.1", 29600, "torchrun")


def test_openmpi_single_host_defaults_master():
    environ = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
               "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    assert discover_env(environ) == DistEnv(1, 2, 1, 2, "127.0.0.1", 29500, "openmpi")


def test_openmpi_multi_host_needs_master_addr():
    environ = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
               "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    with pytest.raises(CaptureError) as error:
        discover_env(environ)
    assert str(error.value).startswith(
        "openmpi job spans several hosts (OMPI_COMM_WORLD_SIZE=4, OMPI_COMM_WORLD_LOCAL_SIZE=2) but MASTER_ADDR "
        "is not set")
    assert discover_env({**environ, **MASTER}) == DistEnv(1, 4, 1, 2, "10.0.0.1", 29600, "openmpi")


def test_mpich_and_intel_mpi():
    environ = {"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2", **MASTER}
    assert discover_env(environ) == DistEnv(2, 4, 0, 2, "10.0.0.1", 29600, "mpich")


def test_slurm_with_ntasks_per_node_and_hostlist():
    environ = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_NTASKS_PER_NODE": "4",
               "SLURM_JOB_NODELIST": "gpu[007-008]"}
    assert discover_env(environ) == DistEnv(5, 8, 1, 4, "gpu007", 29500, "slurm")


def test_slurm_with_tasks_per_node_notation():
    environ = {"SLURM_PROCID": "6", "SLURM_NTASKS": "7", "SLURM_LOCALID": "0", "SLURM_TASKS_PER_NODE": "3(x2),1",
               "SLURM_NODEID": "2", "SLURM_NODELIST": "a1,b2", "MASTER_PORT": "1234"}
    assert discover_env(environ) == DistEnv(6, 7, 0, 1, "a1", 1234, "slurm")


def test_slurm_helpers():
    assert expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert first_slurm_host("gpu[003-005,9],cpu1") == "gpu003"
    assert first_slurm_host("node1,node2") == "node1"
    assert first_slurm_host("rack[2-3]-n[01-04]") == "rack2-n01"
    assert first_slurm_host("n[10-12]x") == "n10x"


def test_incomplete_deepspeed_env_names_missing_keys():
    with pytest.raises(CaptureError) as error:
        discover_env({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_SIZE": "2"})
    assert str(error.value).startswith(
        "deepspeed environment is incomplete: LOCAL_RANK, MASTER_ADDR, MASTER_PORT missing (found RANK, "
        "WORLD_SIZE of RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT).")


def test_rank_without_local_size_is_refused():
    with pytest.raises(CaptureError, match="none of LOCAL_SIZE / LOCAL_WORLD_SIZE says how many ranks"):
        discover_env({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", **MASTER})


def test_conflicting_local_sizes():
    environ = {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_SIZE": "2", "LOCAL_WORLD_SIZE": "4",
               **MASTER}
    with pytest.raises(CaptureError) as error:
        discover_env(environ)
    assert str(error.value) == ("conflicting local sizes in the environment: LOCAL_SIZE=2, LOCAL_WORLD_SIZE=4. "
                                "Unset the stale ones so one launcher describes this process.")


def test_nested_launchers_with_different_ranks():
    environ = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_SIZE": "2", "OMPI_COMM_WORLD_RANK": "0",
               **MASTER}
    with pytest.raises(CaptureError) as error:
        discover_env(environ)
    assert str(error.value).startswith("conflicting launcher variables: RANK=1 but OMPI_COMM_WORLD_RANK=0.")


def test_rank_outside_world_and_bad_integers():
    with pytest.raises(CaptureError, match=r"inconsistent torchrun environment: rank=2 world_size=2"):
        discover_env({"RANK": "2", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2", **MASTER})
    with pytest.raises(CaptureError) as error:
        discover_env({"RANK": "x", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_SIZE": "2", **MASTER})
    assert str(error.value) == "environment variable RANK='x' is not an integer."


def test_helpers_without_process_group():
    assert all_reduce_max_int(7) == 7
    agree_on_error(None)
    with pytest.raises(CaptureError, match="refused"):
        agree_on_error(CaptureError("refused"))
    assert shm_buffer_glob("127.0.0.1", 1234, uid=0) == "/dev/shm/deepspeed_allreduce_buffer_0_127.0.0.1_1234_*"
