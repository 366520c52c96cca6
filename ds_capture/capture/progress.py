"""Progress and metrics: a rank-0 progress bar over GLOBAL samples, and a metrics JSONL per run.

In: per forward step, the job's newly captured samples and tokens, summed over the writer ranks (so
tensor-parallel replicas are not double-counted) by the step's own collective (``session.Lockstep``: the
ballots carry them). Out: a tqdm bar on rank 0 (global samples done, tokens/s, ETA) and
``<cache>/.ds_capture/metrics.jsonl`` (one JSON object per interval: tokens/s, write MB/s, writer queue depth,
peak memory). The metrics file is bookkeeping, not part of the cache contract. No collective of its own.
"""

from __future__ import annotations

import json
import resource
import time
from pathlib import Path

import torch
from tqdm import tqdm


def collective_device() -> torch.device:
    """Where a tensor must live for the default group's collectives (nccl: this rank's GPU)."""
    if torch.distributed.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def peak_rss_bytes() -> int:
    """Peak resident set size of this process (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class Progress:
    def __init__(self, *, total_samples: int, already_done: int, is_rank0: bool, show: bool,
                 metrics_path: Path | None, interval: int) -> None:
        self.is_rank0 = is_rank0
        self.interval = interval
        self.metrics_path = metrics_path if is_rank0 else None
        self.pending = [0, 0]  # samples, tokens of the steps since the last update
        self.global_samples = 0
        self.global_tokens = 0
        self.started = time.perf_counter()
        self._last_time = self.started
        self._last_tokens = 0
        self._last_bytes = 0
        self.bar = tqdm(total=total_samples, initial=already_done, unit="sample", dynamic_ncols=True,
                        desc="capture", disable=not (show and is_rank0))
        if self.metrics_path is not None:
            self.metrics_path.parent.mkdir(parents=True, exist_ok=True)

    def step(self, step: int, samples: int, tokens: int, *, writer=None, final: bool = False) -> None:
        """The job's ``samples`` and ``tokens`` of ``step`` (every rank's, summed); an update every ``interval``."""
        self.pending = [self.pending[0] + samples, self.pending[1] + tokens]
        if not final and (step + 1) % self.interval:
            return
        (samples, tokens), self.pending = self.pending, [0, 0]
        self.global_samples += samples
        self.global_tokens += tokens
        now = time.perf_counter()
        self.bar.update(samples)
        tokens_per_s = (self.global_tokens - self._last_tokens) / max(now - self._last_time, 1e-9)
        self.bar.set_postfix(tok_s=f"{tokens_per_s:,.0f}", refresh=False)
        if self.metrics_path is not None:
            bytes_written = writer.bytes_written if writer is not None else 0
            record = {
                "time_s": round(now - self.started, 3),
                "step": step + 1,
                "samples_done": self.global_samples,
                "tokens_done": self.global_tokens,
                "tokens_per_s": round(tokens_per_s, 1),
                "write_mb_per_s": round((bytes_written - self._last_bytes) / 2**20 / max(now - self._last_time, 1e-9), 2),
                "writer_queue_depth": writer.queue_depth if writer is not None else 0,
                "peak_rss_mb": round(peak_rss_bytes() / 2**20, 1),
                "peak_cuda_mb": round(torch.cuda.max_memory_allocated() / 2**20, 1) if torch.cuda.is_available() else None,
            }
            with open(self.metrics_path, "a") as handle:
                handle.write(json.dumps(record) + "\n")
            self._last_bytes = bytes_written
        self._last_time, self._last_tokens = now, self.global_tokens

    def close(self) -> None:
        self.bar.close()
