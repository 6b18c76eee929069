"""Append-only state files: where a store keeps its samples' hidden states.

LMDB copies a large value into private pages, writes them with write(2) and fsyncs data and meta
pages once per commit, during which the disk idles between commits: well below the disk's
`dd conv=fsync` rate (measured: docs/benchmarks.md, "Capture", the disk against LMDB).
States are large and written once, so
they go to plain files `states-000000.bin`, `states-000001.bin`, ... (a new one every
`SEGMENT_BYTES`), written sequentially; LMDB keeps the small part: headers, one `POINTER` per
sample and the committed end of the files (`END`).

Crash safety: a sample's pointer is committed (an fsync'd LMDB transaction) only after its bytes
are fdatasync'd. Bytes past the committed end belong to no sample; the next writer cuts them off
when it takes the store's writer lock. Writing (`append`) and syncing (`sync`) are separate calls
so that one thread can write the next batch into the page cache while another waits for the disk.
"""

from __future__ import annotations

import os
import re
import stat
import struct
import threading

import numpy as np

from corecap.errors import CorecapError
from corecap.writer_lock import LOCK_FILE, check_unlocked, take as _take_lock  # noqa: F401 (their old home)
from corecap.store.spill import Spilled, remove_stale

SEGMENT_BYTES = 4 << 30
POINTER = struct.Struct("<IQQ")  # segment number, offset, length: where one sample's states are
END = struct.Struct("<IQ")  # segment number, offset: the committed end of the state files
_NAME = re.compile(r"states-(\d{6})\.bin")
_MAX_WRITE = 1 << 30  # write(2) returns short above ~2 GiB on Linux; stay well below


def segment_path(directory: str, segment: int) -> str:
    return os.path.join(directory, f"states-{segment:06d}.bin")


def segment_numbers(directory: str) -> list[int]:
    return sorted(int(m.group(1)) for name in os.listdir(directory) if (m := _NAME.fullmatch(name)))


class SegmentWriter:
    """The one writer of a store's state files, holding its writer lock until `close`."""

    def __init__(self, directory: str, end: tuple[int, int]):
        self.directory = directory
        self.fd_lock = threading.Lock()  # `sync` may run on another thread than `append`
        self.lock_fd = _take_lock(directory)
        self.fd = -1
        try:
            remove_stale(directory)  # an interrupted writer's long samples, never committed
            self.cut(end)
        except BaseException:
            if self.fd >= 0:
                os.close(self.fd)
            os.close(self.lock_fd)
            raise

    def cut(self, end: tuple[int, int]) -> None:
        """Continue from `end`, the committed end: what lies past it (an interrupted run's tail,
        or a refused merge's) is cut off."""
        segment, offset = end
        for n in segment_numbers(self.directory):
            if n > segment:
                os.unlink(segment_path(self.directory, n))
        fd = self._open(segment)
        try:
            os.ftruncate(fd, offset)
        except OSError as e:
            os.close(fd)
            raise CorecapError(f"{segment_path(self.directory, segment)}: cannot cut it to byte {offset} "
                               f"({e.strerror})") from None
        with self.fd_lock:
            old, self.fd = self.fd, fd
            self.segment, self.offset = segment, offset
        if old >= 0:
            os.close(old)

    def _open(self, segment: int) -> int:
        path = segment_path(self.directory, segment)
        existed = os.path.exists(path)
        try:  # O_NOFOLLOW: a store that travelled may hold a link to a file that is not its own
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise CorecapError(f"{path}: cannot write this state file ({e.strerror})") from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise CorecapError(f"{path}: not a regular file, expected a state file")
        if not existed:  # the new file's directory entry must survive a crash too
            _sync_directory(self.directory)
        return fd

    @property
    def end(self) -> tuple[int, int]:
        return self.segment, self.offset

    def append(self, payloads) -> list[bytes]:
        """Write the payloads after the end, each given as a sequence of buffers that are its
        parts in order, or as a `Spilled` file (`_adopt`); return one `POINTER` each. The bytes
        reach the page cache, not yet the disk: `sync` before committing the pointers."""
        pointers = []
        for parts in payloads:
            if isinstance(parts, Spilled):
                pointers.append(self._adopt(parts))
                continue
            views = [memoryview(part).cast("B") for part in parts]
            nbytes = sum(v.nbytes for v in views)
            if self.offset and self.offset + nbytes > SEGMENT_BYTES:
                self._roll()
            offset = self.offset
            for view in views:
                done = 0
                while done < view.nbytes:
                    done += os.pwrite(self.fd, view[done : done + _MAX_WRITE], offset + done)
                offset += view.nbytes
            pointers.append(POINTER.pack(self.segment, self.offset, nbytes))
            self.offset = offset
        return pointers

    def _roll(self) -> None:
        """Start the next file; the full one is synced now, since `sync` only syncs the newest."""
        fd = self._open(self.segment + 1)
        os.fdatasync(self.fd)
        with self.fd_lock:
            old, self.fd = self.fd, fd
            self.segment, self.offset = self.segment + 1, 0
        os.close(old)

    def _adopt(self, spilled: Spilled) -> bytes:
        """A long sample's spill file (corecap/store/spill.py), synced, becomes the next state file,
        the payload at its start, and writing goes on after it: its bytes are never copied. Its
        name is synced too; until the commit it lies past the committed end, like any append."""
        segment = self.segment + 1
        os.fdatasync(self.fd)  # the file it leaves: `sync` only syncs the newest
        os.rename(spilled.path, segment_path(self.directory, segment))
        fd = self._open(segment)
        _sync_directory(self.directory)
        with self.fd_lock:
            old, self.fd = self.fd, fd
            self.segment, self.offset = segment, spilled.nbytes
        os.close(old)
        return POINTER.pack(segment, 0, spilled.nbytes)

    def sync(self) -> None:
        """Make everything appended so far durable (callable from another thread)."""
        with self.fd_lock:
            fd = os.dup(self.fd)  # `_roll` may close self.fd meanwhile; it syncs it first
        try:
            os.fdatasync(fd)
        finally:
            os.close(fd)

    def close(self) -> None:
        os.close(self.fd)
        os.close(self.lock_fd)


