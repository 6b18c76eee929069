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


def _chunk(step: int, parts: list[tuple[str, np.ndarray, int]],
           states: torch.Tensor | None = None) -> wire.DecodedChunk:
    """A worker's chunk: `parts` are (request id, the sample's token ids, first position), each
    segment running to the end of the ids given; states are random unless given."""
    segments = tuple(wire.Segment(req, len(ids)) for req, ids, _ in parts)
    token_ids = np.concatenate([ids for _, ids, _ in parts]).astype(np.int32)
    positions = np.concatenate([np.arange(start, start + len(ids)) for _, ids, start in parts]).astype(np.int32)
    if states is None:
        states = torch.randn(len(LAYERS), len(token_ids), HIDDEN)
    header = wire.Chunk(
        version=wire.WIRE_VERSION, rank=0, step=step, dtype="float32", layers=LAYERS, hidden_size=HIDDEN,
        num_tokens=len(token_ids), segments=segments, crcs=wire.checksums(segments, token_ids, positions, states),
    )
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
    assert len(c.timings) == len(plan)  # one per chunk, for the run's trace
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
    assert "not a contiguous run inside its 4 tokens" in _error(
        _chunk(0, [("a", np.arange(2, 6, dtype=np.int32), 2)]), ids
    )
    msg = _chunk(0, [("a", ids, 0)])
    shuffled = wire.DecodedChunk(msg.header, msg.token_ids, msg.positions[[1, 0, 2, 3]], msg.states)
    assert "not a contiguous run" in _error(shuffled, ids)


def test_other_layers_than_expected_are_an_error():
    ids = np.arange(4, dtype=np.int32)
    msg = _chunk(0, [("a", ids, 0)])
    header = wire.Chunk(
        version=wire.WIRE_VERSION, rank=0, step=0, dtype="float32", layers=(1, 3), hidden_size=HIDDEN, num_tokens=4,
        segments=msg.header.segments,
    )
    assert "worker sent layers (1, 3), expected (1, 3, 5)" in _error(
        wire.DecodedChunk(header, msg.token_ids, msg.positions, msg.states), ids
    )


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


# --- prefix caching: samples completed from the states cache (corecap/sink/prefix_cache.py) -------------

BS = 4  # block size


