"""capture.cpu_threads: each rank's intra-op thread count on CPU, resolved over the host's cores and local ranks.

In: the setting (``auto`` or a count) and the launcher's :class:`~ds_capture.parallel.dist.DistEnv` (how many ranks
share this host). Out: the per-rank count and :func:`use_cpu_threads`, which applies it (``torch.set_num_threads``)
and puts the process's previous count back on exit.

Why it is part of a run's numerics: on CPU, a matmul whose reduction dimension is long is split over the threads,
and each thread's fp32 partial sum is added in another order for another count; the bits of the result change
(measured with MKL on 2 cores: ``[64, 4096] @ [4096, 64]``, 3,704 of 4,096 elements). ``auto`` ignores
``OMP_NUM_THREADS``, which torchrun sets to 1 for each of several ranks and other launchers leave unset.

    count = resolve_cpu_threads("auto", local_size=2)   # cores // 2 (at least 1)
    with use_cpu_threads(count):
        ...                                              # every forward of this run
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager


def host_cores() -> int:
    """The cores this process may run on (its CPU affinity: a Slurm or cgroup limit shows here), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # no affinity call on this platform
        return max(1, os.cpu_count() or 1)


def resolve_cpu_threads(setting: int | str, *, local_size: int, cores: int | None = None) -> int:
    """The per-rank count for ``setting``: an explicit count as given; ``auto`` = ``cores // local_size``, at
    least 1 (``cores``: :func:`host_cores` unless given)."""
    if setting != "auto":
        return int(setting)
    return max(1, (host_cores() if cores is None else cores) // max(1, local_size))


def compute_on_cpu() -> bool:
    """Whether the target's forward runs on the CPU here (no CUDA device): where the thread count matters."""
    import torch

    return not torch.cuda.is_available()


@contextmanager
def use_cpu_threads(count: int | None) -> Iterator[None]:
    """``torch.set_num_threads(count)`` for the block, the previous count restored after (None: left alone).

    The count is the calling thread's: the forwards run on the thread that enters the block."""
    import torch

    previous = torch.get_num_threads()
    if count is not None and count != previous:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        if torch.get_num_threads() != previous:
            torch.set_num_threads(previous)
