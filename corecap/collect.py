"""Driver side of the wire: receive worker chunks, reassemble samples, hand finished ones on.

A sample may arrive in several chunks across engine steps (chunked prefill) and a step's chunk
holds several samples. Nothing is taken on trust: every segment's positions must be a
contiguous run inside its sample and its token ids must equal the sample's own ids at those
positions, so a capture that would land under the wrong sample, or short, is an error, not a
stored sample. A sample is complete when every one of its positions has been received.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
import zmq

from corecap import CorecapError, wire


@dataclass
class _Pending:
    key: str
    token_ids: np.ndarray
    states: torch.Tensor | None = None
    covered: np.ndarray = field(default=None)  # bool [T]
    num_covered: int = 0


@dataclass
class ChunkTiming:
    step: int
    num_tokens: int
    nbytes: int
    t_copy: float  # worker: capture started
    t_ready: float  # worker: host copy done, sending
    t_recv: float  # driver: received
    t_done: float  # driver: reassembled


class Collector:
    """Owns the PULL socket (IPC, in a private 0700 directory) and a receiving thread."""

    def __init__(self, layers: tuple[int, ...], on_complete: Callable[[str, np.ndarray, torch.Tensor], None]):
        self.layers = layers
        self.on_complete = on_complete
        self.dir = tempfile.mkdtemp(prefix="corecap-")  # mode 0700: owner only
        self.ipc_path = os.path.join(self.dir, "capture.sock")
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.PULL)
        self.sock.setsockopt(zmq.RCVHWM, 4)
        self.sock.bind(f"ipc://{self.ipc_path}")
        self.pending: dict[str, _Pending] = {}
        self.lock = threading.Lock()
        self.error: BaseException | None = None
        self.num_chunks = 0
        self.timings: list[ChunkTiming] = []
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True, name="corecap-collector")
        self.thread.start()

    def expect(self, req_id: str, key: str, token_ids: np.ndarray) -> None:
        with self.lock:
            self.pending[req_id] = _Pending(key, token_ids, covered=np.zeros(len(token_ids), bool))

    def num_pending(self) -> int:
        with self.lock:
            return len(self.pending)

    def raise_if_failed(self) -> None:
        if self.error is not None:
            raise self.error

    def _loop(self) -> None:
        try:
            while not self.stopping.is_set():
                if not self.sock.poll(50):
                    continue
                frames = self.sock.recv_multipart(copy=False)
                t_recv = time.time()
                msg = wire.decode(frames)
                if isinstance(msg, wire.WorkerError):
                    raise CorecapError(f"worker rank {msg.rank} (pid {msg.pid}) failed: {msg.message.splitlines()[0]}")
                self._take(msg)
                self.num_chunks += 1
                h = msg.header
                self.timings.append(
                    ChunkTiming(h.step, h.num_tokens, msg.states.nbytes, h.t_copy, h.t_ready, t_recv, time.time())
                )
        except BaseException as e:  # handed to the main thread, which raises it
            self.error = e if isinstance(e, CorecapError) else CorecapError(f"capture receiver failed: {e!r}")

    def _take(self, msg: wire.DecodedChunk) -> None:
        h = msg.header
        if h.layers != self.layers:
            raise CorecapError(f"worker sent layers {h.layers}, expected {self.layers}")
        offset = 0
        for seg in h.segments:
            lo, hi = offset, offset + seg.num_tokens
            offset = hi
            with self.lock:
                p = self.pending.get(seg.req_id)
            if p is None:
                raise CorecapError(f"worker sent states for unknown request {seg.req_id!r}")
            positions = msg.positions[lo:hi]
            start = int(positions[0])
            if not np.array_equal(positions, np.arange(start, start + seg.num_tokens)) or start + seg.num_tokens > len(p.token_ids):
                raise CorecapError(
                    f"sample {p.key!r}: received positions {start}..{int(positions[-1])}, "
                    f"not a contiguous run inside its {len(p.token_ids)} tokens"
                )
            if not np.array_equal(msg.token_ids[lo:hi], p.token_ids[start : start + seg.num_tokens]):
                raise CorecapError(f"sample {p.key!r}: received token ids differ from the sample's at positions {start}..")
            if p.states is None:
                p.states = torch.empty((len(self.layers), len(p.token_ids), h.hidden_size), dtype=msg.states.dtype)
            p.states[:, start : start + seg.num_tokens] = msg.states[:, lo:hi]
            newly = seg.num_tokens - int(p.covered[start : start + seg.num_tokens].sum())
            p.covered[start : start + seg.num_tokens] = True
            p.num_covered += newly
            if p.num_covered == len(p.token_ids):
                with self.lock:
                    del self.pending[seg.req_id]
                self.on_complete(p.key, p.token_ids, p.states)

    def wait_idle(self, timeout: float, alive: Callable[[], str | None]) -> None:
        """Wait until every expected sample is complete; fail on timeout or a dead worker."""
        deadline = time.monotonic() + timeout
        while self.num_pending():
            self.raise_if_failed()
            problem = alive()
            if problem:
                raise CorecapError(problem)
            if time.monotonic() > deadline:
                with self.lock:
                    keys = [p.key for p in self.pending.values()][:5]
                raise CorecapError(f"timed out after {timeout:.0f}s waiting for hidden states of {keys}")
            time.sleep(0.01)
        self.raise_if_failed()

    def close(self) -> None:
        self.stopping.set()
        self.thread.join(timeout=5)
        self.sock.close(linger=0)
        self.ctx.term()
        try:
            os.unlink(self.ipc_path)
        except FileNotFoundError:
            pass
        os.rmdir(self.dir)