def _hashes(ids: np.ndarray) -> list[bytes]:
    """vLLM's block hashes stand-in: each full block's hash is the whole prefix up to its end."""
    return [bytes(ids[: (i + 1) * BS].tobytes()) for i in range(len(ids) // BS)]


def _ids(rng: np.random.Generator, n: int, after: np.ndarray | None = None) -> np.ndarray:
    """n random token ids, after a prefix that another sample has (whose blocks a hit takes)."""
    new = rng.integers(0, 100, n).astype(np.int32)
    return new if after is None else np.concatenate([after, new])


def _expect(col: Collector, samples: dict[str, np.ndarray]) -> None:
    """Each sample expected under its request id (its key too), with its blocks' hashes."""
    for r, ids in samples.items():
        col.expect(r, r, ids, block_hashes=_hashes(ids))


def test_a_collector_untimed_keeps_nothing_per_chunk():
    """A server's collector (`timed=False`) runs for as long as the server: it keeps no record
    per chunk, where a run's keeps one each for its trace."""
    ids = np.arange(6, dtype=np.int32)
    c = Collector(LAYERS, lambda p: None, timed=False)
    for step in range(3):
        c.expect(f"r{step}", f"key-{step}", ids)
        c.take(_chunk(step, [(f"r{step}", ids, 0)]), 0.0)
    c.close()
    assert c.timings == []


def _prefix_collector(done: dict) -> Collector:
    return Collector(LAYERS, lambda p: done.__setitem__(p.key, p.states.clone()), block_size=BS)


def test_cached_blocks_come_from_the_block_that_produced_them():
    """a computes 3 full blocks + 2; c hits a's first block in the same step that a computes it
    (so it waits for it); b shares a's first 2 blocks and hits them in a later step, after its
    own tail has arrived."""
    rng = np.random.default_rng(1)
    a = _ids(rng, 14)
    b = _ids(rng, 5, a[:8])
    c = _ids(rng, 3, a[:4])
    done = {}
    col = _prefix_collector(done)
    _expect(col, {"a": a, "b": b, "c": c})
    col.hits("c", 1)  # a's first block is in the same step, not here yet: c waits
    step0 = _chunk(0, [("a", a, 0), ("c", c[4:], 4)])
    col.take(step0, 0.0)
    assert sorted(done) == ["a", "c"]
    assert torch.equal(done["c"][:, :4], step0.states[:, :4]) and torch.equal(done["c"][:, 4:], step0.states[:, 14:])
    step1 = _chunk(1, [("b", b[8:], 8)])
    col.take(step1, 0.0)  # b's own tail: 2 blocks still missing
    assert "b" not in done
    col.hits("b", 2)
    # b refers to a for [0, 8) (a was handed on): those positions are a's to store, so b's
    # writer encodes only its tail and the sink never copies a's cached blocks into b
    assert torch.equal(done["b"][:, 8:], step1.states)
    assert col.cache.num_blocks == 3 + 1  # a's 3 and b's third (c's tail is not a full block)
    assert all(e.states is None for e in col.cache.entries.values())  # a and b were handed on: no views kept


def test_a_drop_that_overtakes_its_chunks_neither_leaks_nor_loses_a_live_block():
    """The driver's drop can reach the sink before the chunks whose productions it counts, and a
    block produced again after a drop must be kept."""
    from corecap.sink.prefix_cache import Producer, StatesCache

    cache, block = StatesCache(), torch.ones(2, BS, 3)
    first, second = Producer("x", 8), Producer("y", 8)
    cache.drop(b"h", 2)  # counted 2 productions, none arrived yet
    assert cache.produce(b"h", block, first) == [] and cache.get(b"h") is None
    cache.wait(b"h", ("r", 0))  # a hit on the dropped generation's block, still to come
    assert cache.produce(b"h", block, first) == [("r", 0)] and cache.get(b"h") is None
    assert not cache.entries and not first.entries  # nothing left behind
    cache.produce(b"h", block, first)  # produced again, after the drop: kept
    cache.produce(b"h", 2 * block, second)  # a duplicate production keeps the first producer
    producer, states = cache.get(b"h")
    assert producer is first and states is block and not second.entries
    cache.drop(b"h", 1)  # only one of the two counted: the other is live
    assert cache.get(b"h")[0] is first
    cache.release(first)  # handed to the writer: its buffer is no longer read, the block is still known
    assert cache.get(b"h") == (first, None) and not first.entries
    cache.drop(b"h", 1)
    assert cache.get(b"h") is None and not cache.entries


def test_a_hit_the_sink_cannot_place_is_an_error():
    col = _prefix_collector({})
    col.expect("a", "a", np.arange(6, dtype=np.int32), block_hashes=[b"x"])
    with pytest.raises(CorecapError, match="2 cached blocks for request 'a'"):
        col.hits("a", 2)
    with pytest.raises(CorecapError, match="request 'zz'"):
        col.hits("zz", 1)


def test_completed_blocks_are_those_whose_last_position_was_computed():
    from corecap.transport.prefix_blocks import completed_blocks

    assert list(completed_blocks(0, 14, 4, 3)) == [0, 1, 2]
    assert list(completed_blocks(8, 13, 4, 3)) == [2]  # positions 8..12: block 2 ends at 11
    assert list(completed_blocks(9, 11, 4, 3)) == []  # block 2 not finished
    assert list(completed_blocks(5, 12, 4, 2)) == [1]  # only full blocks of the prompt are hashed


def test_a_sample_refers_to_the_producer_of_its_last_hit_block_once_that_was_handed_on():
    """Stored once: b hits a's two blocks after a was handed to the writer, so b refers to a for
    [0, 8); c hits a block of b's and refers through b to a (flattened: never to b's reference);
    d hits a block whose producer e is not complete yet: d stores every position itself."""
    rng = np.random.default_rng(2)
    a = _ids(rng, 10)
    b = _ids(rng, 6, a[:8])
    c = _ids(rng, 2, b[:12])
    e = _ids(rng, 12)
    d = _ids(rng, 3, e[:4])
    handed = []
    states = {}
    col = Collector(LAYERS,
                    lambda p: handed.append((p.key, p.producer.prefix)) or states.__setitem__(p.key, p.states.clone()),
                    block_size=BS)
    _expect(col, {"a": a, "b": b, "c": c, "d": d, "e": e})
    step0 = _chunk(0, [("a", a, 0), ("e", e[:6], 0)])  # e: chunked, 6 of 12
    col.take(step0, 0.0)
    col.hits("b", 2)
    col.take(_chunk(1, [("b", b[8:], 8)]), 0.0)
    col.hits("c", 3)
    col.hits("d", 1)
    col.take(_chunk(2, [("c", c[12:], 12), ("d", d[4:], 4)]), 0.0)
    col.take(_chunk(3, [("e", e[6:], 6)]), 0.0)
    from corecap.store.format import Segment

    assert handed == [
        ("a", ()), ("b", (Segment("a", 0, 8),)), ("c", (Segment("a", 0, 8), Segment("b", 8, 12))), ("d", ()), ("e", ()),
    ]
    assert (col.num_referring, col.num_referred_tokens, col.num_stored_whole) == (2, 20, 1)
    assert torch.equal(states["d"][:, :4], step0.states[:, 10:14])  # stored whole: e's cached block copied in


def test_hits_refer_up_to_the_last_block_handed_on_and_copy_the_rest_from_a_pending_producer():
    """e hits a's first block and computes two of its own (chunked: e is still pending); a is
    handed on and its buffer reused (as the writer's pool does). d hits a's block and e's two:
    it refers to a for [0, 4) and copies e's blocks from e's buffer, never a's reused one."""
    rng = np.random.default_rng(3)
    a = _ids(rng, 6)
    e = _ids(rng, 10, a[:4])
    d = _ids(rng, 2, e[:12])
    handed, states = [], {}

    def on_complete(p):
        handed.append((p.key, p.producer.prefix))
        states[p.key] = p.states.clone()
        p.states.fill_(float("nan"))  # reused for another sample once written

    col = Collector(LAYERS, on_complete, block_size=BS)
    _expect(col, {"a": a, "e": e, "d": d})
    step0 = _chunk(0, [("a", a, 0)])
    col.take(step0, 0.0)
    col.hits("e", 1)
    step1 = _chunk(1, [("e", e[4:12], 4)])  # e's blocks 1 and 2; 2 of its positions to come
    col.take(step1, 0.0)
    col.hits("d", 3)
    col.take(_chunk(2, [("d", d[12:], 12)]), 0.0)
    col.take(_chunk(3, [("e", e[12:], 12)]), 0.0)
    from corecap.store.format import Segment

    assert handed == [("a", ()), ("d", (Segment("a", 0, 4),)), ("e", (Segment("a", 0, 4),))]
    assert torch.equal(states["d"][:, 4:12], step1.states)  # e's blocks, from e's buffer
    assert (col.num_referring, col.num_referred_tokens, col.num_stored_whole) == (2, 8, 0)


# --- prefix caching while serving: samples delivered whole, blocks copied (corecap serve) ---------


class _Serving:
    """A delivering sink's collector (corecap/sink/process.py with `deliver`): each sample
    snapshotted as its file would be written, then its buffer given back to the pool, reused and
    overwritten (NaN) by the next sample that takes it."""

    def __init__(self, samples: dict[str, np.ndarray], pool_bytes: int = 1 << 20):
        self.pool = BufferPool(pool_bytes)
        self.delivered: dict[str, torch.Tensor] = {}
        self.forgotten: list[str] = []
        self.col = Collector(LAYERS, self._deliver, self.pool, block_size=BS, whole=True,
                             on_forgotten=self._forget)
        _expect(self.col, samples)

    def take(self, step: int, parts: list[tuple[str, np.ndarray, int]]) -> wire.DecodedChunk:
        """The chunk of `parts` (as `_chunk`), taken; returned for its states."""
        chunk = _chunk(step, parts)
        self.col.take(chunk, 0.0)
        return chunk

    def _deliver(self, p):
        assert p.producer.prefix == ()  # whole: never by reference
        self.delivered[p.key] = p.stored_states().clone()
        p.states.fill_(float("nan"))
        self.pool.give(p.states)

    def _forget(self, p):
        self.forgotten.append(p.key)
        if p.states is not None:
            p.states.fill_(float("nan"))
            self.pool.give(p.states)


BLOCK_BYTES = len(LAYERS) * BS * HIDDEN * 4


def test_serving_a_hit_after_its_producer_was_delivered_comes_from_the_caches_copy():
    """a is delivered and its buffer reused; b then hits a's two blocks: b's file holds a's states
    there, from the copies the cache made when a left (counted in the pool), and its own after."""
    rng = np.random.default_rng(5)
    a = _ids(rng, 10)
    b = _ids(rng, 3, a[:8])
    s = _Serving({"a": a, "b": b})
    step0 = s.take(0, [("a", a, 0)])
    assert list(s.delivered) == ["a"] and s.pool.held_bytes == 2 * BLOCK_BYTES == s.col.cache.copies.num_bytes
    s.col.hits("b", 2)
    step1 = s.take(1, [("b", b[8:], 8)])
    assert torch.equal(s.delivered["b"][:, :8], step0.states[:, :8]) and torch.equal(s.delivered["b"][:, 8:],
                                                                                       step1.states)
    assert torch.equal(s.delivered["a"], step0.states) and s.col.cache.num_blocks == 2  # a's (b computed no full block)
    s.col.drop(_hashes(a)[0], 1)  # the driver's bound: one production counted (a hit is none)
    assert s.pool.held_bytes == BLOCK_BYTES and s.col.cache.num_blocks == 1
    s.col.drop(_hashes(a)[1], 1)
    assert s.pool.held_bytes == 0 == s.col.cache.copies.num_bytes and not s.col.cache.entries


def test_serving_a_hit_on_a_pending_producer_is_copied_at_once_not_held():
    """d hits e's block while e is still being computed (chunked); e is delivered, and its buffer
    reused, before d completes: d holds e's states, copied when the hit was placed."""
    rng = np.random.default_rng(6)
    e = _ids(rng, 12)
    d = _ids(rng, 3, e[:4])
    s = _Serving({"e": e, "d": d})
    step0 = s.take(0, [("e", e[:6], 0)])
    s.col.hits("d", 1)
    assert not s.col.pending["d"].held and s.pool.held_bytes == 0  # copied into d, no copy of the cache's yet
    s.take(1, [("e", e[6:], 6)])  # e delivered, its buffer reused
    assert "e" in s.delivered and s.pool.held_bytes == 3 * BLOCK_BYTES  # e's blocks copied as it left
    s.take(2, [("d", d[4:], 4)])
    assert torch.equal(s.delivered["d"][:, :4], step0.states[:, :4])


def test_serving_a_hit_waits_for_its_producers_chunk_in_the_same_step():
    rng = np.random.default_rng(7)
    a = _ids(rng, 9)
    c = _ids(rng, 2, a[:8])
    s = _Serving({"a": a, "c": c})
    s.col.hits("c", 2)  # a computes both blocks in this very step
    step0 = s.take(0, [("a", a, 0), ("c", c[8:], 8)])
    assert sorted(s.delivered) == ["a", "c"]
    assert torch.equal(s.delivered["c"][:, :8], step0.states[:, :8])
    assert torch.equal(s.delivered["c"][:, 8:], step0.states[:, 9:])


def test_an_aborted_sample_is_kept_until_the_states_of_its_scheduled_steps_are_in():
    """a's request is aborted while a step computing its positions 6..11 is in flight (the driver
    says: 12 positions scheduled). b hits a's blocks 0..2: it waits for that step's chunk, which
    still produces a's blocks 1 and 2; a is then dropped, never delivered, its blocks kept as
    copies; its later states (none should come) are skipped. Aborted with nothing in flight, a
    sample goes at once."""
    rng = np.random.default_rng(8)
    a = _ids(rng, 14)
    b = _ids(rng, 2, a[:12])
    s = _Serving({"a": a, "b": b})
    step0 = s.take(0, [("a", a[:6], 0)])
    s.col.hits("b", 3)  # block 0 is here; 1 and 2 are in a's step still in flight
    s.col.forget("a", 12)
    assert "a" in s.col.pending and not s.forgotten
    step1 = s.take(1, [("a", a[6:12], 6), ("b", b[12:], 12)])
    assert s.forgotten == ["a"] and "a" not in s.delivered and list(s.delivered) == ["b"]
    assert torch.equal(s.delivered["b"][:, :6], step0.states) and torch.equal(s.delivered["b"][:, 6:], step1.states)
    assert s.col.cache.num_blocks == 3 and s.pool.held_bytes == 3 * BLOCK_BYTES  # a's, copied as it went
    s.take(2, [("a", a[12:], 12)])  # skipped
    assert not s.col.pending
    _expect(s.col, {"c": a[:5], "d": a[:6]})
    s.col.forget("c", 0)  # never scheduled
    s.take(3, [("d", a[:3], 0)])
    s.col.forget("d", 3)  # everything scheduled is here
    assert s.forgotten == ["a", "c", "d"] and not s.col.pending and s.pool.lent_bytes == 0


def test_without_prefix_caching_an_aborted_sample_goes_at_once():
    forgotten = []
    col = Collector(LAYERS, lambda p: None, whole=True, on_forgotten=lambda p: forgotten.append(p.key))
    col.expect("a", "a", np.arange(8, dtype=np.int32))
    col.take(_chunk(0, [("a", np.arange(4, dtype=np.int32), 0)]), 0.0)
    col.forget("a", 8)
    assert forgotten == ["a"] and not col.pending
    col.take(_chunk(1, [("a", np.arange(4, 8, dtype=np.int32), 4)]), 0.0)  # skipped


def test_an_aborted_requests_id_goes_once_no_states_of_it_can_come():
    """Each abort leaves its request's id behind, so that the states of its steps still in flight
    are skipped, not refused; once past both bounds (sink/aborted.py) the id goes: a server's
    aborts do not grow the sink for as long as it runs."""
    from corecap.sink.aborted import KEEP_CHUNKS, KEEP_S

    now = [0.0]
    col = Collector(LAYERS, lambda p: None, whole=True)
    col.forgotten.clock = lambda: now[0]
    ids = np.arange(4, dtype=np.int32)
    live = iter(range(10**6))

    def steps(n: int) -> None:  # n chunks of other requests, each delivered
        for _ in range(n):
            r = f"live{next(live)}"
            col.expect(r, r, ids)
            col.take(_chunk(0, [(r, ids, 0)]), 0.0)

    for k in range(1000):
        col.expect(f"r{k}", f"r{k}", ids)
        col.forget(f"r{k}")
    col.take(_chunk(0, [("r999", ids[:2], 0)]), 0.0)  # its step in flight: skipped
    steps(KEEP_CHUNKS)
    now[0] = KEEP_S - 1  # every chunk bound passed, not the time's
    steps(1)
    assert len(col.forgotten) == 1000
    now[0] = KEEP_S
    steps(1)
    assert len(col.forgotten) == 0 and not col.pending
    col.forget("late")  # delivered, or never here: known all the same
    now[0] = 10 * KEEP_S  # the time bound passed, not the chunks'
    steps(KEEP_CHUNKS - 1)
    assert "late" in col.forgotten
    steps(1)
    assert len(col.forgotten) == 0
    with pytest.raises(CorecapError, match="unknown request 'r0'"):  # gone: refused as any stranger's
        col.take(_chunk(0, [("r0", ids, 0)]), 0.0)


def test_the_caches_copies_count_in_the_pools_bound():
    """The copies are held bytes of the pool (sink/buffers.py): free buffers make room for them."""
    from corecap.sink.prefix_cache import BlockCopies

    from corecap.sink.buffers import size_class

    pool = BufferPool(size_class(BLOCK_BYTES) + 2 * BLOCK_BYTES)
    pool.give(pool.take((len(LAYERS), BS, HIDDEN), torch.float32))
    assert pool.free_bytes == size_class(BLOCK_BYTES)  # kept for reuse
    copies = BlockCopies(pool)
    kept = [copies.copy(torch.ones(len(LAYERS), BS, HIDDEN)) for _ in range(3)]
    assert pool.held_bytes == 3 * BLOCK_BYTES and pool.free_bytes == 0  # the free buffer let go for them
    assert copies.peak_bytes == 3 * BLOCK_BYTES and all(k.is_contiguous() for k in kept)
    for k in kept:
        copies.free(k)
    assert pool.held_bytes == 0 == copies.num_bytes


# --- decode steps: a token for each of many requests (corecap run --max-tokens) ------------------


@pytest.mark.parametrize("copy_threads", [1, 3])
def test_decode_steps_of_many_requests_land_each_token_under_its_sample(copy_threads):
    """Responses being written: each step holds one token of every request, at its own position
    (the batched path of `Collector._copy_all`); the states land where they belong, then each
    sample completes with its response (`Collector.generated`)."""
    from corecap.store.generated import Generation

    rng = np.random.default_rng(3)
    prompts = {f"r{k}": rng.integers(0, 100, int(rng.integers(1, 6))).astype(np.int32) for k in range(12)}
    response = {r: rng.integers(0, 100, 3).astype(np.int32) for r in prompts}
    done = {}
    c = Collector(LAYERS,
                  lambda p: done.__setitem__(p.key, (p.token_ids.copy(), p.stored_states().clone(), p.loss_mask)),
                  BufferPool(1 << 20), copy_threads=copy_threads)
    for r, ids in prompts.items():
        c.expect(r, r, ids, None, None, max_new=4)
    expected = {r: torch.empty(len(LAYERS), len(ids) + 3, HIDDEN) for r, ids in prompts.items()}
    first = _chunk(0, [(r, ids, 0) for r, ids in prompts.items()])  # the prompts' prefill
    offset = 0
    for r, ids in prompts.items():
        expected[r][:, : len(ids)] = first.states[:, offset : offset + len(ids)]
        offset += len(ids)
    c.take(first, 0.0)
    for t in range(3):  # three decode steps: every request's response token t
        msg = _chunk(1 + t, [(r, response[r][t : t + 1], len(prompts[r]) + t) for r in prompts])
        for k, r in enumerate(prompts):
            expected[r][:, len(prompts[r]) + t] = msg.states[:, k]
        c.take(msg, 0.0)
    assert not done  # the responses are not known yet
    for r in prompts:
        c.generated(r, response[r], Generation(num_prompt=len(prompts[r]), num_generated=3, finish_reason="length"))
    c.close()
    assert sorted(done) == sorted(prompts)
    for r, (ids, states, mask) in done.items():
        assert ids.tolist() == prompts[r].tolist() + response[r].tolist()
        assert torch.equal(states, expected[r]), r
        assert mask.tolist() == [0] * len(prompts[r]) + [1] * 3


def test_a_damaged_token_of_a_decode_step_is_refused_naming_its_layer():
    """A decode step of many requests has one CRC a layer (wire.crc_per_layer): a flipped value
    in any request's row refuses the step, naming the layer and the step; nothing is handed on."""
    done = []
    c = Collector(LAYERS, done.append, copy_threads=3)
    num = wire.PER_LAYER_SEGMENTS
    for k in range(num):
        c.expect(f"r{k}", f"r{k}", np.array([5], np.int32), None, None, max_new=2)
    c.take(_chunk(0, [(f"r{k}", np.array([5], np.int32), 0) for k in range(num)]), 0.0)
    msg = _chunk(1, [(f"r{k}", np.array([9], np.int32), 1) for k in range(num)])
    assert len(msg.header.crcs) == 2 + len(LAYERS)
    msg.states[1, num - 2, 0] += 1.0  # layer LAYERS[1] of one request, after its CRC was taken
    with pytest.raises(CorecapError, match=rf"states of {num} requests \(layer 3, step 1\) arrived damaged"):
        c.take(msg, 0.0)
    assert done == []
    c.close()


def test_a_response_whose_states_are_of_other_tokens_is_refused():
    from corecap.store.generated import Generation

    c = Collector(LAYERS, lambda p: None)
    c.expect("r", "key-r", np.array([5, 6], np.int32), None, None, max_new=3)
    c.take(_chunk(0, [("r", np.array([5, 6], np.int32), 0)]), 0.0)
    c.take(_chunk(1, [("r", np.array([7], np.int32), 2)]), 0.0)
    with pytest.raises(CorecapError, match="the states received for its response are of other tokens"):
        c.generated("r", np.array([8], np.int32), Generation(num_prompt=2, num_generated=1, finish_reason="eos"))
