"""The store writer: encodes finished samples on a thread pool and commits them in durable batches.

Each commit is whole samples only: their states fdatasync'd, then their headers and pointers in
one fsync'd LMDB transaction, so a kill at any moment leaves every committed sample intact and
no partial one. Encoding (checksum, NaN/Inf check, compression or fp8) runs on `num_threads` threads,
since zstd, crc32 and torch release the GIL. A write thread takes the encoded records in arrival
order, batches them (up to `batch_bytes`, or whatever is ready) and writes their states; a commit
thread makes each batch durable meanwhile, so the disk streams while the next batch is written.
`put` never waits: what the queue may hold is bounded before a sample reaches it, by the driver,
which admits a sample only while the sink's buffers, those awaiting their commit here included,
fit in --buffer-gb (corecap/sink/budget.py). That bound is the backpressure that keeps host memory
flat when the disk is the bottleneck, and the slack that lets the GPU run ahead of a disk that
keeps up on average.
"""

from __future__ import annotations

import errno
import functools
import queue
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from corecap.dtypes import DTYPES, crc32
from corecap.errors import CorecapError
from corecap.sink import memory
from corecap.store import FP8, Record, Store, encode_sample, fp8rows
from corecap.store.format import spilled_record
from corecap.store.fp8 import NonFiniteStates
from corecap.store.spill import SpillFile

_DONE = object()


class _Queued(NamedTuple):
    """A sample on its way to the write thread: its encoding (a future) and what its commit settles."""

    encoded: object  # Future of (Record, bytes it holds of --buffer-gb)
    num_tokens: int
    raw_bytes: int  # its states' size before the codec
    after_commit: list  # callables to run once it is committed


class _Written(NamedTuple):
    """A batch written to the state files, on its way to the commit thread."""

    appended: object  # Store.append's result, for Store.commit
    num_tokens: int
    raw_bytes: int
    referred_bytes: int  # raw states that references stand for (stored once, not written)
    held: int  # bytes of --buffer-gb the batch held, given back at its commit
    releases: list  # callables to run once it is committed
_LOW_SPACE = 64 << 20  # a failed write with less free space than one commit batch: disk full
_PIECE_BYTES = 8 << 20  # a long sample's spill file is read back this much at a time, at most
# Codecs whose encoded bytes never view the states (zstd-planes splits them into byte planes first:
# corecap/store/codec.py, encode_parts): a sample's buffer can go back once it is encoded, and its
# encoded copy is what it holds until its commit. raw's bytes are the buffer itself, and fp8's
# may be views of the workers' rows: those buffers go back at the commit.
_COPYING_CODECS = frozenset({"zstd-planes"})


@dataclass
class CommitTiming:
    start: float
    end: float
    num_samples: int
    nbytes: int


class NonFiniteError(CorecapError):
    pass


def all_finite(states: torch.Tensor) -> bool:
    """Whether no element is NaN or ±Inf. A sum is non-finite whenever an element is (NaN and Inf
    propagate through IEEE additions), and a finite sum settles it in one read of the states,
    without isfinite's mask, which is many times slower (measured: `python -m tools.bench.sink
    --only check`; docs/benchmarks.md, "Figures the code cites").
    Only a sum that overflowed is checked
    element by element, which float16's small range makes likelier (then as slow as before)."""
    if not states.is_floating_point():
        return True
    return bool(torch.isfinite(states.sum())) or bool(torch.isfinite(states).all())


