"""The driver's handle on the sink process (corecap/sink/process.py): start it, tell it which
requests to expect, hear whether it is alive, what it delivered and how it ended."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import threading
import time
from collections.abc import Callable

import msgspec
import numpy as np
import zmq

from corecap import writer_lock as lock
from corecap.errors import CorecapError
from corecap.sink.budget import Released
from corecap.sink.deliver import DeliverSpec
from corecap.sink.mooncake import SpecCapture
from corecap.sink.messages import (
    Abort, BlockHash, Control, Delivered, Discard, Done, Drop, Expect, Failed, Finish, Forget, Generated, Hits, Kept,
    Status,
)
from corecap.sink.process import CAPTURE, CONTROL, STATUS, SinkSpec, main
from corecap.store.generated import Generation
from corecap.transport import wire


class Sink:
    """The driver's handle on the sink process."""

    def __init__(
        self, store: str, codec: str, nonfinite: str, num_threads: int, buffer_bytes: int, tcp_address: str = "",
        block_size: int = 0, commit_delay: float = 0.0, deliver: DeliverSpec | None = None, layers: tuple = (),
    ):
        """`tcp_address`: tcp://HOST:PORT where the sink also takes states, from the capturing
        worker of an engine whose last pipeline stage is on another node ('' : none).
        `block_size`: vLLM's block size when its prefix caching is on (0: off). `deliver`: each
        sample to the file its key names (corecap/sink/deliver.py), captured at `layers`; with a
        `store` too, each one delivered also committed there (corecap/sink/store_copy.py)."""
        self.dir = wire.private_ipc_dir("corecap-")  # mode 0700: owner only
        self.capture_path = os.path.join(self.dir, CAPTURE)
        self.tcp_address = tcp_address
        self.ctx = zmq.Context()
        self.control = self.ctx.socket(zmq.PUSH)
        self.control.bind(f"ipc://{os.path.join(self.dir, CONTROL)}")
        self.status = self.ctx.socket(zmq.PULL)
        self.status.bind(f"ipc://{os.path.join(self.dir, STATUS)}")
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(Status)
        self.released = Released()
        spec = SinkSpec(store=store, ipc_dir=self.dir, codec=codec, nonfinite=nonfinite, num_threads=num_threads,
                        buffer_bytes=buffer_bytes, parent_pid=os.getpid(), tcp_address=tcp_address,
                        block_size=block_size, released=self.released, commit_delay=commit_delay, deliver=deliver,
                        layers=tuple(layers), parent_holds_lock=lock.holds(store))
        self.proc = multiprocessing.get_context("spawn").Process(target=main, args=(spec,), name="corecap-sink",
                                                                 daemon=True)
        self.proc.start()
        self.result: Done | Failed | None = None
        self.delivered: list[Delivered] = []  # reported, not yet taken
        self.kept: Kept | None = None  # delivering with a store: the copy's latest report
        self._watching = threading.Event()

    def watch(self, on_death: Callable[[str], None]) -> None:
        """Call `on_death(why)` from a watchdog thread if the sink dies while watched: the workers
        would then block on their sends, and the step loop inside an engine step, forever."""
        self._watching.set()

        def watchdog() -> None:
            while self._watching.is_set():
                if not self.proc.is_alive():
                    if self._watching.is_set():
                        on_death(self.failure())
                    return
                time.sleep(0.2)

        threading.Thread(target=watchdog, daemon=True, name="corecap-sink-watchdog").start()

    def unwatch(self) -> None:
        self._watching.clear()

    def failure(self) -> str:
        """Why the sink is gone: its own one-line report, or its exit code."""
        if self.result is None and self.status.poll(1000):
            self._receive()
        if isinstance(self.result, Failed):
            return self.result.message
        return f"the sink process (pid {self.proc.pid}) died (exit code {self.proc.exitcode})"

    def expect(
        self, req_id: str, key: str, token_ids: np.ndarray, loss_mask: np.ndarray | None, block_hashes=None,
        max_new: int = 0, reserved: int = 0, spec_capture: SpecCapture | None = None, lossless: bool = False,
        store_key: str = "", media=None,
    ) -> None:
        """`reserved`: the bytes of --buffer-gb the driver holds for the sample, which the sink
        adds to `released` once the sample is committed (corecap/sink/budget.py). `spec_capture`:
        a delivering sink writes the sample in SpecForge's layout (corecap/sink/mooncake.py). `lossless`:
        to a file in the stored dtype, whatever the server's backend (ModelOpt's reader: corecap/serve/nixl.py).
        `store_key`: once delivered, also committed to the store under this key ("": not)."""
        mask = None if loss_mask is None else np.asarray(loss_mask, np.uint8).tobytes()
        self._send(Expect(req_id=req_id, key=key, token_ids=np.asarray(token_ids, "<i4").tobytes(), loss_mask=mask,
                          block_hashes=block_hashes, max_new=max_new, reserved=reserved, spec_capture=spec_capture,
                          lossless=lossless, store_key=store_key, media=media))

    def generated(self, req_id: str, token_ids: list[int], generation: Generation) -> None:
        self._send(Generated(req_id, np.asarray(token_ids, "<i4").tobytes(), generation))

    def forget(self, req_id: str, until: int = 0) -> None:
        """Drop a request's sample (aborted): its buffer and its reservation go back, and no
        file is written for it; its states still on their way are dropped as they come. `until`:
        with prefix caching on, the positions its scheduled steps compute, whose states the sink
        still takes for the blocks they complete (`Engine.abort`)."""
        self._send(Forget(req_id, until))

    def discard(self, keys: list[str]) -> None:
        """Remove these objects from the Mooncake store: written, and nobody will read them."""
        self._send(Discard(keys))

    def prefix(self, actions) -> None:
        """The driver's prefix-cache decisions, in order: ("hits", req_id, num_blocks),
        ("drop", block_hash, count) and ("hash", req_id, index, block_hash) (corecap/_vllm/prefix_tracker.py)."""
        for kind, *args in actions:
            self._send(Hits(*args) if kind == "hits" else Drop(*args) if kind == "drop" else BlockHash(*args))

    def check(self) -> None:
        """Raise if the sink failed or died (cheap; call once per step)."""
        while self.result is None and self.status.poll(0):
            self._receive()
        if isinstance(self.result, Failed):
            raise CorecapError(self.result.message)
        if self.result is None and not self.proc.is_alive():
            raise CorecapError(f"the sink process (pid {self.proc.pid}) died (exit code {self.proc.exitcode})")

    def _receive(self) -> None:  # a file delivered, the store copy's news, or the sink's final status
        msg = self.decoder.decode(self.status.recv())
        if isinstance(msg, Delivered):
            self.delivered.append(msg)
        elif isinstance(msg, Kept):
            self.kept = msg
        else:
            self.result = msg

    def take_delivered(self) -> list[Delivered]:  # the files written since the last call
        delivered, self.delivered = self.delivered, []
        return delivered

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
        wait forever, inside C, where nothing can interrupt the step loop."""
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
                self._receive()
                continue
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
