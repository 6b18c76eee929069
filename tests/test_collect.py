"""The sink's reassembly (corecap/collect.py): chunks of engine steps → whole samples, and every
check that keeps states from landing under the wrong sample."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from corecap.errors import CorecapError
from corecap.transport import wire
from corecap.sink.collect import BufferPool, Collector

LAYERS = (1, 3, 5)
HIDDEN = 8


def _chunk(step: int, parts: list[tuple[str, np.ndarray, int]], states: torch.Tensor | None = None) -> wire.DecodedChunk:
    """A worker's chunk: `parts` are (request id, the sample's token ids, first position), each
    segment running to the end of the ids given; states are random unless given."""
    segments = tuple(wire.Segment(req, len(ids)) for req, ids, _ in parts)
    token_ids = np.concatenate([ids for _, ids, _ in parts]).astype(np.int32)
    positions = np.concatenate([np.arange(start, start + len(ids)) for _, ids, start in parts]).astype(np.int32)
    if states is None:
        states = torch.randn(len(LAYERS), len(token_ids), HIDDEN)
    header = wire.Chunk(wire.WIRE_VERSION, 0, step, "float32", LAYERS, HIDDEN, len(token_ids), segments,
                        crcs=wire.checksums(segments, token_ids, positions, states))
    return wire.DecodedChunk(header, token_ids, positions, states)


@pytest.mark.parametrize("copy_threads", [1, 3])
@pytest.mark.parametrize("pooled", [False, True])
def test_samples_split_across_chunks_are_reassembled_exactly(copy_threads, pooled):
    rng = np.random.default_rng(0)
    ids = {r: rng.integers(0, 100, n).astype(np.int32) for r, n in (("a", 10), ("b", 7), ("c", 5))}
    done = {}

    def on_complete(p):  # copies are finished by now: snapshot what the writer would encode
        done[p.key] = p.states.clone()

    c = Collector(LAYERS, on_complete, BufferPool(1 << 20) if pooled else None, copy_threads=copy_threads)
    for r in ids:
        c.expect(r, f"key-{r}", ids[r])
    # step 0: a[0:4], b[0:7] (b complete); step 1: a[4:10], c[0:2]; step 2: c[2:5]
    plan = [[("a", 0, 4), ("b", 0, 7)], [("a", 4, 10), ("c", 0, 2)], [("c", 2, 5)]]
    expected = {r: torch.empty(len(LAYERS), len(ids[r]), HIDDEN) for r in ids}
    completed_after = []
    for step, segs in enumerate(plan):
        msg = _chunk(step, [(r, ids[r][lo:hi], lo) for r, lo, hi in segs])
        offset = 0
        for r, lo, hi in segs:
            expected[r][:, lo:hi] = msg.states[:, offset : offset + hi - lo]
            offset += hi - lo
        c.take(msg, 0.0)
        completed_after.append(sorted(done))
    c.close()
    assert completed_after == [["key-b"], ["key-a", "key-b"], ["key-a", "key-b", "key-c"]]
    for r in ids:
        assert torch.equal(done[f"key-{r}"], expected[r]), r
    assert not c.pending and len(c.timings) == 3


def test_a_sample_is_handed_on_only_when_every_position_arrived():
    ids = np.arange(6, dtype=np.int32)
    done = []
    c = Collector(LAYERS, done.append)
    c.expect("a", "a", ids)
    c.take(_chunk(0, [("a", ids[:3], 0)]), 0.0)
    c.take(_chunk(1, [("a", ids[:3], 0)]), 0.0)  # the same positions again: still half
    assert not done
    c.take(_chunk(2, [("a", ids[3:], 3)]), 0.0)
    assert [p.key for p in done] == ["a"]


def _error(msg: wire.DecodedChunk, ids: np.ndarray) -> str:
    c = Collector(LAYERS, lambda p: None, copy_threads=2)
    c.expect("a", "key-a", ids)
    with pytest.raises(CorecapError) as e:
        c.take(msg, 0.0)
    c.close()
    return str(e.value)


def test_states_for_an_unknown_request_are_an_error():
    ids = np.arange(4, dtype=np.int32)
    assert "unknown request 'zzz'" in _error(_chunk(0, [("zzz", ids, 0)]), ids)


def test_token_ids_that_differ_from_the_sample_are_an_error():
    ids = np.arange(4, dtype=np.int32)
    assert "received token ids differ" in _error(_chunk(0, [("a", ids + 1, 0)]), ids)


def test_positions_outside_or_out_of_order_are_an_error():
    ids = np.arange(4, dtype=np.int32)
    assert "not a contiguous run inside its 4 tokens" in _error(_chunk(0, [("a", np.arange(2, 6, dtype=np.int32), 2)]), ids)
    msg = _chunk(0, [("a", ids, 0)])
    shuffled = wire.DecodedChunk(msg.header, msg.token_ids, msg.positions[[1, 0, 2, 3]], msg.states)
    assert "not a contiguous run" in _error(shuffled, ids)


def test_other_layers_than_expected_are_an_error():
    ids = np.arange(4, dtype=np.int32)
    msg = _chunk(0, [("a", ids, 0)])
    header = wire.Chunk(wire.WIRE_VERSION, 0, 0, "float32", (1, 3), HIDDEN, 4, msg.header.segments)
    assert "worker sent layers (1, 3), expected (1, 3, 5)" in _error(wire.DecodedChunk(header, msg.token_ids, msg.positions, msg.states), ids)


@pytest.mark.parametrize("copy_threads", [1, 3])
def test_a_damaged_states_run_is_an_error_not_a_sample(copy_threads):
    """The worker's CRC-32 of every (layer, segment) run is checked as the run is copied."""
    ids = {"a": np.arange(6, dtype=np.int32), "b": np.arange(3, dtype=np.int32)}
    msg = _chunk(0, [("a", ids["a"], 0), ("b", ids["b"], 0)])
    damaged = msg.states.clone()
    damaged[2, 7, 5] += 1.0  # the last layer, sample b's second token
    done = []
    c = Collector(LAYERS, done.append, copy_threads=copy_threads)
    for req, token_ids in ids.items():
        c.expect(req, req, token_ids)
    with pytest.raises(CorecapError, match=r"states of request 'b' \(layer 5, step 0\) arrived damaged"):
        c.take(wire.DecodedChunk(msg.header, msg.token_ids, msg.positions, damaged), 0.0)
    assert done == []  # nothing handed on to be stored
    c.close()
