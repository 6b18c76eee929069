"""Shared memory that DataLoader workers decode states into, reused once nothing uses it.

Every tensor a DataLoader worker returns goes through torch's pickler, which copies it into new
shared memory (`UntypedStorage._share_fd_cpu_`) unless it is there already. For an EAGLE-3-sized
sample (67 MB) that copy cost about what decoding it did (one thread; measured: docs/benchmarks.md,
"Export"), most
of it the first touch of the new pages (shared memory gets no huge pages by default: 4 KiB a
fault). So `StoreDataset`, in a worker, decodes into a slot of this pool instead: a memfd the
worker keeps mapped, its pages already in place after the first item, which the pickler sends to
the main process as a file descriptor (as torch sends its own shared memory), without a copy.

A slot is reused for a later item only when nothing refers to the earlier one, in either process:
- in the worker, the storage of the tensor handed out has died (torch's StorageWeakRef): the item
  was pickled, or dropped (a collate function that stacks items copies them);
- in the main process, the tensor rebuilt from the descriptor views a memoryview of its own
  mapping, whose finalizer runs when the last tensor or storage using it dies and writes FREE into
  the slot's last page. The pickler wrote SENT there before sending, and sends a slot only while
  it reads FREE: a tensor pickled again before then is copied the torch way (one _Lease a slot).
That tensor's storage is not torch's shared memory, so torch copies it if the trainer passes it on
to another process: `share_memory_()` (which a torch.multiprocessing queue calls) moves it to new
memory in place, as it does any tensor not in shared memory, and numpy arrays taken from it before
then must not be used after. Before the main process forks, every slot it still holds is pinned:
PINNED is written and never FREE, as a forked child may use the tensors it inherits; the worker
then drops the slot from its pool (its memory lives on in the processes that map it). When the
pool is full (MAX_SLOTS) and no slot is free, an item is decoded into new memory and torch's copy
applies, as without the pool. Linux only (memfd); elsewhere every item takes that path.
"""

from __future__ import annotations

import math
import mmap
import os
import threading
import weakref
from multiprocessing.reduction import DupFd, ForkingPickler

import torch
from torch.multiprocessing.reductions import StorageWeakRef, reduce_tensor

# Slots a worker keeps at most. A DataLoader has prefetch_factor (default 2) items of each worker
# in flight and the trainer holds one or two more, so 4 to 5 slots a worker are in use at a time.
MAX_SLOTS = 8
_FREE, _SENT, _PINNED = 0, 1, 2
_PAGE = mmap.ALLOCATIONGRANULARITY


class SharedStates(torch.Tensor):
    """A worker's states in a pool slot, pickled as the slot's descriptor; anything computed from
    it is a plain tensor."""

    __torch_function__ = torch._C._disabled_torch_function_impl


