"""The sink: a separate process that receives the workers' chunks, reassembles samples, encodes
and commits them, so the data path never competes with the engine's step loop for the driver's
GIL (its rate on a GPU: docs/benchmarks.md, "Capture").

Driver ↔ sink talk over two IPC sockets in the run's private 0700 directory: the driver tells
the sink which requests to expect (key, token ids, loss mask) and finally to finish or abort;
the sink answers with `Done` (counts and timings for the trace) or `Failed` (one sentence).
The workers push their chunks straight to the sink (corecap/transport/wire.py). The sink ignores
SIGINT/SIGTERM: the driver decides, and an abort still commits every sample that is complete.
If the driver dies, the sink notices its parent is gone, commits what is complete and exits.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import numpy as np
import zmq

from corecap.errors import CorecapError
from corecap.sink.budget import Released
from corecap.sink.buffers import BufferPool
from corecap.sink.collect import Collector
from corecap.sink.deliver import Deliveries, DeliverSpec, Deliverer
from corecap.sink.memory import peak_rss, rss
from corecap.sink.messages import (
    BlockHash, Control, Delivered, Discard, Done, Drop, Expect, Failed, Finish, Forget, Generated, Hits,
)
from corecap import writer_lock as lock
from corecap.transport import ring, wire

CONTROL = "control.sock"
STATUS = "status.sock"
CAPTURE = "capture.sock"
# The sink's parallelism is its own threads (encoders, copiers), each running torch with one
# intra-op thread: with torch's default (a thread per core) every calling thread can get an
# OpenMP team of its own, many times more threads than cores. Measured on the H200 host against
# 16 torch threads and 1 copy thread (docs/benchmarks.md, "Capture").
_TORCH_THREADS = 1


def copy_threads() -> int:
    """Threads that copy chunks into samples: a quarter of the cores, 2 to 4."""
    return min(4, max(2, (os.cpu_count() or 2) // 4))


@dataclass(frozen=True, kw_only=True)
class SinkSpec:
    store: str
    ipc_dir: str
    codec: str
    nonfinite: str
    num_threads: int
    buffer_bytes: int
    parent_pid: int
    tcp_address: str = ""  # also receive states there (from a worker on another node)
    block_size: int = 0  # vLLM's, with prefix caching on (0: off)
    released: Released | None = None  # what the sink's commits gave back of --buffer-gb (sink/budget.py)
    commit_delay: float = 0.0  # config.TestHooks
    deliver: DeliverSpec | None = None  # `corecap serve`: each sample to a file of its own (with `store`: there too)
    layers: tuple = ()  # the captured layers, with `deliver` (a store's metadata names them otherwise)
    parent_holds_lock: bool = False  # the run holds the store's writer lock (corecap/writer_lock.py)


def main(spec: SinkSpec) -> None:
    """The sink process: serve until finished or aborted, then report `Done` or `Failed`."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    import torch

    torch.set_num_threads(_TORCH_THREADS)
    if spec.parent_holds_lock:
        lock.trust_parent(spec.store)
    ctx = zmq.Context()
    status = ctx.socket(zmq.PUSH)
    status.connect(f"ipc://{os.path.join(spec.ipc_dir, STATUS)}")
    encoder = msgspec.msgpack.Encoder()
    loop = None
    try:
        loop = _Loop(ctx, spec)
        loop.notify = lambda msg: status.send(encoder.encode(msg))
        status.send(encoder.encode(loop.serve()))
    except BaseException as e:
        message = str(e) if isinstance(e, CorecapError) else f"the sink failed: {e!r}"
        committed = loop.close_writer_after_failure() if loop is not None else 0
        status.send(encoder.encode(Failed(message, committed)))
    finally:
        if loop is not None:
            loop.collector.close()
        status.close(linger=5000)
        ctx.destroy(linger=0)


