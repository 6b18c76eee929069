"""`corecap serve --store DIR`: every sample the server delivers, also committed to a corecap
store, by the writer that `corecap run` commits with (corecap/sink/writer.py), in the sink
process (the server's end: corecap/serve/store_copy.py).

Delivery comes first: the sample is written for its reader (corecap/sink/deliver.py) and then
queued to the writer, which encodes (the store's codec), writes and commits it in its own threads
as it commits a run's samples: batched, the states fdatasync'd, then their headers in one fsync'd
LMDB transaction. Its buffer and its share of --buffer-gb go back at its commit, as in a run, so
the sink's memory stays within the bound and a disk slower than the readers holds new requests
back at admission instead of filling memory.

A key is stored once: one already in the store, or queued to it, is not stored again (the first
copy stays, as a rerun of `corecap run` keeps a committed key); whether its input was the same
is counted (`Kept`). A write that fails (a full disk) ends the copy, never the sink: the writer
gives back what it had queued (writer.py, `_give_back`), the samples after it are delivered
without a copy, and the server is told why once. What was committed stays whole."""

from __future__ import annotations

from collections.abc import Callable

from corecap.errors import CorecapError
from corecap.sink.buffers import BufferPool
from corecap.sink.messages import Kept
from corecap.sink.writer import Writer
from corecap.store import Store, input_fingerprint


class StoreCopy:
    """The sink's copy of each delivered sample to the store at `path`, whose writer lock the
    server holds (corecap/writer_lock.py: the sink checks that its parent holds it)."""

    def __init__(self, path: str, num_threads: int, buffer_bytes: int, buffers: BufferPool,
                 release: Callable[[int], None]):
        """`release(reserved)`: a sample's share of --buffer-gb back to the driver, once committed."""
        store = Store.open_for_writing(path)
        try:
            store.append([])  # its state files opened: what a killed writer left uncommitted is cut off
            # key → its input's fingerprint (a response's: its prompt's), of every sample stored or queued
            self.fingerprints = store.fingerprints()
        except BaseException:
            store.close()
            raise
        self.store, self.buffers, self.release = store, buffers, release
        # Each sample flagged, not refused, if its states hold NaN/Inf: they were delivered as they are.
        self.writer = Writer(store, codec=store.meta.codec, nonfinite="store", num_threads=num_threads,
                             buffer_bytes=buffer_bytes, ledger=buffers, timed=False)
        self.num_same = self.num_other = 0
        self.first_other = ""
        self.failure = ""
        self.closed = False
        self.sent: tuple | None = None

    def keep(self, key: str, p) -> bool:
        """Queue the delivered sample `p` (collect.py's) under `key`; once committed, its buffer goes
        back to the pool and its reservation to the driver. False: not taken (the key is stored
        already, or the store failed): the caller gives both back now."""
        if self.failure or self.closed:
            return False
        prompt = p.token_ids if p.generation is None else p.token_ids[: p.generation.num_prompt]
        fingerprint = input_fingerprint(prompt)
        stored = self.fingerprints.get(key)
        if stored is not None:
            if stored == fingerprint:
                self.num_same += 1
            else:
                self.num_other += 1
                self.first_other = self.first_other or key
            return False
        reserved = p.reserved

        def committed() -> None:  # on the writer's commit thread
            self.release(reserved)

        try:
            self.writer.put(key, p.token_ids, p.stored_states(), p.loss_mask, release=self.buffers.give,
                            generation=p.generation, committed=committed)
        except CorecapError:  # the writer failed meanwhile: nothing was queued
            self.check()
            return False
        self.fingerprints[key] = fingerprint
        return True

    def check(self) -> None:
        """Once the writer has failed: end the copy (what it had queued is given back)."""
        if self.failure or self.writer.error is None:
            return
        self.failure = str(self.writer.error)
        self._close()

    def status(self) -> Kept | None:
        """What the copy has done, when that changed since the last call (None: nothing new)."""
        w = self.writer
        now = (w.num_committed, w.num_tokens, w.nbytes, self.num_same, self.num_other, self.first_other, self.failure)
        if now == self.sent:
            return None
        self.sent = now
        return Kept(num_committed=w.num_committed, num_tokens=w.num_tokens, nbytes=w.nbytes, num_same=self.num_same,
                    num_other=self.num_other, first_other=self.first_other, failure=self.failure)

    def close(self) -> None:
        """Commit everything queued (the server stops), then let the store go."""
        self._close()
        if not self.failure and self.writer.error is not None:
            self.failure = str(self.writer.error)

    def _close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self.writer.close()
        except BaseException:  # its error is `writer.error`, which `check` and `close` report
            pass
        self.store.close()
