"""The sink: a separate process that receives the workers' chunks, reassembles samples, encodes
and commits them, so the data path never competes with the engine's step loop for the driver's
GIL (on the H200 it moves ~1.4 GB/s).

Driver ↔ sink talk over two IPC sockets in the run's private 0700 directory: the driver tells
the sink which requests to expect (key, token ids, loss mask) and finally to finish or abort;
the sink answers with `Done` (counts and timings for the trace) or `Failed` (one sentence).
The workers push their chunks straight to the sink (wire.py). The sink ignores SIGINT/SIGTERM:
the driver decides, and an abort still commits every sample that is complete. If the driver
dies, the sink notices its parent is gone, commits what is complete and exits.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import shutil
import signal
import threading
import time
import _thread
from dataclasses import dataclass

import msgspec
import numpy as np
import torch
import zmq

from corecap import CorecapError, ring, wire
from corecap.collect import BufferPool, Collector

_CONTROL = "control.sock"
_STATUS = "status.sock"
CAPTURE = "capture.sock"


class Expect(msgspec.Struct, array_like=True, tag=1):
    req_id: str
    key: str
    token_ids: bytes  # int32 LE
    loss_mask: bytes | None = None


class Finish(msgspec.Struct, array_like=True, tag=2):
    pass


class Abort(msgspec.Struct, array_like=True, tag=3):
    pass


class Done(msgspec.Struct, array_like=True, tag=4):
    num_committed: int
    num_tokens: int
    nbytes: int
    raw_bytes: int
    num_incomplete: int
    flagged: list[str]
    chunks: list[dict]
    commits: list[dict]
    encodes: list[dict]
    writes: list[dict]


class Failed(msgspec.Struct, array_like=True, tag=5):
    message: str
    num_committed: int


Control = Expect | Finish | Abort
Status = Done | Failed


@dataclass(frozen=True)
class SinkSpec:
    store: str
    ipc_dir: str
    codec: str
    nonfinite: str
    num_threads: int
    buffer_bytes: int
    parent_pid: int


class Sink:
    """The driver's handle on the sink process."""

    def __init__(self, store: str, codec: str, nonfinite: str, num_threads: int, buffer_bytes: int):
        self.dir = wire.private_ipc_dir("corecap-")  # mode 0700: owner only
        self.capture_path = os.path.join(self.dir, CAPTURE)
        self.ctx = zmq.Context()
        self.control = self.ctx.socket(zmq.PUSH)
        self.control.bind(f"ipc://{os.path.join(self.dir, _CONTROL)}")
        self.status = self.ctx.socket(zmq.PULL)
        self.status.bind(f"ipc://{os.path.join(self.dir, _STATUS)}")
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(Status)
        spec = SinkSpec(store, self.dir, codec, nonfinite, num_threads, buffer_bytes, os.getpid())
        self.proc = multiprocessing.get_context("spawn").Process(target=main, args=(spec,), name="corecap-sink", daemon=True)
        self.proc.start()
        self.result: Status | None = None
        self.died = False
        self._watching = threading.Event()

    def watch(self) -> None:
        """Interrupt the main thread if the sink dies: the workers would then block on their
        sends, and the step loop inside an engine step, forever."""
        self._watching.set()

        def watchdog() -> None:
            while self._watching.is_set():
                if not self.proc.is_alive():
                    if self._watching.is_set():
                        self.died = True
                        _thread.interrupt_main()
                    return
                time.sleep(0.2)

        threading.Thread(target=watchdog, daemon=True, name="corecap-sink-watchdog").start()

    def unwatch(self) -> None:
        self._watching.clear()

    def failure(self) -> str:
        """Why the sink is gone: its own one-line report, or its exit code."""
        if self.result is None and self.status.poll(1000):
            self.result = self.decoder.decode(self.status.recv())
        if isinstance(self.result, Failed):
            return self.result.message
        return f"the sink process (pid {self.proc.pid}) died (exit code {self.proc.exitcode})"

    def expect(self, req_id: str, key: str, token_ids: np.ndarray, loss_mask: np.ndarray | None) -> None:
        mask = None if loss_mask is None else np.asarray(loss_mask, np.uint8).tobytes()
        self._send(Expect(req_id, key, np.asarray(token_ids, "<i4").tobytes(), mask))

    def check(self) -> None:
        """Raise if the sink failed or died (cheap; call once per step)."""
        if self.result is None and self.status.poll(0):
            self.result = self.decoder.decode(self.status.recv())
        if isinstance(self.result, Failed):
            raise CorecapError(self.result.message)
        if self.result is None and not self.proc.is_alive():
            raise CorecapError(f"the sink process (pid {self.proc.pid}) died (exit code {self.proc.exitcode})")

    def finish(self, timeout: float, problem) -> Done:
        """Wait until every expected sample is committed; fail on a dead worker, sink or timeout."""
        self._send(Finish())
        return self._wait(timeout, problem)

    def abort(self, timeout: float = 60.0) -> Status | None:
        """Stop now: the sink commits the complete samples and drops the rest."""
        if self.result is None and self.proc.is_alive():
            try:
                self._send(Abort())
                return self._wait(timeout, lambda: None, raise_failed=False)
            except CorecapError:
                return self.result  # it failed or died meanwhile: its report, or None
        return self.result

    def _send(self, msg: Control) -> None:
        """Send without ever blocking on a sink that is gone: a PUSH socket without a peer would
        wait forever, inside C, where the watchdog's interrupt cannot reach the step loop."""
        data = self.encoder.encode(msg)
        while True:
            try:
                self.control.send(data, zmq.NOBLOCK)
                return
            except zmq.Again:  # no peer, or the sink is this far behind (high-water mark)
                self.check()
                self.control.poll(100, zmq.POLLOUT)

    def _wait(self, timeout: float, problem, raise_failed: bool = True):
        deadline = time.monotonic() + timeout
        while self.result is None:
            if self.status.poll(50):
                self.result = self.decoder.decode(self.status.recv())
                break
            if not self.proc.is_alive():
                raise CorecapError(f"the sink process (pid {self.proc.pid}) died (exit code {self.proc.exitcode})")
            message = problem()
            if message:
                raise CorecapError(message)
            if time.monotonic() > deadline:
                raise CorecapError(f"timed out after {timeout:.0f}s waiting for the hidden states to be stored")
        if isinstance(self.result, Failed) and raise_failed:
            raise CorecapError(self.result.message)
        return self.result

    def close(self) -> None:
        self.unwatch()
        if self.proc.is_alive():
            self.proc.join(timeout=30)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        self.control.close(linger=0)
        self.status.close(linger=0)
        self.ctx.term()
        shutil.rmtree(self.dir, ignore_errors=True)


