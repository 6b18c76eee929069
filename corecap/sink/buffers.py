"""The sink's host buffers for reassembled samples, reused across samples (corecap/sink/collect.py)."""

from __future__ import annotations

import threading

import numpy as np
import torch


def size_class(nbytes: int) -> int:
    """The bytes of the buffer that holds `nbytes`: rounded up to classes at most 25% apart."""
    unit = max(4096, 1 << max(0, (nbytes - 1).bit_length() - 3))
    return -(-nbytes // unit) * unit


class BufferPool:
    """Host buffers for reassembled samples, reused once their sample is committed.

    A fresh buffer per sample is, above glibc's mmap threshold (32 MiB at most), a fresh mapping:
    every page faults and is zeroed on first touch, so reassembling a step into fresh buffers
    was several times slower than into reused ones on 2 cores. With torch's default threads
    in the sink, the pool gained little on a 16-core GPU host: there something else dominated
    (measured: docs/benchmarks.md, "Capture" and "Figures the code cites").

    The sink's memory for states is one count here against one bound, `limit_bytes` (--buffer-gb):
    the buffers taken, the free ones kept for reuse, and the encoded copies that the writer holds
    until their commit in place of a buffer it gave back (`hold`/`drop`; corecap/sink/writer.py), and
    while serving the prefix cache's copies of blocks (corecap/sink/prefix_cache.py `BlockCopies`). A
    free buffer is kept only while the whole fits in the bound, and free ones are let go to make
    room for a fresh buffer or an encoded copy. The driver admits a sample only while the buffers of
    those held fit (corecap/sink/budget.py), so what is taken or held stays within the bound and the
    whole does too; `peak_bytes` is its high-water mark, which the run reports.
    `take` runs on the collector thread, `give` on the writer's commit thread."""

    def __init__(self, limit_bytes: int):
        self.limit_bytes = limit_bytes
        self.free: dict[int, list[torch.Tensor]] = {}
        self.lent: dict[int, torch.Tensor] = {}  # data_ptr -> buffer, for those taken
        self.free_bytes = 0
        self.lent_bytes = 0
        self.held_bytes = 0  # encoded copies awaiting their commit (`hold`)
        self.peak_bytes = 0  # of taken + free + held, the most at any time
        self.lock = threading.Lock()

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        nbytes = int(np.prod(shape)) * dtype.itemsize
        size = size_class(nbytes)
        with self.lock:
            stack = self.free.get(size)
            buffer = stack.pop() if stack else None
            if buffer is not None:
                self.free_bytes -= size
                if not stack:
                    del self.free[size]  # `_let_go` takes from the largest class there is
            else:
                self._let_go(size)
            self.lent_bytes += size  # counted before it exists: the peak is never under what is resident
            self._peak()
        if buffer is None:
            buffer = torch.empty(size, dtype=torch.uint8)
        with self.lock:
            self.lent[buffer.data_ptr()] = buffer
        return buffer[:nbytes].view(dtype).view(shape)

    @property
    def total_bytes(self) -> int:
        return self.lent_bytes + self.free_bytes + self.held_bytes

    def _peak(self) -> None:
        self.peak_bytes = max(self.peak_bytes, self.total_bytes)

    def hold(self, nbytes: int) -> None:
        """Count `nbytes` of states held outside the pool's buffers (an encoded copy), making room."""
        with self.lock:
            self._let_go(nbytes)
            self.held_bytes += nbytes
            self._peak()

    def drop(self, nbytes: int) -> None:
        with self.lock:
            self.held_bytes -= nbytes

    def _let_go(self, size: int) -> None:
        """Free buffers go, the largest first, until `size` more bytes fit the bound."""
        while self.free_bytes and self.total_bytes + size > self.limit_bytes:
            largest = max(self.free)
            self.free[largest].pop()
            if not self.free[largest]:
                del self.free[largest]
            self.free_bytes -= largest

    def give(self, states: torch.Tensor) -> None:
        """Return `states` (from `take`) once nothing reads it any more."""
        with self.lock:
            buffer = self.lent.pop(states.data_ptr(), None)
            if buffer is None:
                raise ValueError("not a buffer lent by this pool")
            size = buffer.numel()
            self.lent_bytes -= size
            if self.total_bytes + size <= self.limit_bytes:
                self.free.setdefault(size, []).append(buffer)
                self.free_bytes += size
