"""vLLM's prefix caching, kept exact for the capture: the driver's half (the sink's half, and
why the two agree, is corecap/sink/prefix_cache.py).

After every `schedule()` (`Engine._fill`) the tracker reads, for each newly scheduled request,
how many of its positions vLLM took from its prefix cache (`NewRequestData.num_computed_tokens`,
always whole blocks of `request.block_hashes`), and which full blocks each scheduled request
completes in this step (those vLLM caches now, and the sink will know the producer of). It keeps
vLLM's cached hashes a subset of the hashes the sink knows: the sink knows every hash this
tracker counts, and before it stops counting one (more than `max_blocks`: least recently used
first) it removes that hash from vLLM's prefix cache (`KVCacheManager.evict_blocks`: a block in
use stays allocated to its request, it only stops being a cache hit). Both happen between two
`schedule()` calls, so no later hit can name a block the sink has forgotten. With async
scheduling a response's block may be completed by a step scheduled before the token that ends it
is sampled, so before vLLM can hash it: that block is told and counted once its hash is known,
after the output that brings the token (`after_update`), before vLLM caches it (one output later:
a hash the bound drops in between is evicted again then). vLLM evicting a
block on its own needs no message: the sink forgets it when the bound drops it. The bound is,
unless the user sets one, the KV cache's block count, the most blocks vLLM can hold cached (and
never more: a hash vLLM no longer holds is never hit); in `corecap run` the sink keeps no states
of its own for a hash (corecap/sink/prefix_cache.py), only who produced it. `corecap serve`'s
sink keeps a copy of each block's states, so there the bound is what its memory for them holds
(corecap/serve/prepare.py).

A request aborted (`corecap serve`: its client went away) may already have had steps scheduled
whose blocks vLLM caches and this tracker counted: their states reach the sink all the same, and
the sink must take them before it forgets the request. `abandon` says how far: the furthest
position any of its steps scheduled (not `num_computed_tokens`, which a preemption resets while
a step of it is still in flight).
"""

from __future__ import annotations

from collections import OrderedDict

from corecap.errors import CorecapError
from corecap.transport.prefix_blocks import completed_blocks


def block_size(vllm_config) -> int:
    """vLLM's block size where prefix caching is on in this configuration, else 0. vLLM may turn
    it off itself (on the CPU for MLA models, for non-causal attention)."""
    cache = vllm_config.cache_config
    return cache.block_size if cache.enable_prefix_caching else 0


