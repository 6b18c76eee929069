"""The driver's half of exact prefix caching (corecap/_vllm/prefix_tracker.py), against a stand-in for
vLLM's scheduler (no engine): what it counts, what it tells the sink, and that a block leaves
vLLM's prefix cache before the sink is told to forget it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from corecap._vllm.prefix_tracker import PrefixTracker
from corecap.errors import CorecapError

BS = 4


class _Pool:
    """vLLM's block pool as the tracker sees it: hash → cached block ids (duplicates allowed)."""

    def __init__(self):
        self.cached: dict[bytes, list[int]] = {}
        self.num_gpu_blocks = 100
        self.log: list = []

    def get_cached_block(self, block_hash, group_ids):
        ids = self.cached.get(block_hash)
        return [SimpleNamespace(block_id=ids[0])] if ids else None

    def evict(self, block_ids):
        for h, ids in list(self.cached.items()):
            self.cached[h] = [i for i in ids if i not in block_ids]
            if not self.cached[h]:
                del self.cached[h]
                self.log.append(("evicted", h))


def _scheduler(pool: _Pool, groups: int = 1):
    spec = SimpleNamespace(kv_cache_spec=SimpleNamespace(block_size=BS))
    manager = SimpleNamespace(block_pool=pool, evict_blocks=pool.evict)
    return SimpleNamespace(kv_cache_config=SimpleNamespace(kv_cache_groups=[spec] * groups), hash_block_size=BS,
                           block_size=BS, requests={}, kv_cache_manager=manager)


def _step(scheduler, tracker, scheduled: dict[str, int], new: dict[str, int]) -> list:
    """One schedule(): `scheduled` req → tokens this step, `new` req → its cache hit in tokens."""
    for req_id, n in scheduled.items():
        scheduler.requests[req_id].num_computed_tokens += n + new.get(req_id, 0)
    out = SimpleNamespace(num_scheduled_tokens=scheduled,
                          scheduled_new_reqs=[SimpleNamespace(req_id=r, num_computed_tokens=h) for r, h in new.items()])
    tracker.after_schedule(out)
    return tracker.take_actions()


def _request(scheduler, req_id, hashes):
    scheduler.requests[req_id] = SimpleNamespace(num_computed_tokens=0, block_hashes=hashes)


def test_the_bound_defaults_to_the_kv_caches_block_count_and_never_exceeds_it():
    assert PrefixTracker(_scheduler(_Pool())).max_blocks == 100
    assert PrefixTracker(_scheduler(_Pool()), max_blocks=7).max_blocks == 7
    assert PrefixTracker(_scheduler(_Pool()), max_blocks=700).max_blocks == 100  # vLLM never holds more


def test_an_aborted_request_says_how_far_its_steps_were_scheduled():
    """`corecap serve` aborts a request whose client went away: the sink must still take the states
    of every position a step of it was scheduled for (their blocks are cached and counted), even
    where a preemption reset its num_computed_tokens while such a step is in flight."""
    scheduler = _scheduler(_Pool())
    tracker = PrefixTracker(scheduler, max_blocks=10)
    _request(scheduler, "a", [b"1", b"2", b"3"])
    _request(scheduler, "b", [b"4"])
    _step(scheduler, tracker, {"a": 8, "b": 3}, {"a": 0, "b": 0})
    scheduler.requests["a"].num_computed_tokens = 0  # preempted, its step still in flight
    assert tracker.abandon("a") == 8 and tracker.abandon("a") == 0
    assert tracker.abandon("never-scheduled") == 0
    tracker.forget(["b"])  # finished: nothing kept of it
    assert not tracker.ends