def copy_threads() -> int:
    """Threads that copy chunks into samples: a quarter of the cores, 2 to 4."""
    return int(os.environ.get("CORECAP_SINK_COPY_THREADS") or min(4, max(2, (os.cpu_count() or 2) // 4)))


def main(spec: SinkSpec) -> None:
    """The sink process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # One intra-op thread: the sink's parallelism is its own threads, encoders and copiers.
    # With torch's default (a thread per core) every thread that calls torch can get an OpenMP
    # team of its own: on a 16-core host, 8 encoders and the reassembly could ask for 144
    # threads. Not measured on the H200 host yet; CORECAP_SINK_TORCH_THREADS and
    # CORECAP_SINK_COPY_THREADS set other counts for comparisons (tools/bench_gpu.py).
    torch.set_num_threads(int(os.environ.get("CORECAP_SINK_TORCH_THREADS") or 1))
    from corecap.store import Store
    from corecap.writer import Writer

    ctx = zmq.Context()
    status = ctx.socket(zmq.PUSH)
    status.connect(f"ipc://{os.path.join(spec.ipc_dir, _STATUS)}")
    encoder = msgspec.msgpack.Encoder()
    writer = collector = None
    try:
        control = ctx.socket(zmq.PULL)
        control.connect(f"ipc://{os.path.join(spec.ipc_dir, _CONTROL)}")
        data = ctx.socket(zmq.PULL)
        data.setsockopt(zmq.RCVHWM, 2)
        data.bind(f"ipc://{os.path.join(spec.ipc_dir, CAPTURE)}")
        rings = ring.RingReader()
        free = ctx.socket(zmq.PUSH)  # slots of the worker's ring go back once reassembled
        free.connect(f"ipc://{os.path.join(spec.ipc_dir, ring.FREE_SOCKET)}")
        store = Store.open_for_writing(spec.store)
        writer = Writer(store, codec=spec.codec, nonfinite=spec.nonfinite, num_threads=spec.num_threads, buffer_bytes=spec.buffer_bytes)
        buffers = BufferPool(spec.buffer_bytes // 2)
        collector = Collector(
            store.meta.layers, lambda p: writer.put(p.key, p.token_ids, p.states, p.loss_mask, release=buffers.give), buffers,
            copy_threads(),
        )
        decoder = msgspec.msgpack.Decoder(Control)
        poller = zmq.Poller()
        poller.register(control, zmq.POLLIN)
        poller.register(data, zmq.POLLIN)
        finishing = aborting = False

        def on_control(raw: bytes) -> None:
            nonlocal finishing, aborting
            msg = decoder.decode(raw)
            if isinstance(msg, Expect):
                mask = None if msg.loss_mask is None else np.frombuffer(msg.loss_mask, np.uint8)
                collector.expect(msg.req_id, msg.key, np.frombuffer(msg.token_ids, "<i4"), mask)
            elif isinstance(msg, Finish):
                finishing = True
            else:
                aborting = True

        while not aborting and not (finishing and not collector.pending):
            events = dict(poller.poll(100))
            while control.poll(0):
                on_control(control.recv())
            if data in events and not aborting:
                frames = data.recv_multipart(copy=False)
                t_recv = time.time()
                msg = wire.decode(frames, ring=rings)
                if isinstance(msg, wire.WorkerError):
                    raise CorecapError(f"worker rank {msg.rank} (pid {msg.pid}) failed: {msg.message.splitlines()[0]}")
                # The driver announces a request before the engine sees it, but on another socket.
                deadline = time.monotonic() + 10
                while not collector.knows(msg) and time.monotonic() < deadline and control.poll(100):
                    on_control(control.recv())
                collector.take(msg, t_recv)
                if msg.header.ring:
                    free.send(msg.header.slot.to_bytes(4, "little"))
            writer.raise_if_failed()
            if os.getppid() != spec.parent_pid:
                aborting = True  # the driver is gone: keep what is complete
        writer.close()
        status.send(encoder.encode(Done(
            writer.num_committed, writer.num_tokens, writer.nbytes, writer.raw_bytes, len(collector.pending),
            writer.flagged, [dataclasses.asdict(t) for t in collector.timings],
            [dataclasses.asdict(c) for c in writer.commits],
            [{"start": a, "end": b} for a, b in writer.encodes],
            [dataclasses.asdict(w) for w in writer.writes],
        )))
    except BaseException as e:
        message = str(e) if isinstance(e, CorecapError) else f"the sink failed: {e!r}"
        if writer is not None:
            try:  # commit what is complete (the writer stops by itself if the store failed)
                writer.close()
            except BaseException:
                pass
        status.send(encoder.encode(Failed(message, writer.num_committed if writer else 0)))
    finally:
        if collector is not None:
            collector.close()
        status.close(linger=5000)
        ctx.destroy(linger=0)