class PrefixTracker:
    """Per engine: the block hashes the sink knows, least recently used first."""

    def __init__(self, scheduler, max_blocks: int | None = None):
        """`max_blocks`: the most hashes counted (None: the KV cache's block count)."""
        groups = scheduler.kv_cache_config.kv_cache_groups
        hash_block_size = getattr(scheduler, "hash_block_size", scheduler.block_size)
        if len(groups) != 1 or groups[0].kv_cache_spec.block_size != hash_block_size:
            raise CorecapError(
                f"--enable-prefix-caching: this model's KV cache has {len(groups)} groups (hybrid attention); "
                "corecap keeps prefix caching exact for one group only (use --no-enable-prefix-caching)"
            )
        self.scheduler = scheduler
        self.block_size = hash_block_size
        num_gpu_blocks = scheduler.kv_cache_manager.block_pool.num_gpu_blocks
        self.max_blocks = min(max_blocks or num_gpu_blocks, num_gpu_blocks)
        self.ends: dict[str, int] = {}  # unfinished request → the furthest position a step of it scheduled
        self.counts: OrderedDict[bytes, int] = OrderedDict()  # hash → productions since the sink last dropped it
        # for the sink, in order: ("hits", req_id, n), ("drop", hash, count), ("hash", req_id, i, hash)
        self.actions: list[tuple] = []
        self.num_told: dict[str, int] = {}  # generating request → the block hashes the sink knows of it
        self.dropped: list[bytes] = []  # hashes the bound dropped since the last after_update
        self.num_hit_tokens = 0
        self.num_evicted = 0

    def after_schedule(self, scheduler_output) -> None:
        bs, requests = self.block_size, self.scheduler.requests
        # Productions first: a request may hit blocks that another computes in this same step.
        ends = self.ends
        for req_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            request = requests[req_id]
            end = request.num_computed_tokens  # already advanced past this step's tokens
            if end > ends.get(req_id, 0):
                ends[req_id] = end
            told = self.num_told.get(req_id)
            for i in completed_blocks(end - num_tokens, end, bs, len(request.block_hashes)):
                h = request.block_hashes[i]
                if told is not None and i >= told:  # a response's block: its hash is new to the sink
                    self.actions.append(("hash", req_id, i, h))
                    told = self.num_told[req_id] = i + 1
                self._count(h)
        for new in scheduler_output.scheduled_new_reqs:
            num_blocks = new.num_computed_tokens // bs
            if not num_blocks:
                continue
            hashes = requests[new.req_id].block_hashes[:num_blocks]
            gone = [h for h in hashes if h not in self.counts]
            if gone:  # the invariant this module keeps; a hit here would be a sample with holes
                raise CorecapError(f"prefix cache: request {new.req_id} hit {len(gone)} blocks "
                                   "whose producer corecap does not know")
            for h in hashes:
                self.counts.move_to_end(h)
            self.actions.append(("hits", new.req_id, num_blocks))
            self.num_hit_tokens += num_blocks * bs
        self._bound()

    def after_update(self) -> None:
        """After `update_from_output`: the blocks of a response that a step already scheduled
        completes (num_computed_tokens counts the steps in flight) and whose hash vLLM now knows,
        the sampled token that ends them having come (async scheduling; without it a block's hash
        is known when the step completing it is scheduled, and `after_schedule` tells it).

        Such a block is counted before vLLM caches it: it caches the block in the
        `update_from_output` of the step that feeds the token, one output later. Had the bound
        dropped its hash in between, `_evict` found nothing to evict, and vLLM would then cache a
        block the sink has forgotten; so every hash dropped since the last call, unless counted
        again since, leaves vLLM's cache now, that update having run. Called after every update,
        with or without responses left: the last response's block is cached by its own."""
        dropped, self.dropped = self.dropped, []
        for h in dropped:
            if h not in self.counts:
                self._evict(h)
        bs, requests = self.block_size, self.scheduler.requests
        for req_id, told in list(self.num_told.items()):
            request = requests.get(req_id)
            end = 0 if request is None else min(len(request.block_hashes), request.num_computed_tokens // bs)
            if end <= told:
                continue
            for i in range(told, end):
                self.actions.append(("hash", req_id, i, request.block_hashes[i]))
                self._count(request.block_hashes[i])
            self.num_told[req_id] = end
        self._bound()

    def _count(self, block_hash: bytes) -> None:
        """One more production of the block (the sink counts the same)."""
        self.counts[block_hash] = self.counts.get(block_hash, 0) + 1
        self.counts.move_to_end(block_hash)

    def _bound(self) -> None:
        while len(self.counts) > self.max_blocks:
            h, count = self.counts.popitem(last=False)
            self._evict(h)
            self.dropped.append(h)
            self.actions.append(("drop", h, count))

    def told(self, req_id: str, num_hashes: int) -> None:
        """A generating request whose first `num_hashes` block hashes (its prompt's) the sink was
        given: the hashes of the blocks its response completes go to the sink as they come."""
        self.num_told[req_id] = num_hashes

    def forget(self, req_ids) -> None:
        """Finished requests: nothing more of them is scheduled."""
        for req_id in req_ids:
            self.num_told.pop(req_id, None)
            self.ends.pop(req_id, None)

    def abandon(self, req_id: str) -> int:
        """An aborted request: how many of its leading positions its scheduled steps compute (their
        states, and the productions this tracker counted in them, still reach the sink)."""
        self.num_told.pop(req_id, None)
        return self.ends.pop(req_id, 0)

    def _evict(self, block_hash: bytes) -> None:
        """Every block vLLM caches under this hash (a recomputed block is cached again, in a block
        of its own), out of its prefix cache."""
        manager = self.scheduler.kv_cache_manager
        pool = manager.block_pool
        for _ in range(pool.num_gpu_blocks + 1):
            blocks = pool.get_cached_block(block_hash, [0])
            if not blocks:
                return
            self.num_evicted += 1
            manager.evict_blocks({b.block_id for b in blocks})
        raise AssertionError("evict_blocks left a block in vLLM's prefix cache")

    def take_actions(self) -> list[tuple]:
        actions, self.actions = self.actions, []
        return actions


def contract_problem() -> str | None:
    """What this module relies on in vLLM, without an engine (tests/test_adapter.py)."""
    import dataclasses
    import inspect

    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.output import NewRequestData
    from vllm.v1.core.sched.scheduler import Scheduler

    fields = {f.name for f in dataclasses.fields(NewRequestData)}
    if not {"req_id", "num_computed_tokens"} <= fields:
        return "NewRequestData lost req_id or num_computed_tokens"
    if list(inspect.signature(KVCacheManager.evict_blocks).parameters) != ["self", "block_ids"]:
        return "KVCacheManager.evict_blocks(block_ids) moved"
    if list(inspect.signature(BlockPool.get_cached_block).parameters) != ["self", "block_hash", "kv_cache_group_ids"]:
        return "BlockPool.get_cached_block(block_hash, kv_cache_group_ids) moved"
    if "num_computed_tokens += " not in inspect.getsource(Scheduler._update_after_schedule):
        return "Scheduler._update_after_schedule no longer advances num_computed_tokens at schedule time"
    return None
