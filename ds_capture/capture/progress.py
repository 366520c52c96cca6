"""Progress and metrics: a rank-0 progress bar over GLOBAL samples, and a metrics JSONL per run.

In: per forward step, this rank's newly captured samples and tokens (only writer ranks count, so
tensor-parallel replicas are not double-counted). Out: a tqdm bar on rank 0 (global samples done,
tokens/s, ETA) and ``<cache>/.ds_capture/metrics.jsonl`` (one JSON object per interval: tokens/s,
write MB/s, writer queue depth, peak memory). The metrics file is bookkeeping, not part of the
cache contract.

Collective: every ``interval`` steps all ranks all-reduce two integers, so ``step`` must be called
by every rank at every step (padding steps included).
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
    def __init__(self, *, total_samples: int, already_done: int, is_rank0: bool, count_local: bool, show: bool,
                 metrics_path: Path | None, interval: int) -> None:
        self.is_rank0 = is_rank0
        self.count_local = count_local
        self.interval = interval
        self.metrics_path = metrics_path if is_rank0 else None
        self.local = torch.zeros(2, dtype=torch.int64)  # samples, tokens not yet reduced
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
        if self.count_local:
            self.local += torch.tensor([samples, tokens])
        if not final and (step + 1) % self.interval:
            return
        reduced = self.local.clone()
        if torch.distributed.is_initialized():
            reduced = reduced.to(collective_device())
            torch.distributed.all_reduce(reduced)  # collective: every rank, same steps
            reduced = reduced.cpu()
        self.local.zero_()
        self.global_samples += int(reduced[0])
        self.global_tokens += int(reduced[1])
        now = time.perf_counter()
        self.bar.update(int(reduced[0]))
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
