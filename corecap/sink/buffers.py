"""The sink's host buffers for reassembled samples, reused across samples (corecap/sink/collect.py)."""

from __future__ import annotations

import threading

import numpy as np
import torch


class BufferPool:
    """Host buffers for reassembled samples, reused once their sample is committed.

    A fresh buffer per sample is, above glibc's mmap threshold (32 MiB at most), a fresh mapping:
    every page faults and is zeroed on first touch, so reassembling a step into fresh buffers
    was several times slower than into reused ones on a 2-core machine. On the H200 host, with
    torch's default threads in the sink, the pool gained little: there something else dominated
    (measured: docs/benchmarks.md, "H200: the step loop at vLLM's own pace (calls 8-11)" and
    'Figures that docstrings used to quote').
    Sizes are rounded up to classes at most 25% apart; at most `max_free_bytes` are kept free.
    `take` runs on the collector thread, `give` on the writer's commit thread."""

    def __init__(self, max_free_bytes: int):
        self.max_free_bytes = max_free_bytes
        self.free: dict[int, list[torch.Tensor]] = {}
        self.lent: dict[int, torch.Tensor] = {}  # data_ptr -> buffer, for those taken
        self.free_bytes = 0
        self.lock = threading.Lock()

    @staticmethod
    def size_class(nbytes: int) -> int:
        unit = max(4096, 1 << max(0, (nbytes - 1).bit_length() - 3))
        return -(-nbytes // unit) * unit

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        nbytes = int(np.prod(shape)) * dtype.itemsize
        size = self.size_class(nbytes)
        with self.lock:
            stack = self.free.get(size)
            buffer = stack.pop() if stack else None
            if buffer is not None:
                self.free_bytes -= size
        if buffer is None:
            buffer = torch.empty(size, dtype=torch.uint8)
        with self.lock:
            self.lent[buffer.data_ptr()] = buffer
        return buffer[:nbytes].view(dtype).view(shape)

    def give(self, states: torch.Tensor) -> None:
        """Return `states` (from `take`) once nothing reads it any more."""
        with self.lock:
            buffer = self.lent.pop(states.data_ptr(), None)
            if buffer is None:
                raise ValueError("not a buffer lent by this pool")
            size = buffer.numel()
            if self.free_bytes + size <= self.max_free_bytes:
                self.free.setdefault(size, []).append(buffer)
                self.free_bytes += size