def capacity(nbytes: int) -> int:
    """A slot's size for `nbytes`: rounded up to an eighth to a sixteenth of it (whole pages), so
    samples of similar lengths share slots."""
    step = max(_PAGE, 1 << max(0, nbytes.bit_length() - 4))
    return -(-nbytes // step) * step


class _Slot:
    def __init__(self, size: int):
        self.capacity = size
        self.fd = os.memfd_create("corecap-states", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, size + _PAGE)  # then the flag's page
            self.map = mmap.mmap(self.fd, size + _PAGE)
        except OSError:
            os.close(self.fd)
            raise
        self.handed: StorageWeakRef | None = None  # the storage of the tensor last handed out

    def idle(self) -> bool:
        """No tensor handed out from this slot lives on in the worker."""
        return self.handed is None or self.handed.expired()

    def free(self) -> bool:
        # The weak reference first: a pickled tensor's storage dies only after SENT was written.
        return self.idle() and self.map[self.capacity] == _FREE

    def hand_out(self, shape: tuple[int, ...], dtype: torch.dtype, nbytes: int) -> SharedStates:
        t = (torch.frombuffer(self.map, dtype=torch.uint8, count=nbytes).view(dtype).view(shape)
             .as_subclass(SharedStates))
        t._corecap_slot = (self, t.untyped_storage().data_ptr(), nbytes)
        self.handed = StorageWeakRef(t.untyped_storage())
        return t

    def close(self) -> None:
        self.map.close()
        os.close(self.fd)


class Pool:
    """One process's slots (`tensor`)."""

    def __init__(self):
        self.pid = os.getpid()
        self.slots: list[_Slot] = []
        self.created = 0  # slots made so far (tests and tools read it)
        self.usable = hasattr(os, "memfd_create")
        self.lock = threading.Lock()  # a dataset may read items from several threads

    def tensor(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A contiguous tensor to decode states of `shape` and `dtype` into: in a free slot that
        fits (the smallest), else a new slot, else new memory."""
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes == 0 or not self.usable:
            return torch.empty(shape, dtype=dtype)
        with self.lock:
            return self._take(shape, dtype, nbytes)

    def _take(self, shape: tuple[int, ...], dtype: torch.dtype, nbytes: int) -> torch.Tensor:
        for slot in [s for s in self.slots if s.map[s.capacity] == _PINNED and s.idle()]:
            slot.close()  # the main process keeps it for good: no longer ours to reuse
            self.slots.remove(slot)
        free = [s for s in self.slots if s.free()]
        fits = [s for s in free if s.capacity >= nbytes]
        if fits:
            return min(fits, key=lambda s: s.capacity).hand_out(shape, dtype, nbytes)
        if len(self.slots) >= MAX_SLOTS:
            if not free:
                return torch.empty(shape, dtype=dtype)
            smallest = min(free, key=lambda s: s.capacity)  # too small for this item: make room
            smallest.close()
            self.slots.remove(smallest)
        try:
            slot = _Slot(capacity(nbytes))
        except OSError:  # out of descriptors or memory: this item the way it would go without us
            return torch.empty(shape, dtype=dtype)
        self.slots.append(slot)
        self.created += 1
        return slot.hand_out(shape, dtype, nbytes)


_pool: Pool | None = None


def pool() -> Pool:
    """This process's pool, made on first use (a forked child makes its own)."""
    global _pool
    if _pool is None or _pool.pid != os.getpid():
        _pool = Pool()
    return _pool


def _reduce(t: SharedStates):
    """Pickling (ForkingPickler, in the worker): the slot's descriptor, unless the tensor was
    changed since it was handed out (resized, set to other memory) or the main process still holds
    it (sent before): then torch's own copy."""
    slot, address, nbytes = getattr(t, "_corecap_slot", (None, 0, 0))
    plain = t.as_subclass(torch.Tensor)
    if (slot is None or slot.map.closed or slot.map[slot.capacity] != _FREE
            or plain.untyped_storage().data_ptr() != address
            or plain.storage_offset() or plain.nbytes != nbytes or not plain.is_contiguous() or plain.requires_grad):
        return reduce_tensor(plain)
    slot.map[slot.capacity] = _SENT
    return _rebuild, (DupFd(slot.fd), slot.capacity, nbytes, tuple(plain.shape), plain.dtype)


class _Lease:
    """The main process's hold on one slot: FREE is written when its tensors are all gone."""

    def __init__(self, whole: mmap.mmap, size: int):
        self.map, self.capacity = whole, size
        _leases.add(self)

    def release(self) -> None:
        _leases.discard(self)
        if self.map is not None:  # None: pinned before a fork
            self.map[self.capacity] = _FREE
            self.map = None

    def pin(self) -> None:
        whole, self.map = self.map, None
        if whole is not None:  # else released meanwhile
            whole[self.capacity] = _PINNED


_leases: set[_Lease] = set()


def _rebuild(fd: DupFd, size: int, nbytes: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Unpickling (in the main process): a plain tensor viewing the slot."""
    fd = fd.detach()
    try:
        whole = mmap.mmap(fd, size + _PAGE)
    finally:
        os.close(fd)
    view = memoryview(whole)[:nbytes]  # lives exactly as long as the storage made from it
    weakref.finalize(view, _Lease(whole, size).release)
    return torch.frombuffer(view, dtype=torch.uint8).view(dtype).view(shape)


def _pin_leases() -> None:
    """Before a fork: the slots held now stay held for good (a child may use what it inherits)."""
    for lease in list(_leases):
        lease.pin()
    _leases.clear()


ForkingPickler.register(SharedStates, _reduce)
os.register_at_fork(before=_pin_leases)