def _sync_directory(directory: str) -> None:
    dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


class SegmentReader:
    """Reads states by pointer, keeping a few files open (a walk reads one file after another)."""

    def __init__(self, directory: str, max_open: int = 4):
        self.directory = directory
        self.max_open = max_open
        self.fds: dict[int, int] = {}

    def read(self, pointer, most: int, end: tuple[int, int] | None = None) -> np.ndarray:
        """The bytes at `pointer`, which may claim at most `most` of them (the size its sample's
        header allows), must end by `end` (the committed end: bytes past it belong to no sample;
        None where it is unknown) and must lie inside its file: all checked before anything is
        allocated, so a damaged pointer is a CorecapError, never a huge allocation."""
        if len(pointer) != POINTER.size:
            raise CorecapError(f"pointer (samples database) is {len(pointer)} bytes, expected {POINTER.size}")
        segment, offset, length = POINTER.unpack(pointer)
        name = os.path.basename(segment_path(self.directory, segment))
        if length > most:
            raise CorecapError(f"pointer (samples database) claims {length} bytes, its header allows at most {most}")
        if end is not None and (segment, offset + length) > end:
            raise CorecapError(
                f"pointer (samples database) names bytes {offset}..{offset + length} of {name}, past the committed end "
                f"(byte {end[1]} of {os.path.basename(segment_path(self.directory, end[0]))}): no commit wrote them"
            )
        fd = self._fd(segment)
        size = os.fstat(fd).st_size
        if offset + length > size:
            raise CorecapError(f"pointer (samples database) names bytes {offset}..{offset + length} of {name}, "
                               f"which has {size} (the file was cut short)")
        try:
            out = np.empty(length, dtype=np.uint8)  # not zero-filled: preadv writes every byte (checked below)
        except MemoryError:
            raise CorecapError(f"its {length} bytes of states do not fit in memory") from None
        view = memoryview(out)
        done = 0
        while done < length:
            try:
                n = os.preadv(fd, [view[done : done + _MAX_WRITE]], offset + done)
            except OSError as e:
                raise CorecapError(f"cannot read {name} at byte {offset + done} ({e.strerror})") from None
            if n == 0:
                raise CorecapError(f"states end at byte {offset + done} of {name}, "
                                   f"expected {length} bytes from {offset} (the file was cut short)")
            done += n
        return out

    def _fd(self, segment: int) -> int:
        fd = self.fds.get(segment)
        if fd is None:
            name = os.path.basename(segment_path(self.directory, segment))
            try:  # O_NONBLOCK: a FIFO in a file's place must not block the reader
                fd = os.open(segment_path(self.directory, segment), os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            except FileNotFoundError:
                raise CorecapError(f"states file {name} is missing") from None
            except OSError as e:
                raise CorecapError(f"states file {name}: cannot open ({e.strerror})") from None
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                os.close(fd)
                raise CorecapError(f"states file {name} is not a regular file")
            if len(self.fds) >= self.max_open:
                os.close(self.fds.pop(next(iter(self.fds))))
            self.fds[segment] = fd
        return fd

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()