def test_hits_and_productions_and_the_bound():
    pool = _Pool()
    scheduler = _scheduler(pool)
    tracker = PrefixTracker(scheduler, max_blocks=3)
    _request(scheduler, "a", [b"1", b"2", b"3"])  # 13 tokens
    _request(scheduler, "b", [b"1", b"2", b"x"])
    assert _step(scheduler, tracker, {"a": 8}, {"a": 0}) == []  # blocks 1, 2 produced
    pool.cached.update({b"1": [0], b"2": [1]})
    # b hits 2 blocks; a completes block 3 and b block x: 4 hashes > 3, the oldest goes, from vLLM first
    actions = _step(scheduler, tracker, {"a": 5, "b": 4}, {"b": 8})
    assert actions == [("hits", "b", 2), ("drop", b"3", 1)]  # 1 and 2 were just hit: 3 is the oldest
    assert tracker.num_hit_tokens == 8 and list(tracker.counts) == [b"x", b"1", b"2"]  # least recently used first
    pool.cached[b"x"] = [5, 6]  # computed twice: two blocks, one hash
    tracker.max_blocks = 2
    actions = _step(scheduler, tracker, {}, {})
    assert actions == [("drop", b"x", 1)] and pool.log == [("evicted", b"x")] and b"x" not in pool.cached
    tracker.max_blocks = 0
    actions = _step(scheduler, tracker, {}, {})
    assert actions == [("drop", b"1", 1), ("drop", b"2", 1)] and not pool.cached
    assert tracker.num_evicted == 4  # blocks: both of x's, 1 and 2


def test_a_hit_on_a_block_corecap_dropped_is_an_error_not_a_hole():
    scheduler = _scheduler(_Pool())
    tracker = PrefixTracker(scheduler, max_blocks=10)
    _request(scheduler, "a", [b"1", b"2"])
    with pytest.raises(CorecapError, match="hit 1 blocks whose producer corecap does not know"):
        _step(scheduler, tracker, {"a": 4}, {"a": 4})


def test_same_step_hits_count_the_blocks_produced_in_that_step():
    scheduler = _scheduler(_Pool())
    tracker = PrefixTracker(scheduler, max_blocks=10)
    _request(scheduler, "e", [b"1", b"2"])
    _request(scheduler, "f", [b"1", b"2"])
    assert _step(scheduler, tracker, {"e": 9, "f": 1}, {"e": 0, "f": 8}) == [("hits", "f", 2)]


def test_hybrid_kv_caches_are_refused():
    with pytest.raises(CorecapError, match="2 groups"):
        PrefixTracker(_scheduler(_Pool(), groups=2), max_blocks=1)


def test_a_response_block_dropped_before_vllm_caches_it_leaves_the_cache_at_the_next_update():
    """Async scheduling: the step feeding a response's final token T is scheduled before T is
    sampled; T's output makes its block's hash known (`after_update` counts it), and vLLM caches
    the block only at the next output. A bound that drops the hash in between must evict it then."""
    pool = _Pool()
    scheduler = _scheduler(pool)
    tracker = PrefixTracker(scheduler, max_blocks=2)
    _request(scheduler, "r", [b"p"])
    tracker.told("r", 1)
    assert _step(scheduler, tracker, {"r": 4}, {"r": 0}) == []  # the prompt's block p, as vLLM caches it
    pool.cached[b"p"] = [0]
    assert _step(scheduler, tracker, {"r": 4}, {}) == []  # feeds T, not yet sampled: no hash for block 1
    scheduler.requests["r"].block_hashes.append(b"B")  # T's output: vLLM hashes the block it ends
    tracker.after_update()
    assert tracker.take_actions() == [("hash", "r", 1, b"B")] and b"B" not in pool.cached
    _request(scheduler, "o", [b"o1", b"o2"])  # the next step: two blocks of another prompt
    actions = _step(scheduler, tracker, {"o": 8}, {"o": 0})
    assert actions == [("drop", b"p", 1), ("drop", b"B", 1)] and pool.log == [("evicted", b"p")]
    pool.cached[b"B"] = [1]  # the output of the step that fed T: vLLM caches B now
    tracker.forget(["r"])  # the response is complete
    tracker.after_update()
    assert b"B" not in pool.cached and pool.log[-1] == ("evicted", b"B") and tracker.take_actions() == []
    assert tracker.num_evicted == 2


def test_a_dropped_hash_counted_again_stays_in_vllms_cache():
    pool = _Pool()
    scheduler = _scheduler(pool)
    tracker = PrefixTracker(scheduler, max_blocks=1)
    _request(scheduler, "a", [b"1", b"2"])
    _step(scheduler, tracker, {"a": 4}, {"a": 0})
    assert _step(scheduler, tracker, {"a": 4}, {}) == [("drop", b"1", 1)]
    _request(scheduler, "b", [b"1"])  # computes block 1 again: the sink knows its producer again
    _step(scheduler, tracker, {"b": 4}, {"b": 0})
    pool.cached[b"1"] = [2]
    tracker.after_update()
    assert pool.cached == {b"1": [2]}
