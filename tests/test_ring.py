"""The shared-memory ring between worker and sink: slots round-trip, the receiver trusts no
header, a full /dev/shm is an error up front, and a writer waits for a free slot."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch

from corecap.transport import ring, wire


@pytest.fixture
def pair(tmp_path):
    writer = ring.RingWriter(slot_bytes=256, num_slots=2, directory=str(tmp_path))
    reader = ring.RingReader()
    yield writer, reader
    reader.close()
    writer.close()


def _chunk(writer, slot: int, states: torch.Tensor, changes: dict | None = None) -> list:
    n = states.shape[1]
    writer.slot(slot, states.nbytes).view(states.dtype).view(states.shape).copy_(states)
    header = wire.Chunk(
        version=wire.WIRE_VERSION, rank=0, step=1, dtype="bfloat16", layers=(1, 2), hidden_size=states.shape[2],
        num_tokens=n, segments=(wire.Segment("r", n),), ring=writer.path, slot=slot, slot_bytes=writer.slot_bytes,
    )
    ids = np.arange(n, dtype=np.int32)
    header = wire.msgspec.structs.replace(header, crcs=wire.checksums(header.segments, ids, ids, states),
                                          **(changes or {}))
    return wire.encode_chunk(header, ids, ids, torch.empty(0, dtype=torch.uint8))


def test_states_round_trip_through_a_slot(pair):
    writer, reader = pair
    assert oct(os.stat(writer.path).st_mode & 0o777) == "0o600"
    states = torch.randn(2, 3, 16).bfloat16()  # 192 bytes: fits a 256-byte slot
    msg = wire.decode(_chunk(writer, 1, states), ring=reader)
    assert torch.equal(msg.states, states)
    assert not os.path.exists(writer.path)  # mapped on both sides, the name is gone
    other = torch.randn(2, 3, 16).bfloat16()
    msg2 = wire.decode(_chunk(writer, 0, other), ring=reader)  # the same mapping, another slot
    assert torch.equal(msg2.states, other) and torch.equal(msg.states, states)


@pytest.mark.parametrize("changes, message", [
    ({"slot": 2}, "does not fit ring"),
    ({"slot": -1}, "does not fit ring"),
    ({"slot_bytes": 128}, "does not fit ring"),  # 192 bytes of states in a 128-byte slot
    ({"ring": "/dev/shm/something-else"}, "is not a corecap ring"),
])
def test_bad_slot_headers_are_wire_errors(pair, changes, message):
    writer, reader = pair
    frames = _chunk(writer, 0, torch.randn(2, 3, 16).bfloat16(), changes)
    with pytest.raises(wire.WireError, match=message):
        wire.decode(frames, ring=reader)


def test_slot_states_need_a_ring_and_an_empty_frame(pair):
    writer, reader = pair
    frames = _chunk(writer, 0, torch.randn(2, 3, 16).bfloat16())
    with pytest.raises(wire.WireError, match="no ring reader"):
        wire.decode(frames)
    frames[3] = b"\x00" * 192
    with pytest.raises(wire.WireError, match="frame sizes"):
        wire.decode(frames, ring=reader)


def test_missing_ring_file_is_a_wire_error(tmp_path):
    with pytest.raises(wire.WireError, match="No such file"):
        wire.decode(_chunk_for_missing(tmp_path), ring=ring.RingReader())


def _chunk_for_missing(tmp_path) -> list:
    writer = ring.RingWriter(slot_bytes=256, num_slots=1, directory=str(tmp_path))
    frames = _chunk(writer, 0, torch.randn(2, 3, 16).bfloat16())
    writer.close()  # unlinks the file before any reader mapped it
    return frames


def test_full_shared_memory_is_refused_up_front(tmp_path, monkeypatch):
    def no_space(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", no_space)
    with pytest.raises(ring.RingUnavailable, match="cannot reserve"):
        ring.RingWriter(slot_bytes=1 << 20, num_slots=4, directory=str(tmp_path))
    assert os.listdir(tmp_path) == []


def test_writer_waits_for_a_free_slot(pair):
    writer, _ = pair
    held = {writer.acquire(), writer.acquire()}
    assert held == {0, 1}
    got = []
    t = threading.Thread(target=lambda: got.append(writer.acquire()), daemon=True)
    t.start()
    t.join(0.2)
    assert t.is_alive() and not got  # both slots are with the sink
    writer.release(1)
    t.join(60)  # liveness bound, not a benchmark
    assert got == [1]


def test_rings_of_dead_processes_are_removed(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f"{ring.PREFIX}{dead.stdout.strip()}-0badc0de"
    stale.write_bytes(b"x")
    alive = tmp_path / f"{ring.PREFIX}{os.getpid()}-00000000"  # ours: still in use
    alive.write_bytes(b"x")
    writer = ring.RingWriter(slot_bytes=64, num_slots=1, directory=str(tmp_path))
    try:
        assert not stale.exists() and alive.exists()
    finally:
        writer.close()
