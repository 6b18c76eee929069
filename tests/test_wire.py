"""The wire format: frames round-trip, and the decoder rejects anything malformed (fuzzed)."""

from __future__ import annotations

import msgspec
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from corecap import wire


def _chunk(num_tokens=5, layers=(2, 8), hidden=16, dtype=torch.bfloat16, version=wire.WIRE_VERSION):
    header = wire.Chunk(
        version=version, rank=0, step=1, dtype=wire.DTYPE_NAMES[dtype], layers=layers,
        hidden_size=hidden, num_tokens=num_tokens,
        segments=(wire.Segment("a", 2), wire.Segment("b", num_tokens - 2)),
    )
    ids = torch.arange(num_tokens, dtype=torch.int32)
    states = torch.randn(len(layers), num_tokens, hidden).to(dtype)
    return header, ids, states


def _frames(header, ids, states):
    return [bytes(f) for f in wire.encode_chunk(header, ids, ids, states)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip(dtype):
    header, ids, states = _chunk(dtype=dtype)
    msg = wire.decode(_frames(header, ids, states))
    assert msg.header == header
    assert msg.token_ids.tolist() == ids.tolist() and msg.positions.tolist() == ids.tolist()
    assert torch.equal(msg.states, states)


def test_worker_error_round_trip():
    err = wire.WorkerError(wire.WIRE_VERSION, 1, 123, "boom")
    assert wire.decode(wire.encode_error(err)) == err


def test_wrong_version_is_rejected():
    frames = _frames(*_chunk(version=wire.WIRE_VERSION + 1))
    with pytest.raises(wire.WireError, match="wire version"):
        wire.decode(frames)


def test_wrong_sizes_are_rejected():
    header, ids, states = _chunk()
    frames = _frames(header, ids, states)
    with pytest.raises(wire.WireError, match="frame sizes"):
        wire.decode(frames[:3] + [frames[3][:-2]])
    with pytest.raises(wire.WireError, match="expected 4"):
        wire.decode(frames[:3])
    bad = msgspec.structs.replace(header, hidden_size=8)
    with pytest.raises(wire.WireError, match="frame sizes"):
        wire.decode([msgspec.msgpack.encode(bad)] + frames[1:])
    bad = msgspec.structs.replace(header, segments=(wire.Segment("a", 1),))
    with pytest.raises(wire.WireError, match="do not cover"):
        wire.decode([msgspec.msgpack.encode(bad)] + frames[1:])
    bad = msgspec.structs.replace(header, dtype="int8")
    with pytest.raises(wire.WireError, match="dtype"):
        wire.decode([msgspec.msgpack.encode(bad)] + frames[1:])


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=64), min_size=0, max_size=5))
def test_garbage_is_rejected_not_decoded(frames):
    try:
        msg = wire.decode(frames)
    except wire.WireError:
        return
    # Whatever decodes must be internally consistent.
    if isinstance(msg, wire.DecodedChunk):
        h = msg.header
        assert msg.states.shape == (len(h.layers), h.num_tokens, h.hidden_size)
        assert len(msg.token_ids) == h.num_tokens == sum(s.num_tokens for s in h.segments)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_mutated_valid_message_never_decodes_wrongly(data):
    header, ids, states = _chunk()
    frames = [bytearray(f) for f in _frames(header, ids, states)]
    i = data.draw(st.integers(0, 3))
    if frames[i]:
        j = data.draw(st.integers(0, len(frames[i]) - 1))
        frames[i][j] ^= data.draw(st.integers(1, 255))
    if data.draw(st.booleans()):
        frames[i] = frames[i][: data.draw(st.integers(0, len(frames[i])))]
    try:
        msg = wire.decode([bytes(f) for f in frames])
    except wire.WireError:
        return
    assert isinstance(msg, (wire.DecodedChunk, wire.WorkerError))
    if isinstance(msg, wire.DecodedChunk):
        h = msg.header
        assert msg.states.numel() * msg.states.element_size() == len(frames[3])
        assert h.num_tokens == len(msg.token_ids)
