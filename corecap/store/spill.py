"""A sample's states on disk while its chunks arrive: the spill file of a sample too long to hold.

A 128k-token sample of five 7,168-wide layers is ~9 GB of bf16 states, more than the sink's memory
bound (--buffer-gb). Such a sample is reassembled in a file instead of a buffer: `spill-*.bin` in
the store's directory, made at the payload's final size (sparse), each chunk's rows written at
their place in the stored layout `[L, T, H]` as they arrive, whatever their order. Once every
position is there the writer reads it back a piece at a time (checksum, NaN/Inf), fdatasyncs it,
and at the sample's commit renames it into the next state file (`SegmentWriter.append`), so its
bytes are written once and never held whole.

Crash safety is the state files' own: a spill file is no state file, so no reader looks at it; one
renamed into a state file but not committed lies past the committed end, which the next writer
cuts off; the next writer also removes every spill file when it takes the store's writer lock
(`remove_stale`): only the lock's holder makes them.
"""

from __future__ import annotations

import itertools
import os
import re
from dataclasses import dataclass

import numpy as np

from corecap.errors import CorecapError

_NAME = re.compile(r"spill-\d+-\d+\.bin")
_MAX_IO = 1 << 30  # pwrite/preadv return short above ~2 GiB on Linux
_numbers = itertools.count()


@dataclass(frozen=True)
class Spilled:
    """A payload already on disk, whole and synced: the spill file that becomes its state file."""

    path: str
    nbytes: int


class SpillFile:
    """One sample's payload, written in place from any thread (pwrite at distinct offsets). Made
    only by the holder of the store's writer lock (the sink takes it at its start): the lock's
    next holder removes every spill file it finds."""

    def __init__(self, directory: str, nbytes: int):
        self.nbytes = nbytes
        self.path = os.path.join(directory, f"spill-{os.getpid()}-{next(_numbers)}.bin")
        try:  # O_EXCL, O_NOFOLLOW: never a file that is not this sample's own
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise CorecapError(f"{self.path}: cannot make a spill file for a long sample ({e.strerror})") from None
        os.ftruncate(self.fd, nbytes)

    def write(self, offset: int, data) -> None:
        view = memoryview(np.ascontiguousarray(data)).cast("B")
        if offset + view.nbytes > self.nbytes:
            raise CorecapError(f"{self.path}: bytes {offset}..{offset + view.nbytes} past its {self.nbytes}")
        done = 0
        while done < view.nbytes:
            done += os.pwrite(self.fd, view[done : done + _MAX_IO], offset + done)

    def pieces(self, piece_bytes: int, boundary: int, first: int = 0):
        """The file from byte `first` to its end in order, as (offset from `first`, bytes) views of
        one reused buffer of at most `piece_bytes` (each valid until the next is yielded), none
        across a multiple of `boundary` from `first` (a layer's bytes: a piece is then one layer's)."""
        buffer = np.empty(max(1, min(piece_bytes, self.nbytes - first)), np.uint8)
        start = first
        while start < self.nbytes:
            n = min(len(buffer), self.nbytes - start, boundary - (start - first) % boundary)
            view = memoryview(buffer)[:n]
            got = 0
            while got < n:
                read = os.preadv(self.fd, [view[got:]], start + got)
                if read == 0:
                    raise CorecapError(f"{self.path}: ends at byte {start + got}, expected {self.nbytes}")
                got += read
            yield start - first, buffer[:n]
            start += n

    def sync(self) -> Spilled:
        """Durable, and handed on: the writer renames it into a state file at the commit."""
        os.fdatasync(self.fd)
        os.close(self.fd)
        self.fd = -1
        return Spilled(self.path, self.nbytes)

    def discard(self) -> None:
        """An incomplete or refused sample's: gone, as if it never arrived."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def remove_stale(directory: str) -> int:
    """Remove the spill files an interrupted writer left (call holding the writer lock)."""
    names = [name for name in os.listdir(directory) if _NAME.fullmatch(name)]
    for name in names:
        os.unlink(os.path.join(directory, name))
    return len(names)
