"""What every trainer's layout shares: a sample file written under a temporary name, fsync'd and
renamed (a file that exists is complete), its directory synced, and the reused buffers the
layers are gathered into. Every file is unshifted (row t holds token t's states): both trainers
shift themselves.
"""

from __future__ import annotations

import math
import os
import threading

import torch

TMP_SUFFIX = ".corecap-tmp"  # a file being written; renamed when complete, so existence = complete


def commit_file(tmp: str, path: str) -> int:
    """fsync the finished temporary file and rename it to `path`: a file that exists is complete
    and durable. Returns its size. (Apart from the writing so that a worker thread goes on
    decoding while another waits for the disk.)"""
    fd = os.open(tmp, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
        size = os.fstat(fd).st_size
    finally:
        os.close(fd)
    os.rename(tmp, path)
    return size


_scratch = threading.local()


def scratch_tensor(shape: tuple[int, ...], dtype: torch.dtype, slot: int) -> torch.Tensor:
    """A tensor of exactly `shape` over this thread's reused buffer number `slot`. A fresh 64 MiB
    tensor costs more in page faults than copying a sample into it (measured: docs/benchmarks.md,
    "Export"), and glibc maps every allocation that large anew.
    The tensor's storage is exactly its
    own bytes, so torch.save writes no more than them; it is valid until the slot is reused."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    buffers = _scratch.__dict__.setdefault("buffers", {})
    buffer = buffers.get(slot)
    if buffer is None or len(buffer) < nbytes:
        buffer = buffers[slot] = bytearray(nbytes + nbytes // 4)  # room for somewhat longer samples
    return torch.frombuffer(memoryview(buffer)[:nbytes], dtype=dtype).view(shape)


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
