"""The sender inside the capturing worker (corecap/_vllm/worker.py): copies each step's states to
the host off the compute stream, into a slot of the shared-memory ring where one can be had, and
pushes one `wire.Chunk` per step to the sink, with the CRC-32s of what it carries."""

from __future__ import annotations

import atexit
import os
import queue
import threading
import time
from typing import NamedTuple

import msgspec
import torch
import zmq

from corecap.transport import ring, wire

MAX_IN_FLIGHT = 3  # steps the compute thread may be ahead of the sender
# Shared-memory slots, each one step's states at most: one more than the steps in flight, so
# that the sink always has one to read.
_RING_SLOTS = MAX_IN_FLIGHT + 1


_EMPTY = torch.empty(0, dtype=torch.uint8)


class _Step(NamedTuple):
    """A step's chunk on its way from the compute thread to the send thread."""

    header: wire.Chunk
    host: list  # token ids, positions, states (empty when they are in a ring slot): the message's frames
    states: torch.Tensor  # the states on the host, in the message or the slot, for their checksums
    event: object  # torch.cuda.Event the copy to the host completes at, or None (already there)


class Sender:
    """Copies device tensors to host off the compute stream and pushes them to the driver."""

    def __init__(self, ipc_path: str, rank: int, slot_bytes: int = 0, use_ring: bool = True):
        """`ipc_path`: the sink's capture socket on the same host, or a `tcp://` address of it on
        another node (multi-node: no shared memory there, the states go in the messages)."""
        self.rank = rank
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.PUSH)
        self.sock.setsockopt(zmq.SNDHWM, MAX_IN_FLIGHT)
        self.sock.setsockopt(zmq.LINGER, 10_000)
        remote = ipc_path.startswith("tcp://")
        self.sock.connect(ipc_path if remote else f"ipc://{ipc_path}")
        self.queue: queue.Queue = queue.Queue(maxsize=MAX_IN_FLIGHT)
        self.copy_stream = None
        self.lock = threading.Lock()
        self.ring = None
        self.ring_wait_s = 0.0  # time spent waiting for the sink to free a slot
        self.ring_status = "off (RunConfig.ring=False)" if not use_ring else "off (no slot size)"
        if remote:
            self.ring_status = f"off: the sink is on another node ({ipc_path})"
        elif use_ring and slot_bytes > 0:
            try:
                self.ring = ring.RingWriter(slot_bytes, _RING_SLOTS, cuda=torch.cuda.is_available())
            except ring.RingUnavailable as e:
                self.ring_status = f"off: {e}"  # states go through the socket
            else:
                size = f"{slot_bytes / 2**20:.0f} MiB" if slot_bytes >= 2**20 else f"{slot_bytes / 2**10:.0f} KiB"
                self.ring_status = f"{_RING_SLOTS} slots of {size} in {self.ring.path}"
                atexit.register(self.ring.unlink)
                free = self.ctx.socket(zmq.PULL)
                free.setsockopt(zmq.LINGER, 0)
                free.bind(f"ipc://{os.path.join(os.path.dirname(ipc_path), ring.free_socket(self.ring.path))}")
                threading.Thread(target=self._free_loop, args=(free,), daemon=True, name="corecap-ring").start()
        threading.Thread(target=self._loop, daemon=True, name="corecap-sender").start()

    def _free_loop(self, sock) -> None:
        try:
            while True:
                self.ring.release(int.from_bytes(sock.recv(), "little"))
        except zmq.ContextTerminated:  # the worker is exiting
            sock.close(linger=0)

    def submit(self, header: wire.Chunk, ids, pos, states, ready) -> None:
        header = msgspec.structs.replace(header, t_copy=time.time())
        target = None
        if self.ring is not None and states.nbytes <= self.ring.slot_bytes:
            t = time.perf_counter()
            slot = self.ring.acquire()
            self.ring_wait_s += time.perf_counter() - t
            target = self.ring.slot(slot, states.nbytes).view(states.dtype).view(states.shape)
            header = msgspec.structs.replace(header, ring=self.ring.path, slot=slot, slot_bytes=self.ring.slot_bytes)
        if states.device.type == "cuda":
            if self.copy_stream is None:
                self.copy_stream = torch.cuda.Stream(device=states.device)
            self.copy_stream.wait_event(ready)  # recorded by `_capture` after the states were stacked
            with torch.cuda.stream(self.copy_stream):
                host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in (ids, pos)]
                host.append(torch.empty(states.shape, dtype=states.dtype, pin_memory=True) if target is None
                            else target)
                for h, t in zip(host, (ids, pos, states)):
                    h.copy_(t, non_blocking=True)
                    t.record_stream(self.copy_stream)
                event = torch.cuda.Event()
                event.record(self.copy_stream)
        else:
            if target is not None:
                target.copy_(states)
            host, event = [ids, pos, states if target is None else target], None
        states_on_host = host[2]
        if target is not None:
            host[2] = _EMPTY  # the states are in the slot, not in the message
        self.queue.put(_Step(header, host, states_on_host, event))

    def _loop(self) -> None:
        while True:
            header, host, states, event = self.queue.get()
            if event is not None:
                event.synchronize()
            crcs = wire.checksums(header.segments, host[0], host[1], states)
            header = msgspec.structs.replace(header, t_ready=time.time(), crcs=crcs)
            with self.lock:
                self.sock.send_multipart(wire.encode_chunk(header, *host), copy=False)

    def fail(self, message: str) -> None:
        error = wire.WorkerError(wire.WIRE_VERSION, self.rank, os.getpid(), message)
        with self.lock:
            self.sock.send_multipart(wire.encode_error(error))
