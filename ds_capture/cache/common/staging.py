"""Host staging: captured states leave the device right after their forward, into a bounded set of buffers.

In: per micro-batch, the captured tensors (on the compute device, right after the forward). Out: a
:class:`Staged` whose ``tensors`` are host tensors with the same shapes and dtypes, ``wait()`` (the copy
has landed) and ``release()`` (the writer is done with them).

At most ``max_in_flight`` micro-batches are staged at once: ``stage`` blocks while they are all held
(back-pressure on the forward loop), so the writer's host memory is bounded by that many micro-batches
whatever the shard size. On CUDA each slot is a pinned host buffer of ``buffer_bytes``; the copy runs on
a side stream that first waits for the forward, so it overlaps the next forward, and the device tensors
are handed to that stream (``record_stream``) so the allocator reuses their memory only once the copy is
done: nothing queued holds device memory. On CPU the captured tensors already are host tensors; the
slots only bound how many are held.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

_ALIGN = 64  # every tensor of a slot starts on a 64-byte boundary (any dtype's alignment)


@dataclass
class Staged:
    """One micro-batch's host tensors; call ``wait`` before reading them and ``release`` once written."""

    tensors: dict[str, torch.Tensor]
    wait: Callable[[], None]
    release: Callable[[], None]


class HostStaging:
    """A pool of ``max_in_flight`` slots; ``device`` is where the captured tensors come from."""

    def __init__(self, *, max_in_flight: int, buffer_bytes: int, device: torch.device) -> None:
        assert max_in_flight >= 1
        self.max_in_flight = max_in_flight
        self.buffer_bytes = buffer_bytes
        self.device = torch.device(device)
        self._slots = threading.BoundedSemaphore(max_in_flight)
        self._free: list[torch.Tensor] = []  # pinned buffers not in use (CUDA only), allocated on first need
        self._lock = threading.Lock()
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    def acquire(self, timeout: float) -> bool:
        """Take a slot (False after ``timeout`` seconds: the caller checks for a writer error and retries)."""
        return self._slots.acquire(timeout=timeout)

    def stage(self, tensors: Mapping[str, torch.Tensor]) -> Staged:
        """Copy ``tensors`` into the slot taken by ``acquire``; returns at once (the copy is asynchronous)."""
        if self._stream is None:
            host = {name: t if t.device.type == "cpu" else t.cpu() for name, t in tensors.items()}
            return Staged(tensors=host, wait=lambda: None, release=self._slots.release)
        buffer = self._take_buffer()
        host, offset = {}, 0
        compute = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(compute)  # the copy starts after the forward that produced the states
        with torch.cuda.stream(self._stream):
            for name, t in tensors.items():
                if t.device.type == "cpu":
                    host[name] = t  # already on the host (token ids, masks)
                    continue
                num_bytes = t.numel() * t.element_size()
                assert offset + num_bytes <= buffer.numel(), f"{name}: a staging slot of {buffer.numel()} bytes is too small"
                view = buffer[offset:offset + num_bytes].view(t.dtype).view(t.shape)
                view.copy_(t, non_blocking=True)
                t.record_stream(self._stream)  # its device memory is reused only after this copy
                host[name] = view
                offset += -(-num_bytes // _ALIGN) * _ALIGN
            done = torch.cuda.Event()
            done.record(self._stream)

        def release() -> None:
            with self._lock:
                self._free.append(buffer)
            self._slots.release()

        return Staged(tensors=host, wait=done.synchronize, release=release)

    def _take_buffer(self) -> torch.Tensor:
        with self._lock:
            if self._free:
                return self._free.pop()
        return torch.empty(self.buffer_bytes, dtype=torch.uint8, pin_memory=True)


def slot_bytes(shapes: Mapping[str, tuple[tuple[int, ...], torch.dtype]]) -> int:
    """Bytes one slot needs for device tensors of at most these shapes (each rounded up to the alignment)."""
    total = 0
    for shape, dtype in shapes.values():
        count = 1
        for size in shape:
            count *= size
        total += -(-count * dtype.itemsize // _ALIGN) * _ALIGN
    return total
