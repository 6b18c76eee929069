"""The wire format: frames round-trip, and the decoder rejects anything malformed (fuzzed)."""

from __future__ import annotations

import msgspec
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from corecap.transport import wire
from support import fuzz


def _chunk(num_tokens=5, layers=(2, 8), hidden=16, dtype=torch.bfloat16, version=wire.WIRE_VERSION, decode=False):
    """Two segments (a prefill chunk: a CRC a run), or with `decode` a one-token segment for each
    of `num_tokens` requests (a CRC a layer)."""
    segments = (wire.Segment("a", 2), wire.Segment("b", num_tokens - 2))
    if decode:
        segments = tuple(wire.Segment(f"r{k}", 1) for k in range(num_tokens))
    header = wire.Chunk(
        version=version, rank=0, step=1, dtype=wire.DTYPE_NAMES[dtype], layers=layers,
        hidden_size=hidden, num_tokens=num_tokens, segments=segments,
    )
    ids = torch.arange(num_tokens, dtype=torch.int32)
    # Seeded: hypothesis replays a failing example, which must see the same bytes.
    states = torch.randn(len(layers), num_tokens, hidden, generator=torch.Generator().manual_seed(num_tokens)).to(dtype)
    header = msgspec.structs.replace(header, crcs=wire.checksums(header.segments, ids, ids, states))
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


def test_fp8_rows_round_trip_and_their_size_is_checked():
    """--store-dtype fp8: the states are the worker's rows, H + 4 bytes each; `dtype` is what
    was captured. A frame sized for the captured dtype instead is refused."""
    from corecap.store.fp8rows import quantize_fp8_rows

    header, ids, states = _chunk(dtype=torch.bfloat16)
    rows = quantize_fp8_rows(list(states), states.shape[1])
    header = msgspec.structs.replace(header, fp8=True, crcs=wire.checksums(header.segments, ids, ids, rows))
    msg = wire.decode(_frames(header, ids, rows), check_states=True)
    assert msg.header.dtype == "bfloat16" and msg.states.dtype == torch.uint8 and torch.equal(msg.states, rows)
    with pytest.raises(wire.WireError, match="frame sizes"):
        wire.decode(_frames(header, ids, states))


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
        wire.decode([wire.encode_header(bad)] + frames[1:])
    bad = msgspec.structs.replace(header, segments=(wire.Segment("a", 1),))
    with pytest.raises(wire.WireError, match="do not cover"):
        wire.decode([wire.encode_header(bad)] + frames[1:])
    bad = msgspec.structs.replace(header, dtype="int8")
    with pytest.raises(wire.WireError, match="dtype"):
        wire.decode([wire.encode_header(bad)] + frames[1:])


@settings(max_examples=fuzz.examples(300), deadline=None)
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


@settings(max_examples=fuzz.examples(300), deadline=None)
@given(st.data())
def test_any_flipped_byte_is_caught(data):
    """A byte flipped anywhere in a valid message (header, ids, positions, states), with or
    without the frame cut short after it, is a WireError: never decoded; for a prefill chunk (a
    CRC a run) and a decode step's (a CRC a layer) alike."""
    decode = data.draw(st.booleans())
    header, ids, states = _chunk(num_tokens=wire.PER_LAYER_SEGMENTS + 3 if decode else 5, decode=decode)
    assert len(header.crcs) == 2 + len(header.layers) * (1 if decode else len(header.segments))
    sent = _frames(header, ids, states)
    frames = [bytearray(f) for f in sent]
    i = data.draw(st.integers(0, 3))
    j = data.draw(st.integers(0, len(frames[i]) - 1))
    frames[i][j] ^= data.draw(st.integers(1, 255))
    if data.draw(st.booleans()):
        frames[i] = frames[i][: data.draw(st.integers(0, len(frames[i])))]
    with pytest.raises(wire.WireError):
        wire.decode([bytes(f) for f in frames], check_states=True)
    assert torch.equal(wire.decode(sent, check_states=True).states, states)  # the message as sent decodes


def test_a_flipped_states_byte_is_caught_where_the_run_is_copied():
    """The sink checks each states run as it copies it into its sample (corecap/sink/collect.py):
    decode without check_states, then check the run, as the collector does."""
    header, ids, states = _chunk()
    frames = _frames(header, ids, states)
    damaged = bytearray(frames[3])
    damaged[len(damaged) - 3] ^= 0x40  # the last layer's second segment
    msg = wire.decode(frames[:3] + [bytes(damaged)])
    runs = list(wire.state_runs(header.segments, len(header.layers), header.num_tokens))
    flat = msg.states.view(-1, header.hidden_size)
    for i, j, lo, hi in runs[:-1]:
        msg.check_run(i, j, flat[lo:hi])
    i, j, lo, hi = runs[-1]
    with pytest.raises(wire.WireError, match=r"states of request 'b' \(layer 8, step 1\) arrived damaged"):
        msg.check_run(i, j, flat[lo:hi])
