"""Shared-memory slots that carry each engine step's states from the worker to the sink.

Through a socket, a step's states (537 MB for 16,384 tokens x 4 layers x 4,096 x bf16) are
copied into the kernel and out again: one ZeroMQ stream moved steps more slowly than the H200's
GPU made them (measured: docs/benchmarks.md, "Capture"). Instead, tensor-parallel rank 0 copies a
step's states from the device straight into a slot of a shared file in /dev/shm (registered
with CUDA, so the copy is asynchronous), ZeroMQ carries only the header with the slot number,
the sink reads the slot in place while reassembling, then hands the slot back over a socket
(a syscall on both sides: the slot is reused only after the sink's reads are done).

The worker creates the file (owner-only, its blocks reserved with posix_fallocate so that a full
/dev/shm is an error now, not a SIGBUS later) and unlinks it when it stops; the sink unlinks it
as soon as it has mapped it. A run killed between the two leaves it behind: the next ring
removes rings whose creator (the pid in the name) is gone. Where no slot can be had (no
/dev/shm, too small, a step larger than a slot), states travel in the message itself, as before.
"""

from __future__ import annotations

import mmap
import os
import queue
import secrets

import torch

DIRECTORY = "/dev/shm"
PREFIX = "corecap-ring-"


def free_socket(ring_path: str) -> str:
    """The name of the socket over which the sink hands a ring's slots back, in the capture
    socket's directory; the ring's worker binds it. One per ring: several engine replicas (or
    pipeline stages) push to one sink, each from a ring of its own."""
    return f"free-{os.path.basename(ring_path).removeprefix(PREFIX)}.sock"


class RingUnavailable(OSError):
    pass


class RingWriter:
    """The worker's side: `acquire` a free slot, fill `slot(i)`, send; the sink `release`s it."""

    def __init__(self, slot_bytes: int, num_slots: int, directory: str = DIRECTORY, cuda: bool = False):
        self.slot_bytes = slot_bytes
        self.num_slots = num_slots
        _remove_stale(directory)
        self.path = os.path.join(directory, f"{PREFIX}{os.getpid()}-{secrets.token_hex(4)}")
        size = slot_bytes * num_slots
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except OSError as e:
            raise RingUnavailable(f"{self.path}: {e}") from None
        try:
            os.posix_fallocate(fd, 0, size)
            self.map = mmap.mmap(fd, size)
        except OSError as e:
            self.unlink()
            raise RingUnavailable(f"{self.path}: cannot reserve {size / 2**30:.1f} GiB ({e})") from None
        finally:
            os.close(fd)
        self.buffer = torch.frombuffer(self.map, dtype=torch.uint8)
        self.registered = False
        if cuda:  # page-locked, so that device-to-host copies into it are asynchronous
            if int(torch.cuda.cudart().cudaHostRegister(self.buffer.data_ptr(), size, 1)) != 0:  # 1: portable
                self.close()
                raise RingUnavailable(f"{self.path}: cudaHostRegister failed")
            self.registered = True
        self.free: queue.Queue = queue.Queue()
        for i in range(num_slots):
            self.free.put(i)

    def acquire(self) -> int:
        """A free slot; blocks while the sink holds all of them (backpressure)."""
        return self.free.get()

    def release(self, slot: int) -> None:
        self.free.put(slot)

    def slot(self, i: int, nbytes: int) -> torch.Tensor:
        return self.buffer[i * self.slot_bytes : i * self.slot_bytes + nbytes]

    def unlink(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        self.unlink()
        if self.registered:
            torch.cuda.cudart().cudaHostUnregister(self.buffer.data_ptr())
            self.registered = False
        del self.buffer
        self.map.close()


def _remove_stale(directory: str) -> None:
    for name in os.listdir(directory):
        pid = name.removeprefix(PREFIX).split("-")[0]
        if name.startswith(PREFIX) and pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            try:
                os.unlink(os.path.join(directory, name))
            except OSError:  # another user's, or gone meanwhile
                pass


class RingReader:
    """The sink's side: maps a worker's ring on first sight and reads slots in place."""

    def __init__(self):
        self.maps: dict[str, mmap.mmap] = {}

    def view(self, path: str, slot: int, slot_bytes: int, nbytes: int) -> memoryview:
        """Raises ValueError for anything that is not a slot of a corecap ring."""
        if not os.path.basename(path).startswith(PREFIX):
            raise ValueError(f"ring {path!r} is not a corecap ring")
        m = self.maps.get(path)
        if m is None:
            if len(self.maps) >= 8:
                raise ValueError(f"ring {path!r}: too many rings")
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except OSError as e:
                raise ValueError(f"ring {path!r}: {e}") from None
            try:
                m = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
            finally:
                os.close(fd)
            try:
                os.unlink(path)  # mapped on both sides: the name is no longer needed
            except FileNotFoundError:
                pass
            self.maps[path] = m
        if slot < 0 or slot_bytes <= 0 or nbytes > slot_bytes or (slot + 1) * slot_bytes > len(m):
            raise ValueError(f"slot {slot} of {slot_bytes} bytes holding {nbytes} bytes does not fit ring {path!r} "
                             f"({len(m)} bytes)")
        return memoryview(m)[slot * slot_bytes : slot * slot_bytes + nbytes]

    def close(self) -> None:
        for m in self.maps.values():
            try:
                m.close()
            except BufferError:  # a view is still alive somewhere; the mapping goes with the process
                pass
        self.maps.clear()
