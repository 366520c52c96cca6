"""Distributed environment: launcher discovery, process-group init/teardown, DeepSpeed CPU comm repair.

In:  the process environment a launcher left behind (``deepspeed``, ``torchrun``, OpenMPI /
     MPICH / Intel MPI ``mpirun``, Slurm ``srun``, or nothing at all).
Out: a frozen :class:`DistEnv` (rank, world, local size, master address, launcher), an initialised
     DeepSpeed/torch process group (none for a world of 1), and collectives the runner needs to stay
     in lockstep: :func:`agree_on_error`, :func:`all_reduce_max_int` and :func:`all_gather_int`.

Traps handled here (DESIGN §6): DeepSpeed's CPU shared-memory all-reduce is initialised only when
``LOCAL_SIZE == WORLD_SIZE``, segfaults when used without that, ignores the process group it is
given, and leaves ``/dev/shm/deepspeed_allreduce_buffer_*`` behind; gloo jobs that exit without
``destroy_process_group`` abort at random.
"""

from __future__ import annotations

import glob
import logging
import os
import re
import shutil
import subprocess
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

from ds_capture.errors import CaptureError


def quiet_deepspeed_accelerator() -> None:
    """Without a GPU, name DeepSpeed's accelerator (``DS_ACCELERATOR=cpu`` unless set) before anything imports
    DeepSpeed (transformers' integrations do, too): DeepSpeed otherwise announces its CPU fallback with a warning
    on stdout, which corrupts ``ds-capture plan --json`` and the benchmarks' JSON."""
    import torch

    if "DS_ACCELERATOR" not in os.environ and not torch.cuda.is_available():
        os.environ["DS_ACCELERATOR"] = "cpu"


def import_deepspeed():
    """``import deepspeed`` with its log on stderr (DeepSpeed's logger writes to stdout); every DeepSpeed import
    of ours goes through this."""
    import sys

    quiet_deepspeed_accelerator()
    import deepspeed
    from deepspeed.utils.logging import logger as ds_logger

    for handler in ds_logger.handlers:
        if isinstance(handler, logging.StreamHandler) and handler.stream is sys.stdout:
            handler.setStream(sys.stderr)
    return deepspeed


logger = logging.getLogger(__name__)

