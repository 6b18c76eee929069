"""The states of cached prefix blocks: what lets a capture run with vLLM's prefix caching on.

With prefix caching on, vLLM computes a request's leading full blocks only when no earlier
request computed the same ones (same block hash: the whole prefix up to the block's end), so
the states of those positions never reach the capture. The sink knows here, by block hash,
which sample produced each full block, and completes every such sample from it
(Collector.hits): by reference once that producer was handed to the writer (stored once,
corecap/store/refs.py), else from the producer's own buffer, which stays as it is until the
producer is handed on. So the cache copies nothing and holds no states of its own: an entry
shows its producer's block (a view) only while the producer is pending (`release`).

Who decides what is kept: the driver (corecap/_vllm/prefix_tracker.py). Both sides apply one rule to the
same steps: a block is *produced* when a step computes its last position (corecap/transport/prefix_blocks.py;
that is when vLLM caches it). The driver counts productions per hash, for at most
`--prefix-blocks` hashes, dropping the least recently used, evicting them from vLLM's prefix
cache first, and sends `drop(hash, count)` with the number of productions it saw. A hit can only
name a hash that the driver still counts, so its producer is known here, or on its way in a
chunk the sink has not read.

Chunks (from the workers) and the driver's messages travel on different sockets, so a drop can
arrive before the chunks whose productions it counts. Counting makes that harmless: a hash's
count here is productions received minus productions dropped; the block is known while it is
positive; a negative count means productions of a dropped generation still to come, which serve
any request that waits for them and are not kept.

Served (`corecap serve`: corecap/sink/deliver.py) there is no store to refer to: each sample is
delivered whole, and its buffer goes back once it is written. So the cache keeps a copy of each
block it knows, made when the block's producer leaves (`release`; a view of its buffer until
then), in memory of its own (`BlockCopies`, counted in the sink's --buffer-gb), and freed when the
driver drops the hash. The driver's bound on the hashes it counts (`--prefix-blocks`, by default
what a share of --buffer-gb holds: corecap/serve/prepare.py) bounds those copies.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from corecap.store import refs


@dataclass(eq=False)
class Producer:
    """A sample as a source of stored states: what a later sample that hits its blocks may refer
    to (stored once, corecap/store/refs.py), once it is handed to the writer (`queued`), which
    commits it before or with any sample handed on after it."""

    key: str
    num_tokens: int
    prefix: tuple = ()  # the segments its own prefix refers to (empty: it stores every position)
    queued: bool = False
    entries: list = field(default_factory=list)  # the cache entries that show a view of its buffer

    def layout(self) -> tuple:
        return refs.layout(self.key, self.prefix, self.prefix[-1].end if self.prefix else 0, self.num_tokens)


@dataclass
class _Entry:
    count: int = 0  # productions received minus productions dropped
    producer: Producer | None = None  # the sample whose chunk produced this block, while count > 0
    # [L, block_size, H]: a view of the producer's buffer while it is pending; then none, or a copy
    # of the cache's own (`StatesCache.copies`)
    states: torch.Tensor | None = None
    copied: bool = False  # `states` is the cache's copy


class BlockCopies:
    """The memory of the blocks a serving sink keeps (`StatesCache.copies`), counted in the sink's
    buffer pool as held bytes (corecap/sink/buffers.py `hold`), so that the pool's bound covers the
    samples' buffers and these copies together."""

    def __init__(self, pool=None):
        self.pool = pool
        self.num_bytes = 0
        self.peak_bytes = 0
        self.num_copied = 0  # blocks copied, ever

    def copy(self, states: torch.Tensor) -> torch.Tensor:
        nbytes = states.numel() * states.element_size()
        if self.pool is not None:
            self.pool.hold(nbytes)
        self.num_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.num_bytes)
        self.num_copied += 1
        return states.clone(memory_format=torch.contiguous_format)

    def free(self, states: torch.Tensor) -> None:
        nbytes = states.numel() * states.element_size()
        if self.pool is not None:
            self.pool.drop(nbytes)
        self.num_bytes -= nbytes


@dataclass
class StatesCache:
    """block hash → the sample that produced that block, kept as the driver says; with `copies`,
    each block's states too, once its producer is gone (`corecap serve`)."""

    entries: dict[bytes, _Entry] = field(default_factory=dict)
    waiters: dict[bytes, list] = field(default_factory=dict)  # hash → what waits for its states
    copies: BlockCopies | None = None

    def get(self, block_hash: bytes) -> tuple[Producer, torch.Tensor | None] | None:
        """The block's producer and, while that one is pending (with `copies`: always), its states;
        None: not here (its chunk is on its way, or the block was dropped)."""
        entry = self.entries.get(block_hash)
        return None if entry is None or entry.producer is None else (entry.producer, entry.states)

    def wait(self, block_hash: bytes, waiter) -> None:
        self.waiters.setdefault(block_hash, []).append(waiter)

    def produce(self, block_hash: bytes, states: torch.Tensor, producer: Producer) -> list:
        """A chunk of `producer` (pending) completed this block: `states`, a view of its buffer.
        Returns the waiters to serve from `states`."""
        entry = self.entries.setdefault(block_hash, _Entry())
        entry.count += 1
        if entry.count > 0 and entry.producer is None:  # a later production of a live block changes nothing
            entry.producer, entry.states = producer, states
            producer.entries.append(entry)
        elif entry.count == 0:
            del self.entries[block_hash]  # the last production of a dropped generation
        return self.waiters.pop(block_hash, [])

    def release(self, producer: Producer) -> None:
        """`producer` was handed to the writer (or delivered, or forgotten), which may reuse its
        buffer: its blocks are from now on referred to, never read; with `copies`, read from a copy
        made now."""
        for entry in producer.entries:
            if entry.producer is producer and entry.states is not None:  # not dropped since
                if self.copies is None:
                    entry.states = None
                else:
                    entry.states, entry.copied = self.copies.copy(entry.states), True
        producer.entries.clear()

    def drop(self, block_hash: bytes, count: int) -> None:
        entry = self.entries.setdefault(block_hash, _Entry())
        entry.count -= count
        if entry.count <= 0:
            if entry.copied:
                self.copies.free(entry.states)
            entry.producer = entry.states = None
            entry.copied = False
        if entry.count == 0:
            del self.entries[block_hash]

    @property
    def num_blocks(self) -> int:
        """The blocks a hit may name now."""
        return sum(1 for e in self.entries.values() if e.producer is not None)