class Writer:
    def __init__(
        self,
        store: Store,
        codec: str = "raw",
        nonfinite: str = "stop",
        num_threads: int = 2,
        batch_bytes: int = 64 << 20,
        buffer_bytes: int = 4 << 30,
        ledger=None,
        commit_delay: float = 0.0,
        timed: bool = True,
    ):
        """`ledger` (the sink's BufferPool): where the encoded copies that stand in for a buffer
        given back are counted (`hold`, `drop`), inside --buffer-gb. `commit_delay`: a test's slow
        disk (config.TestHooks). `timed`: each encode, write and commit timed for the run's trace;
        a server's copy to its store, which runs for as long as the server, keeps none."""
        self.store = store
        self.ledger = ledger
        self.commit_delay = commit_delay
        self.timed = timed
        self.layers = store.meta.layers
        self.codec = codec
        self.nonfinite = nonfinite
        self.batch_bytes = batch_bytes
        self.pool = ThreadPoolExecutor(num_threads, thread_name_prefix="corecap-encode")
        self.queue: queue.Queue = queue.Queue()
        self.buffer_bytes = buffer_bytes  # --buffer-gb: sizes a long sample's read-back pieces
        self.error: BaseException | None = None
        self.num_committed = 0
        self.num_tokens = 0
        self.nbytes = 0
        self.raw_bytes = 0  # of the states encoded (a reference's prefix is not)
        self.referred_bytes = 0  # of the states that references to other samples stand for
        self.flagged: list[str] = []
        self.writes: list[CommitTiming] = []  # states written to the page cache
        self.commits: list[CommitTiming] = []  # states synced, headers and pointers committed
        self.encodes: list[tuple[float, float]] = []  # (start, end) of each sample's encoding
        # One batch is written while the one before it is committed; more would only hold memory.
        self.written: queue.Queue = queue.Queue(maxsize=1)
        self.threads = [
            threading.Thread(target=self._write_loop, daemon=True, name="corecap-write"),
            threading.Thread(target=self._commit_loop, daemon=True, name="corecap-commit"),
        ]
        for t in self.threads:
            t.start()

    def _timing(self, timings: list, entry) -> None:
        if self.timed:  # list.append is atomic under the GIL: the encode threads call this too
            timings.append(entry)

    def put(
        self, key: str, token_ids: np.ndarray, states: torch.Tensor, loss_mask: np.ndarray | None = None, release=None,
        prefix: tuple | None = None, generation=None, committed=None, media=None,
    ) -> None:
        """Queue one finished sample; never waits (the driver bounds what is queued:
        corecap/sink/budget.py). `release(states)` is called once nothing reads `states`: once
        encoded by a codec that copies (`_COPYING_CODECS`), else once committed (the encoded
        bytes are views of `states` until then). `committed()` is called once it is committed.
        `prefix`: the segments that store its positions [0, n) (corecap/store/refs.py), in samples
        put before it (commits keep the order of `put`); only [n, T) is encoded and written.
        `generation` (store.Generation): the model wrote the sample's response."""
        raw = (states.numel() * states.element_size() if states.dtype != torch.uint8
               else fp8rows.captured_nbytes(states, self.store.meta.dtype))
        self.raise_if_failed()
        early = release is not None and self.codec in _COPYING_CODECS
        future = self.pool.submit(self._encode, key, token_ids, states, loss_mask, prefix, generation,
                                  functools.partial(release, states) if early else None, media)
        after = [functools.partial(release, states)] if release is not None and not early else []
        self.queue.put(_Queued(future, len(token_ids), raw, after + ([committed] if committed else [])))

    def put_spilled(self, key: str, token_ids: np.ndarray, spill: SpillFile, loss_mask: np.ndarray | None = None,
                    committed=None, media=None) -> None:
        """Queue one finished long sample whose raw states are its spill file (sink/stream.py):
        read back a piece at a time to checksum and check them, then renamed into the state files
        at its commit. It holds no buffer, only the piece being read. `committed()` is called
        once it is committed."""
        self.raise_if_failed()
        future = self.pool.submit(self._encode_spilled, key, token_ids, spill, loss_mask, media)
        self.queue.put(_Queued(future, len(token_ids), spill.nbytes, [committed] if committed else []))

    def _encode_spilled(self, key: str, token_ids, spill: SpillFile, loss_mask, media=None) -> tuple[Record, int]:
        start = time.time()
        meta = self.store.meta
        fp8 = self.codec == FP8
        try:
            checksum, bad = (self._check_fp8 if fp8 else self._check_states)(spill, len(token_ids))
            if bad and self.nonfinite == "stop":  # fp8 excludes --nonfinite store (config.py)
                raise NonFiniteError(f"sample {key!r}: NaN/Inf in the captured states at layers {bad} "
                                     "(use --nonfinite store to keep and flag)")
            if bad:
                self.flagged.append(key)
            decoded = len(self.layers) * len(token_ids) * meta.hidden_size * DTYPES[meta.dtype].itemsize
            record = spilled_record(key, token_ids, self.layers, meta.dtype, meta.hidden_size, checksum, spill.sync(),
                                    loss_mask, nonfinite=bool(bad), codec=FP8 if fp8 else "raw",
                                    payload_bytes=decoded, media=media)
        except BaseException:
            spill.discard()
            raise
        self._timing(self.encodes, (start, time.time()))
        return record, 0

    def _piece_bytes(self, itemsize: int) -> int:
        """A spill file's read-back piece: 1/32 of the bound, at most `_PIECE_BYTES`, whole items."""
        return max(itemsize, min(_PIECE_BYTES, self.buffer_bytes // 32) // itemsize * itemsize)

    def _check_states(self, spill: SpillFile, num_tokens: int) -> tuple[int, list]:
        """A raw `[L, T, H]` spill file's crc32 and the layers holding NaN/Inf, a piece at a time."""
        dtype = DTYPES[self.store.meta.dtype]
        layer_bytes = spill.nbytes // len(self.layers)
        checksum, bad = 0, []
        for offset, part in spill.pieces(self._piece_bytes(dtype.itemsize), layer_bytes):
            checksum = crc32(part, checksum)
            layer = self.layers[offset // layer_bytes]
            if (not bad or bad[-1] != layer) and not all_finite(torch.frombuffer(part, dtype=dtype)):
                bad.append(layer)
        return checksum, bad

    def _check_fp8(self, spill: SpillFile, num_tokens: int) -> tuple[int, list]:
        """An fp8 payload's crc32 (the stored bytes', as `encode_sample`'s), and the layers a scale
        of which is not finite (a row with NaN/Inf: fp8rows.py)."""
        checksum = 0
        for _, part in spill.pieces(self._piece_bytes(1), spill.nbytes):
            checksum = crc32(part, checksum)
        bad = []
        scales_bytes = len(self.layers) * num_tokens * fp8rows.ROW_EXTRA
        layer_bytes = num_tokens * fp8rows.ROW_EXTRA
        for offset, part in spill.pieces(self._piece_bytes(4), layer_bytes, spill.nbytes - scales_bytes):
            layer = self.layers[offset // layer_bytes]
            if (not bad or bad[-1] != layer) and not np.isfinite(part.view("<f4")).all():
                bad.append(layer)
        return checksum, bad

    def _encode(self, key: str, token_ids, states: torch.Tensor, loss_mask, prefix, generation,
                release, media=None) -> tuple[Record, int]:
        """The sample's record, and the bytes of its encoded copy counted in the ledger until its
        commit (those of a codec that copies, whose buffer `release` gives back here)."""
        start = time.time()
        record = self._encode_checked(key, token_ids, states[:, prefix[-1].end :] if prefix else states, loss_mask,
                                      prefix, generation, media)
        self._timing(self.encodes, (start, time.time()))
        held = 0
        if release is not None:
            release()  # first: the buffer given back makes room for its copy
            if self.ledger is not None:
                held = record.nbytes
                self.ledger.hold(held)
        return record, held

    def _encode_checked(self, key: str, token_ids, states: torch.Tensor, loss_mask, prefix, generation,
                        media=None) -> Record:
        dtype = self.store.meta.dtype
        refused = None
        if self.codec == FP8:  # its row maxima find any NaN/Inf: no pass of all_finite's own
            try:
                return encode_sample(key, token_ids, states, self.layers, codec=FP8, loss_mask=loss_mask, prefix=prefix,
                                     dtype=dtype, generation=generation, media=media)
            except NonFiniteStates as e:
                refused = e  # reported below, as for the other codecs
        # fp8 rows come here only when refused: a NaN or an Inf made a row's scale one
        rows = states.dtype == torch.uint8
        finite = not rows and all_finite(states)
        if not finite:
            bad = ([self.layers[i] for i in refused.layer_indices] if rows
                   else [k for k, layer in zip(self.layers, states) if not bool(torch.isfinite(layer).all())])
            if self.nonfinite == "stop":
                raise NonFiniteError(f"sample {key!r}: NaN/Inf in the captured states at layers {bad} "
                                     "(use --nonfinite store to keep and flag)")
            self.flagged.append(key)
        return encode_sample(key, token_ids, states, self.layers, codec=self.codec, loss_mask=loss_mask,
                             nonfinite=not finite, prefix=prefix, dtype=dtype, generation=generation, media=media)

    def raise_if_failed(self) -> None:
        if self.error is not None:
            raise self.error

    def _write_loop(self) -> None:
        done = False
        held, releases = 0, []
        try:
            while not done and self.error is None:
                item = self.queue.get()
                records, size, tokens, raw, referred, held, releases = [], 0, 0, 0, 0, 0, []
                while True:
                    if item is _DONE:
                        done = True
                        break
                    future, num_tokens, num_raw, after_commit = item
                    releases += after_commit
                    record, num_held = future.result()
                    held += num_held
                    records.append(record)
                    size += record.nbytes
                    tokens += num_tokens
                    raw += num_raw
                    referred += num_raw * record.num_prefix // max(1, num_tokens)  # stored by others
                    if size >= self.batch_bytes:
                        break
                    try:
                        item = self.queue.get_nowait()
                    except queue.Empty:
                        break
                if records:
                    start = time.time()
                    appended = self.store.append(records)
                    self._timing(self.writes, CommitTiming(start, time.time(), len(records), size))
                    self.written.put(_Written(appended, tokens, raw, referred, held, releases))
                held, releases = 0, []
        except BaseException as e:
            self._fail(e)
            self._give_back(held, releases)
        finally:
            self.written.put(_DONE)
        while not done:  # failed: what is still queued is never written, only given back
            item = self.queue.get()
            done = item is _DONE
            if not done:
                self._give_back(_held_by(item.encoded), item.after_commit)

    def _commit_loop(self) -> None:
        next_trim = time.monotonic() + memory.TRIM_EVERY_S
        item = None
        try:
            while (item := self.written.get()) is not _DONE:
                # committed even after a later failure: it is whole
                appended, tokens, raw, referred, held, releases = item
                if self.commit_delay:
                    time.sleep(self.commit_delay)
                start = time.time()
                nbytes = self.store.commit(appended)
                item = None
                self._timing(self.commits, CommitTiming(start, time.time(), len(appended.records), nbytes))
                self.num_committed += len(appended.records)
                self.num_tokens += tokens
                self.nbytes += nbytes
                self.raw_bytes += raw - referred
                self.referred_bytes += referred
                if held:
                    self.ledger.drop(held)
                for release in releases:
                    release()
                if time.monotonic() >= next_trim:
                    memory.return_freed_memory()
                    next_trim = time.monotonic() + memory.TRIM_EVERY_S
        except BaseException as e:
            self._fail(e)
            while item is not _DONE:  # the batch that failed, then those written after it
                if item is not None:
                    self._give_back(item.held, item.releases)
                item = self.written.get()

    def _give_back(self, held: int, releases: list) -> None:
        """What a failed writer will never commit: its buffers, its encoded copies' count and its
        share of --buffer-gb go back all the same (the `committed` callbacks run too), so that a
        process that goes on without the store (`corecap serve --store`: sink/store_copy.py) gets
        its memory back. Nothing is counted as committed."""
        if held and self.ledger is not None:
            self.ledger.drop(held)
        for release in releases:
            try:
                release()
            except Exception:  # a buffer given back twice is no reason to stop giving back the rest
                pass

    def _fail(self, e: BaseException) -> None:
        if self.error is None:
            self.error = e if isinstance(e, CorecapError) else CorecapError(
                f"{self.store.path}: writing the store failed: {_reason(e, self.store.path)}"
            )

    def close(self) -> None:
        """Commit everything queued and stop; raises if any commit failed."""
        self.queue.put(_DONE)
        for t in self.threads:
            t.join()
        self.pool.shutdown(wait=True)
        self.raise_if_failed()


def _held_by(encoded) -> int:
    """The bytes an encoded sample holds of --buffer-gb (0 if its encoding failed: nothing copied)."""
    try:
        return encoded.result()[1]
    except BaseException:
        return 0


def _reason(e: BaseException, path: str) -> str:
    text = str(e) or type(e).__name__
    # LMDB reports a short write on a full disk as EIO, so ask the filesystem too.
    free = shutil.disk_usage(path).free
    if "No space left" in text or getattr(e, "errno", None) == errno.ENOSPC or free < _LOW_SPACE:
        return f"the disk is full ({free / 2**20:.0f} MiB free; {text})"
    return text