LAUNCHERS = ("single", "deepspeed", "torchrun", "openmpi", "mpich", "slurm")
DEFAULT_MASTER_PORT = 29500
# How long a teardown barrier may wait after an error before giving up on dead peers.
ERROR_BARRIER_SECONDS = 10
# The C++ op names its buffers "<prefix>_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank>" (deepspeed
# ops/csrc/cpu/comm/shm.cpp, shm_initialize).
SHM_BUFFER_PREFIX = "deepspeed_allreduce_buffer"
SHM_DIR = "/dev/shm"


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in the job, as the launcher told it."""

    rank: int
    """Global rank, ``0 .. world_size-1``."""
    world_size: int
    """Number of processes in the job."""
    local_rank: int
    """Rank among the processes on this host."""
    local_size: int
    """Number of processes on this host (DeepSpeed's ``LOCAL_SIZE``)."""
    master_addr: str
    """Address of rank 0's host (the TCP store and the shm buffer names use it)."""
    master_port: int
    """Port of the TCP store."""
    launcher: str
    """One of :data:`LAUNCHERS`."""

    @staticmethod
    def single() -> "DistEnv":
        return DistEnv(0, 1, 0, 1, "127.0.0.1", DEFAULT_MASTER_PORT, "single")


# --------------------------------------------------------------------------- discovery


def discover_env(environ: Mapping[str, str] = os.environ) -> DistEnv:
    """Read the launcher's variables (a pure function of ``environ``) into a :class:`DistEnv`.

    Precedence: ``RANK``-style variables (deepspeed / torchrun, also what DeepSpeed's MPI discovery
    exports) over MPI over Slurm, because ``torchrun`` and ``mpirun`` are often run *inside* a Slurm
    allocation whose ``SLURM_*`` variables describe the allocation, not the ranks.
    """
    if "RANK" in environ:
        return _discover_rank_style(environ)
    if "OMPI_COMM_WORLD_RANK" in environ:
        return _discover_mpi(environ, "openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                             "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE")
    if "PMI_RANK" in environ:
        return _discover_mpi(environ, "mpich", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS")
    if "SLURM_PROCID" in environ:
        return _discover_slurm(environ)
    return DistEnv.single()


def _discover_rank_style(environ: Mapping[str, str]) -> DistEnv:
    is_torchrun = "TORCHELASTIC_RUN_ID" in environ or "LOCAL_WORLD_SIZE" in environ
    launcher = "torchrun" if is_torchrun else "deepspeed"
    _require(environ, launcher, ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"))
    local_size_keys = [k for k in ("LOCAL_SIZE", "LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE") if k in environ]
    if not local_size_keys:
        raise CaptureError(
            f"{launcher} environment is incomplete: RANK is set but none of LOCAL_SIZE / LOCAL_WORLD_SIZE "
            "says how many ranks run on this host. Launch with `deepspeed` or `torchrun`, or export "
            "LOCAL_SIZE=<ranks on this host> next to RANK/WORLD_SIZE/LOCAL_RANK.")
    local_sizes = {k: _int(environ, k) for k in local_size_keys}
    if len(set(local_sizes.values())) > 1:
        shown = ", ".join(f"{k}={v}" for k, v in local_sizes.items())
        raise CaptureError(f"conflicting local sizes in the environment: {shown}. Unset the stale ones "
                           "so one launcher describes this process.")
    rank = _int(environ, "RANK")
    # DeepSpeed's own MPI discovery exports RANK from OMPI_*; a different value means two launchers.
    _agree(environ, "RANK", rank, ("OMPI_COMM_WORLD_RANK", "PMI_RANK"))
    world_size = _int(environ, "WORLD_SIZE")
    _agree(environ, "WORLD_SIZE", world_size, ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE"))
    return _checked(rank, world_size, _int(environ, "LOCAL_RANK"), local_sizes[local_size_keys[0]],
                    environ["MASTER_ADDR"], _int(environ, "MASTER_PORT"), launcher)


def _discover_mpi(environ: Mapping[str, str], launcher: str, rank_key: str, size_key: str,
                  local_rank_key: str, local_size_key: str) -> DistEnv:
    _require(environ, launcher, (rank_key, size_key, local_rank_key, local_size_key))
    world_size, local_size = _int(environ, size_key), _int(environ, local_size_key)
    master_addr = environ.get("MASTER_ADDR")
    if master_addr is None:
        if local_size != world_size:
            raise CaptureError(
                f"{launcher} job spans several hosts ({size_key}={world_size}, {local_size_key}={local_size}) "
                "but MASTER_ADDR is not set, so rank 0's address is unknown. Export it to every rank, e.g. "
                "`mpirun -x MASTER_ADDR=<first host> -x MASTER_PORT=29500 ...` (OpenMPI) or "
                "`mpiexec -genv MASTER_ADDR <first host> ...` (MPICH / Intel MPI).")
        master_addr = "127.0.0.1"
    port = _int(environ, "MASTER_PORT") if "MASTER_PORT" in environ else DEFAULT_MASTER_PORT
    return _checked(_int(environ, rank_key), world_size, _int(environ, local_rank_key), local_size,
                    master_addr, port, launcher)


def _discover_slurm(environ: Mapping[str, str]) -> DistEnv:
    _require(environ, "slurm", ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"))
    if "SLURM_NTASKS_PER_NODE" in environ:
        local_size = _int(environ, "SLURM_NTASKS_PER_NODE")
    elif "SLURM_TASKS_PER_NODE" in environ:
        per_node = expand_tasks_per_node(environ["SLURM_TASKS_PER_NODE"])
        node_id = _int(environ, "SLURM_NODEID") if "SLURM_NODEID" in environ else 0
        if node_id >= len(per_node):
            raise CaptureError(f"SLURM_NODEID={node_id} is outside SLURM_TASKS_PER_NODE="
                               f"{environ['SLURM_TASKS_PER_NODE']!r}; run the job step with `srun`.")
        local_size = per_node[node_id]
    else:
        raise CaptureError("slurm environment is incomplete: neither SLURM_NTASKS_PER_NODE nor "
                           "SLURM_TASKS_PER_NODE is set. Start the ranks with `srun` inside the allocation "
                           "(`#SBATCH --ntasks-per-node=N`).")
    master_addr = environ.get("MASTER_ADDR")
    if master_addr is None:
        nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
        if not nodelist:
            raise CaptureError("slurm environment is incomplete: SLURM_JOB_NODELIST / SLURM_NODELIST is "
                               "not set and neither is MASTER_ADDR. Export MASTER_ADDR=<first host>.")
        master_addr = first_slurm_host(nodelist)
    port = _int(environ, "MASTER_PORT") if "MASTER_PORT" in environ else DEFAULT_MASTER_PORT
    return _checked(_int(environ, "SLURM_PROCID"), _int(environ, "SLURM_NTASKS"), _int(environ, "SLURM_LOCALID"),
                    local_size, master_addr, port, "slurm")


def expand_tasks_per_node(value: str) -> list[int]:
    """``"2(x3),1"`` -> ``[2, 2, 2, 1]`` (Slurm's ``SLURM_TASKS_PER_NODE`` notation)."""
    counts: list[int] = []
    for part in value.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if match is None:
            raise CaptureError(f"cannot parse SLURM_TASKS_PER_NODE={value!r} (expected e.g. '4(x2),3').")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def first_slurm_host(nodelist: str) -> str:
    """First host of a Slurm hostlist: ``scontrol show hostnames`` when present, else parsed here."""
    if shutil.which("scontrol"):
        result = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                                timeout=30, check=False)
        if result.returncode == 0 and result.stdout.split():
            return result.stdout.split()[0]
    # "gpu[003-005,9],cpu1" -> "gpu003": the first comma at bracket depth 0 ends the first entry.
    depth, end = 0, len(nodelist)
    for index, char in enumerate(nodelist):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            end = index
            break
    first = nodelist[:end]
    # "rack[2-3]-n[01-04]" -> "rack2-n01": take the first value of each bracket, left to right
    while (match := re.fullmatch(r"([^\[]*)\[([^\]]+)\](.*)", first)) is not None:
        prefix, ranges, suffix = match.groups()
        first = prefix + ranges.split(",")[0].split("-")[0] + suffix
    return first


def _require(environ: Mapping[str, str], launcher: str, keys: tuple[str, ...]) -> None:
    missing = [k for k in keys if k not in environ]
    if missing:
        present = [k for k in keys if k in environ]
        raise CaptureError(f"{launcher} environment is incomplete: {', '.join(missing)} missing "
                           f"(found {', '.join(present) or 'none'} of {', '.join(keys)}). Start the job through "
                           "the launcher itself, or export all of them.")


def _int(environ: Mapping[str, str], key: str) -> int:
    try:
        return int(environ[key])
    except ValueError:
        raise CaptureError(f"environment variable {key}={environ[key]!r} is not an integer.") from None


def _agree(environ: Mapping[str, str], key: str, value: int, others: tuple[str, ...]) -> None:
    for other in others:
        if other in environ and _int(environ, other) != value:
            raise CaptureError(f"conflicting launcher variables: {key}={value} but {other}={environ[other]}. "
                               "Two launchers are nested (e.g. torchrun under mpirun); start the ranks with one.")


def _checked(rank: int, world_size: int, local_rank: int, local_size: int, master_addr: str,
             master_port: int, launcher: str) -> DistEnv:
    if not (world_size >= 1 and 0 <= rank < world_size and 1 <= local_size <= world_size
            and 0 <= local_rank < local_size and 0 < master_port < 65536):
        raise CaptureError(f"inconsistent {launcher} environment: rank={rank} world_size={world_size} "
                           f"local_rank={local_rank} local_size={local_size} master_port={master_port}; need "
                           "0 <= rank < world_size, 0 <= local_rank < local_size <= world_size, a valid port.")
    return DistEnv(rank, world_size, local_rank, local_size, master_addr, master_port, launcher)


# --------------------------------------------------------------------------- init / teardown


def init_distributed(env: DistEnv, *, backend: str | None, timeout_minutes: int) -> None:
    """Export the torch/DeepSpeed variables for ``env`` and create the default process group.

    A world of 1 needs no process group: only the variables are exported (so a later DeepSpeed
    call does not go looking for MPI). ``LOCAL_SIZE`` is exported exactly, because DeepSpeed's CPU
    shm all-reduce decides from it whether all ranks share this host.
    """
    import torch

    os.environ.update({
        "RANK": str(env.rank), "WORLD_SIZE": str(env.world_size), "LOCAL_RANK": str(env.local_rank),
        "LOCAL_SIZE": str(env.local_size), "MASTER_ADDR": env.master_addr, "MASTER_PORT": str(env.master_port),
    })
    if torch.cuda.is_available():
        torch.cuda.set_device(env.local_rank % torch.cuda.device_count())
    if env.world_size == 1:
        return
    deepspeed = import_deepspeed()
    deepspeed.init_distributed(dist_backend=backend or ("nccl" if torch.cuda.is_available() else "gloo"),
                               auto_mpi_discovery=False, verbose=False,
                               timeout=timedelta(minutes=timeout_minutes))
    # Ranks spread over hosts: the shm op was (correctly) not initialised, but would still be called.
    repair_cpu_allreduce(env, tp_group_is_world=True)


def repair_cpu_allreduce(env: DistEnv, tp_group_is_world: bool) -> None:
    """Send DeepSpeed's ``inference_all_reduce`` to ``torch.distributed.all_reduce`` where its shm op is wrong.

    The shm op (deepspeed 0.19.8 ``comm/torch.py``) is used whenever
    ``cdb.shm_vector_kernel_level >= 1`` (fp32) or ``>= 2`` (bf16/fp16). It sums over *every* rank
    of the host whatever group it is given, and segfaults when it was never initialised (ranks on
    several hosts). Level 0 makes DeepSpeed fall back to the process-group all-reduce. Call after
    :func:`init_distributed`, on every rank, with whether the TP group is the whole world.
    """
    if env.world_size == 1:
        return
    from deepspeed.comm import comm as ds_comm

    cdb = ds_comm.cdb
    if cdb is None or getattr(cdb, "shm_comm_op", None) is None:
        return  # not the CPU accelerator: no shm op in play
    if not tp_group_is_world or env.local_size != env.world_size:
        cdb.shm_vector_kernel_level = 0


@contextmanager
def distributed_session(env: DistEnv, *, backend: str | None, timeout_minutes: int) -> Iterator[DistEnv]:
    """``init_distributed``; on every exit a bounded barrier, ``destroy_process_group`` and shm cleanup.

    After an error a peer may be dead, so the barrier waits at most ``ERROR_BARRIER_SECONDS`` (gloo's
    ``monitored_barrier``) or is skipped (other backends); ``destroy_process_group`` always runs
    because gloo processes that exit without it abort at random (DESIGN §6).
    """
    init_distributed(env, backend=backend, timeout_minutes=timeout_minutes)
    failed = True
    try:
        yield env
        failed = False
    finally:
        if env.world_size > 1:
            all_passed = _teardown(failed, timeout_minutes)
            remove_shm_buffers(env.master_addr, env.master_port,
                               ranks=None if all_passed and env.local_rank == 0 else [env.rank])


def _teardown(failed: bool, timeout_minutes: int) -> bool:
    """Barrier then destroy; True when the barrier proved every rank reached teardown."""
    import torch.distributed as torch_dist

    if not torch_dist.is_initialized():
        return False
    passed = False
    try:
        if torch_dist.get_backend() == "gloo":
            seconds = ERROR_BARRIER_SECONDS if failed else 60 * timeout_minutes
            torch_dist.monitored_barrier(timeout=timedelta(seconds=seconds), wait_all_ranks=True)
            passed = True
        elif not failed:
            torch_dist.barrier()
            passed = True
    except Exception as error:  # a dead or stuck peer: report, still destroy
        logger.warning("teardown barrier failed (%s); destroying the process group anyway", error)
    torch_dist.destroy_process_group()
    return passed


def shm_buffer_glob(master_addr: str, master_port: int, uid: int | None = None) -> str:
    """Glob of the shm all-reduce buffers of one job (one file per rank)."""
    uid = os.getuid() if uid is None else uid
    return os.path.join(SHM_DIR, f"{SHM_BUFFER_PREFIX}_{uid}_{master_addr}_{master_port}_*")


def remove_shm_buffers(master_addr: str, master_port: int, ranks: list[int] | None = None) -> list[str]:
    """Delete this job's ``/dev/shm`` all-reduce buffers (all ranks', or only ``ranks``); returns the paths.

    Unlinking while a peer still has the buffer mapped is safe (POSIX keeps the mapping); only a
    peer that has not yet *opened* it would wait forever, which is why an errored rank removes only
    its own file.
    """
    paths = glob.glob(shm_buffer_glob(master_addr, master_port))
    if ranks is not None:
        paths = [p for p in paths if int(p.rsplit("_", 1)[1]) in ranks]
    for path in paths:
        try:
            os.remove(path)
        except FileNotFoundError:
            pass  # a peer on this host removed it first
    return paths


# --------------------------------------------------------------------------- lockstep collectives


class AgreedError(CaptureError):
    """A failure every rank raised together (``agree_on_error``); ``rank`` is the rank that failed first.

    The CLI prints it once (on rank 0), not once per rank."""

    def __init__(self, message: str, *, rank: int) -> None:
        super().__init__(message)
        self.rank = rank


def agree_on_error(local_error: BaseException | None) -> None:
    """Make one rank's failure every rank's failure, at once and with the same message.

    Collective: every rank of the default group must call this at the same point (an all-gather of
    a small status object), whether or not it failed. Raises ``CaptureError`` carrying the message
    of the lowest failing rank on every rank (unchanged for a ``CaptureError``, prefixed with the rank
    and exception type otherwise); returns when no rank failed. Without a process group
    it re-raises ``local_error`` as is.
    """
    import torch.distributed as torch_dist

    if not (torch_dist.is_available() and torch_dist.is_initialized()):
        if local_error is not None:
            raise local_error
        return
    rank = torch_dist.get_rank()
    status = None
    if local_error is not None:
        message = str(local_error)
        if not isinstance(local_error, CaptureError):
            message = f"rank {rank} failed with {type(local_error).__name__}: {message}"
        status = (rank, message)
    statuses: list = [None] * torch_dist.get_world_size()
    torch_dist.all_gather_object(statuses, status)
    failures = [s for s in statuses if s is not None]
    if not failures:
        return
    # The lowest failing rank's message, identical on every rank (rank 0's refusal wins when present).
    raise AgreedError(failures[0][1], rank=failures[0][0]) from local_error


def all_reduce_max_int(value: int) -> int:
    """The maximum of ``value`` over all ranks (collective: every rank must call it); identity alone."""
    import torch.distributed as torch_dist

    tensor = _group_int(value)
    if tensor is None:
        return value
    torch_dist.all_reduce(tensor, op=torch_dist.ReduceOp.MAX)
    return int(tensor.item())


def all_gather_int(value: int) -> list[int]:
    """Every rank's ``value``, by rank (collective: every rank must call it); ``[value]`` alone."""
    import torch
    import torch.distributed as torch_dist

    tensor = _group_int(value)
    if tensor is None:
        return [value]
    gathered = [torch.empty_like(tensor) for _ in range(torch_dist.get_world_size())]
    torch_dist.all_gather(gathered, tensor)
    return [int(item.item()) for item in gathered]


def _group_int(value: int):
    """``value`` as a one-element int64 tensor where the default group's collectives take it (nccl: this rank's
    GPU); None without a process group."""
    import torch
    import torch.distributed as torch_dist

    if not (torch_dist.is_available() and torch_dist.is_initialized()):
        return None
    device = torch.device("cuda", torch.cuda.current_device()) if torch_dist.get_backend() == "nccl" else "cpu"
    return torch.tensor([value], dtype=torch.int64, device=device)