class _Loop:
    """The sink's sockets, reassembly and writer; `serve` runs until finish or abort."""

    def __init__(self, ctx: zmq.Context, spec: SinkSpec):
        from corecap.sink.writer import Writer
        from corecap.store import Store

        self.spec = spec
        self.control = ctx.socket(zmq.PULL)
        self.control.connect(f"ipc://{os.path.join(spec.ipc_dir, CONTROL)}")
        self.data = ctx.socket(zmq.PULL)
        self.data.setsockopt(zmq.RCVHWM, 2)
        self.data.bind(f"ipc://{os.path.join(spec.ipc_dir, CAPTURE)}")
        if spec.tcp_address:
            try:
                self.data.bind(spec.tcp_address)
            except zmq.ZMQError as e:
                raise CorecapError(f"the sink cannot listen on {spec.tcp_address} "
                                   f"for the other node's states ({e})") from None
        self.ctx = ctx
        self.free: dict[str, zmq.Socket] = {}  # ring → where its slots go back once reassembled
        self.rings = ring.RingReader()
        self.writer = None
        self.collector = None
        self.notify: Callable[[Delivered], None] = lambda msg: None  # main() sends them to the driver
        self.buffers = BufferPool(spec.buffer_bytes)
        self.released = spec.released or Released()
        self.released_lock = threading.Lock()  # delivering: the main thread adds to it, and the store's commits
        self.copy = None  # `corecap serve --store`: each sample delivered, also to the store (sink/store_copy.py)
        self.decoder = msgspec.msgpack.Decoder(Control)
        self.finishing = self.aborting = False
        self.rss_start = rss()
        if spec.deliver is not None:  # each sample to its own file (corecap serve)
            self.deliverer = Deliverer(spec.deliver)
            # files on several threads; one for a Mooncake store, whose client corecap uses from one
            self.deliveries = Deliveries(1 if spec.deliver.mooncake is not None else copy_threads())
            self.spec_captures: dict = {}  # key → SpecForge's layout for it (Expect.spec_capture)
            self.lossless: set[str] = set()  # keys written to a file in the stored dtype (Expect.lossless)
            self.store_keys: dict[str, str] = {}  # key → the key it is stored under (Expect.store_key)
            if spec.store:
                from corecap.sink.store_copy import StoreCopy

                self.copy = StoreCopy(spec.store, spec.num_threads, spec.buffer_bytes, self.buffers, self._release)
            self.collector = Collector(spec.layers, self._deliver, self.buffers, copy_threads(), spec.block_size,
                                       whole=True, on_forgotten=self._forgotten, timed=False)
            return
        store = Store.open_for_writing(spec.store)
        # The store's one-writer lock now, before the engine starts (and every run's start checks
        # it, Store.create_or_open): a second run on this store is refused before it loads a model.
        store.append([])
        self.writer = Writer(store, codec=spec.codec, nonfinite=spec.nonfinite, num_threads=spec.num_threads,
                             buffer_bytes=spec.buffer_bytes, ledger=self.buffers, commit_delay=spec.commit_delay)
        self.collector = Collector(store.meta.layers, self._complete, self.buffers, copy_threads(), spec.block_size,
                                   spec.store, spec.buffer_bytes)

    def _complete(self, p) -> None:
        """A sample every position of which is here, to the writer: held, or streamed to disk."""
        reserved = p.reserved  # not `p`, whose buffer a closure would keep alive until the commit

        def committed() -> None:  # on the writer's commit thread: the driver may admit more
            self.released.add(reserved)

        if p.spill is not None:
            self.writer.put_spilled(p.key, p.token_ids, p.spill, p.loss_mask, committed=committed, media=p.media)
            return
        self.writer.put(p.key, p.token_ids, p.stored_states(), p.loss_mask, release=self.buffers.give,
                        prefix=p.producer.prefix if p.producer else None, generation=p.generation, committed=committed,
                        media=p.media)

    def _deliver(self, p) -> None:
        """A sample every position of which is here, to its file (`corecap serve`); once written,
        with --store, to the store's writer, which gives its buffer back at its commit."""
        spec_capture = self.spec_captures.pop(p.key, None)
        lossless = p.key in self.lossless
        self.lossless.discard(p.key)
        store_key = self.store_keys.pop(p.key, "")
        key, token_ids, states = p.key, p.token_ids, p.stored_states()

        def write() -> tuple[int, str, bool]:  # on a delivery thread
            return self.deliverer.deliver(key, token_ids, states, spec_capture, lossless)

        def written(nbytes: int, error: str, full: bool) -> None:  # back on this thread
            if not (store_key and not error and self.copy is not None and self.copy.keep(store_key, p)):
                self.buffers.give(p.states)
                self._release(p.reserved)
            self.notify(Delivered(key, nbytes, error, full))

        self.deliveries.submit(write, written)

    def _release(self, reserved: int) -> None:
        """A sample's share of --buffer-gb back to the driver (from the main thread, or the store's commits)."""
        with self.released_lock:
            self.released.add(reserved)

    def _forgotten(self, p) -> None:
        """An aborted sample, dropped (`corecap serve`): its buffer and reservation go back."""
        self.spec_captures.pop(p.key, None)
        self.lossless.discard(p.key)
        self.store_keys.pop(p.key, None)
        if p.states is not None:
            self.buffers.give(p.states)
        self._release(p.reserved)

    def serve(self) -> Done:
        poller = zmq.Poller()
        poller.register(self.control, zmq.POLLIN)
        poller.register(self.data, zmq.POLLIN)
        if self.writer is None:  # delivering: a file written wakes the loop (Deliveries.fileno)
            poller.register(self.deliveries, zmq.POLLIN)
        while not self.aborting and not (self.finishing and not self.collector.pending and not self._delivering()):
            events = dict(poller.poll(100))
            if self.writer is None:
                self.deliveries.finished()
            while self.control.poll(0):
                self._on_control(self.control.recv())
            if self.data in events and not self.aborting:
                self._on_chunk(self.data.recv_multipart(copy=False))
            if self.writer is not None:
                self.writer.raise_if_failed()
            if self.copy is not None:
                self._report_copy()
            if os.getppid() != self.spec.parent_pid:
                self.aborting = True  # the driver is gone: keep what is complete
        if self.writer is None:  # delivering: every sample complete is written, and reported, by now
            self.deliveries.close()
            committed = 0
            if self.copy is not None:  # what was delivered is committed to the store before the sink ends
                self.copy.close()
                self._report_copy()
                committed = self.copy.writer.num_committed
            return Done(num_committed=committed, num_tokens=0, nbytes=0, raw_bytes=0, flagged=[], chunks=[],
                        commits=[], encodes=[], writes=[], num_incomplete=len(self.collector.pending))
        self.writer.close()
        w, c = self.writer, self.collector
        return Done(
            num_committed=w.num_committed, num_tokens=w.num_tokens, nbytes=w.nbytes, raw_bytes=w.raw_bytes,
            num_incomplete=len(c.pending), flagged=w.flagged,
            chunks=[dataclasses.asdict(t) for t in c.timings], commits=[dataclasses.asdict(t) for t in w.commits],
            encodes=[{"start": a, "end": b} for a, b in w.encodes], writes=[dataclasses.asdict(t) for t in w.writes],
            num_referring=c.num_referring, referred_bytes=w.referred_bytes, num_stored_whole=c.num_stored_whole,
            num_streamed=c.num_streamed, rss_start=self.rss_start, rss_peak=peak_rss(),
            buffers_peak=self.buffers.peak_bytes,
        )

    def _delivering(self) -> int:
        """Files being written (`corecap serve`)."""
        return self.deliveries.num_running if self.writer is None else 0

    def _on_control(self, raw: bytes) -> None:
        msg = self.decoder.decode(raw)
        if isinstance(msg, Expect):
            mask = None if msg.loss_mask is None else np.frombuffer(msg.loss_mask, np.uint8)
            self.collector.expect(msg.req_id, msg.key, np.frombuffer(msg.token_ids, "<i4"), mask, msg.block_hashes,
                                  msg.max_new, msg.reserved, msg.media)
            if msg.spec_capture is not None:
                self.spec_captures[msg.key] = msg.spec_capture
            if msg.lossless:
                self.lossless.add(msg.key)
            if msg.store_key:
                self.store_keys[msg.key] = msg.store_key
        elif isinstance(msg, Generated):
            self.collector.generated(msg.req_id, np.frombuffer(msg.token_ids, "<i4"), msg.generation)
        elif isinstance(msg, BlockHash):
            self.collector.block_hash(msg.req_id, msg.index, msg.block_hash)
        elif isinstance(msg, Hits):
            self.collector.hits(msg.req_id, msg.num_blocks)
        elif isinstance(msg, Drop):
            self.collector.drop(msg.block_hash, msg.count)
        elif isinstance(msg, Forget):  # only a delivering sink (corecap serve) is told to forget
            self.collector.forget(msg.req_id, msg.until)
        elif isinstance(msg, Discard):  # on the delivery thread, the one that uses the store's client
            keys = msg.keys
            self.deliveries.submit(lambda: self.deliverer.discard(keys), lambda *outcome: None)
        elif isinstance(msg, Finish):
            self.finishing = True
        else:
            self.aborting = True

    def _on_chunk(self, frames) -> None:
        t_recv = time.time()
        try:
            msg = wire.decode(frames, ring=self.rings)
        except wire.WireError as e:
            raise CorecapError(f"a worker sent a bad message: {e}") from None
        if isinstance(msg, wire.WorkerError):
            raise CorecapError(f"worker rank {msg.rank} (pid {msg.pid}) failed: {msg.message.splitlines()[0]}")
        # The driver announces a request before the engine sees it, but on another socket.
        deadline = time.monotonic() + 10
        while not self.collector.knows(msg) and time.monotonic() < deadline and self.control.poll(100):
            self._on_control(self.control.recv())
        self.collector.take(msg, t_recv)
        if msg.header.ring:
            self._free_socket(msg.header.ring).send(msg.header.slot.to_bytes(4, "little"))

    def _free_socket(self, ring_path: str) -> zmq.Socket:
        """The socket back to the worker that owns this ring (each replica's sender has one;
        `ring.RingReader` has already checked that the path names a corecap ring)."""
        sock = self.free.get(ring_path)
        if sock is None:
            sock = self.ctx.socket(zmq.PUSH)
            sock.connect(f"ipc://{os.path.join(self.spec.ipc_dir, ring.free_socket(ring_path))}")
            self.free[ring_path] = sock
        return sock

    def _report_copy(self) -> None:
        """The store copy's news to the driver: its commits, its keys stored already, its failure."""
        self.copy.check()
        kept = self.copy.status()
        if kept is not None:
            self.notify(kept)

    def close_writer_after_failure(self) -> int:
        """Commit what is complete (the writer stops by itself if the store failed)."""
        if self.copy is not None:
            self.copy.close()
            return self.copy.writer.num_committed
        if self.writer is None:
            return 0
        try:
            self.writer.close()
        except BaseException:
            pass
        return self.writer.num_committed
