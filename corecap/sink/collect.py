"""Sink side of the wire: reassemble samples from worker chunks and hand finished ones on.

A sample may arrive in several chunks across engine steps (chunked prefill) and a step's chunk
holds several samples. Nothing is taken on trust: every segment's positions must be a
contiguous run inside its sample and its token ids must equal the sample's own ids at those
positions, so a capture that would land under the wrong sample, or short, is an error, not a
stored sample; each run of states is checked against the worker's CRC-32 as it is copied. A
sample is complete when every one of its positions has been received.

With vLLM's prefix caching on, a sample's leading full blocks may never be computed for it: the
driver says how many (`hits`) and the states cache (corecap/sink/prefix_cache.py), which every
captured full block of a sample with block hashes feeds, names the sample that produced each.
Such a sample is stored once: it refers, for its first j hit blocks, to the producer of block
j - 1, the last one already handed to the writer, and encodes only the rest, copying the states
of any later hit blocks from their producers' buffers, still pending (`_refer`;
corecap/store/refs.py). No cached block is ever copied twice, or at all where it is referred to.

Delivering (`corecap serve`, `whole`), a sample is never stored by reference: every hit block is
copied into it as it is placed, from the producer's buffer while that one is pending, else from
the states cache's own copy (sink/prefix_cache.py). A sample whose request is aborted is kept
until the states of every position its scheduled steps compute have come (`forget`), since the
blocks they complete are cached by vLLM and may be hit later; then dropped, never delivered. Its
id stays known while states of it may still come (sink/aborted.py), so that they are skipped.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from corecap.errors import CorecapError
from corecap.sink import stream
from corecap.sink.aborted import AbortedIds
from corecap.sink.buffers import BufferPool
from corecap.sink.pending import Pending
from corecap.sink.prefix_cache import BlockCopies, Producer, StatesCache
from corecap.store import refs
from corecap.store.spill import SpillFile
from corecap.transport import wire
from corecap.transport.prefix_blocks import completed_blocks


@dataclass(kw_only=True)
class ChunkTiming:
    step: int
    num_tokens: int
    nbytes: int
    t_copy: float  # worker: device-to-host copy started
    t_ready: float  # worker: host copy done, sending
    t_recv: float  # sink: received
    t_done: float  # sink: reassembled


class Collector:
    """Reassembles samples from decoded chunks (the sink process's main loop feeds it).

    A chunk's copies (one per segment and layer, each a contiguous run) go to `copy_threads`
    threads: the sink runs torch single-threaded (sink.py), so this is where the copy of a
    step gets more than one core (two threads beat one even on a 2-core machine; measured:
    docs/benchmarks.md, "Capture"). Samples are
    handed on once every copy of the chunk is done."""

    def __init__(
        self, layers: tuple[int, ...], on_complete: Callable[[Pending], None], buffers: BufferPool | None = None,
        copy_threads: int = 1, block_size: int = 0, spill_dir: str | None = None, buffer_bytes: int = 0,
        whole: bool = False, on_forgotten: Callable[[Pending], None] | None = None, timed: bool = True,
    ):
        """`block_size`: vLLM's, with prefix caching on (0: off). `spill_dir`: where samples whose
        states exceed half of `buffer_bytes` stream (sink/stream.py); None: every sample is held.
        `whole`: every sample is handed on whole, never by reference (`corecap serve`): the states
        cache keeps copies of its blocks, counted in `buffers`. `on_forgotten`: an aborted sample,
        dropped (`forget`): its buffer and reservation go back. `timed`: each chunk's timing kept
        for the run's trace; a server, which runs for as long as it is needed, keeps none."""
        self.layers = layers
        self.spill_dir = spill_dir
        self.buffer_bytes = buffer_bytes
        self.num_streamed = 0
        self.block_size = block_size
        self.whole = whole
        self.cache = StatesCache(copies=BlockCopies(buffers) if whole else None)
        self.on_complete = on_complete
        self.on_forgotten = on_forgotten or (lambda p: None)
        self.buffers = buffers
        self.pending: dict[str, Pending] = {}
        self.forgotten = AbortedIds()  # aborted requests, whose states may still be on their way
        self.num_referring = 0  # samples handed on with a reference (stored once)
        self.num_referred_tokens = 0
        self.num_stored_whole = 0  # with hits, but their source was not yet handed to the writer
        self.timed = timed
        self.timings: list[ChunkTiming] = []
        self.copy_threads = copy_threads
        self.copiers = ThreadPoolExecutor(copy_threads, thread_name_prefix="corecap-copy") if copy_threads > 1 else None

    def close(self) -> None:
        if self.copiers:
            self.copiers.shutdown()
        for p in self.pending.values():  # incomplete: dropped, their spill files with them
            if p.spill is not None:
                p.spill.discard()

    def expect(
        self, req_id: str, key: str, token_ids: np.ndarray, loss_mask: np.ndarray | None = None,
        block_hashes: list[bytes] | None = None, max_new: int = 0, reserved: int = 0, media=None,
    ) -> None:
        """A sample to reassemble; `max_new` > 0: the model writes up to that many tokens after
        `token_ids` (the prompt), which `generated` names once the response is written. `reserved`:
        the driver's bytes for it, handed back with it (`Pending.reserved`)."""
        capacity = len(token_ids) + max_new
        self.pending[req_id] = Pending(
            key=key, token_ids=token_ids, loss_mask=loss_mask, covered=np.zeros(capacity, bool),
            block_hashes=None if block_hashes is None else list(block_hashes),
            producer=Producer(key, len(token_ids)) if self.block_size else None,
            capacity=capacity, received=np.zeros(capacity, np.int32) if max_new else None, final=not max_new,
            reserved=reserved, media=media,
        )

    def generated(self, req_id: str, token_ids: np.ndarray, generation) -> None:
        """The response written for `req_id`: the sample is its prompt and these tokens, every one
        of whose states is on its way (or here), none beyond (the driver aborted the request)."""
        p = self.pending.get(req_id)
        if p is None or p.final:
            raise CorecapError(f"a response for request {req_id!r}, which the sink does not expect one for")
        prompt = len(p.token_ids)
        end = prompt + len(token_ids)
        if end > p.capacity:
            raise CorecapError(f"sample {p.key!r}: a response of {len(token_ids)} tokens, "
                               f"more than the {p.capacity - prompt} expected")
        seen = p.covered[prompt:end]
        if (not np.array_equal(p.received[prompt:end][seen], np.asarray(token_ids, np.int32)[seen])
                or p.covered[end:].any()):
            raise CorecapError(f"sample {p.key!r}: the states received for its response are of other tokens "
                               "than the response's")
        if p.block_hashes is not None and len(p.block_hashes) != end // self.block_size:
            raise CorecapError(f"prefix cache: sample {p.key!r} ends with {end // self.block_size} full blocks, "
                               f"the hashes of {len(p.block_hashes)} known (corecap/_vllm/prefix_tracker.py)")
        p.token_ids = np.concatenate([p.token_ids, np.asarray(token_ids, np.int32)])
        mask = np.zeros(prompt, np.uint8) if p.loss_mask is None else p.loss_mask
        p.loss_mask = np.concatenate([mask, np.ones(len(token_ids), np.uint8)])
        p.generation, p.final, p.received = generation, True, None
        if p.producer is not None:
            p.producer.num_tokens = end
        self._complete([req_id])

    def block_hash(self, req_id: str, index: int, block_hash: bytes) -> None:
        """The hash of a block that a response completes (prefix caching on): produced here once
        its positions are here, whichever of the two comes first."""
        p = self.pending.get(req_id)
        if p is None or p.block_hashes is None or index != len(p.block_hashes):
            raise CorecapError(f"prefix cache: the hash of block {index} of request {req_id!r}, "
                               "which the sink cannot place")
        p.block_hashes.append(block_hash)
        bs = self.block_size
        if p.covered[index * bs : (index + 1) * bs].all():
            served = self._produce(p, index)
            self._complete(served)

    def hits(self, req_id: str, num_blocks: int) -> None:
        """vLLM took the first `num_blocks` blocks of this request from its prefix cache."""
        p = self.pending.get(req_id)
        if p is None or not p.block_hashes or num_blocks > len(p.block_hashes):
            raise CorecapError(f"prefix cache: {num_blocks} cached blocks for request {req_id!r}, "
                               "which the sink cannot place")
        p.num_hits = num_blocks
        for i in range(num_blocks):
            found = self.cache.get(p.block_hashes[i])
            if found is None:  # its producer's chunk is still on its way
                self.cache.wait(p.block_hashes[i], (req_id, i))
            else:  # a pending producer's buffer stays as it is: held, copied only if not referred to
                # (delivered whole: copied now, as the producer may be delivered and its buffer reused first)
                self._fill(req_id, i, found[1], found[0], hold=not self.whole)
        self._complete([req_id])

    def drop(self, block_hash: bytes, count: int) -> None:
        self.cache.drop(block_hash, count)

    def _fill(self, req_id: str, i: int, block: torch.Tensor | None, producer: Producer, hold: bool = False) -> None:
        """Block i of the sample, produced by `producer`: `block` copied now, or with `hold` kept
        (a view of the pending producer's buffer; None where that one was handed on) until
        `_complete` knows whether the sample refers to those positions (then never copied: its
        writer encodes only what follows them) or stores them itself."""
        p, bs = self.pending[req_id], self.block_size
        if hold:
            p.held[i] = block
        else:
            p.buffer(block.shape[0], block.shape[2], block.dtype, self.buffers)[:, i * bs : (i + 1) * bs].copy_(block)
        p.cover(i * bs, bs)
        p.sources[i] = producer

    def _complete(self, req_ids) -> None:
        for req_id in req_ids:
            p = self.pending.get(req_id)
            if p is None:
                continue
            if p.until is not None:  # aborted: dropped once the states of its scheduled steps are here
                if p.num_covered >= p.until:
                    self._drop_forgotten(req_id, p)
            elif p.final and p.num_covered == len(p.token_ids):
                del self.pending[req_id]
                if self.whole:
                    if p.producer is not None:  # its blocks copied out before its buffer goes
                        self.cache.release(p.producer)
                    self.on_complete(p)
                    continue
                if p.num_hits:
                    self._refer(p)
                self.on_complete(p)
                if p.producer is not None:
                    p.producer.queued = True
                    self.cache.release(p.producer)

    def _refer(self, p: Pending) -> None:
        """Stored once: a sample whose first k blocks were cache hits refers, for positions
        [0, j x block size), to the producer of its block j - 1 (vLLM's block hash covers the whole
        prefix, so that sample's tokens there are these), resolved to the samples that store
        those positions themselves, for the largest j <= k whose producer was already handed to
        the writer, which commits it first. The hit blocks after j are copied from their
        producers, still pending (a producer handed on when the hit was placed is one the writer
        has: such a block is always below j). No j (none handed on): it stores every position."""
        bs = self.block_size
        j = next((i + 1 for i in range(p.num_hits - 1, -1, -1) if p.sources[i].queued), 0)
        for i, block in p.held.items():
            if i >= j:
                p.states[:, i * bs : (i + 1) * bs].copy_(block)
        p.held.clear()  # the others are the producers' to store
        if not j:
            self.num_stored_whole += 1
            return
        p.producer.prefix = refs.within(p.sources[j - 1].layout(), 0, j * bs)
        self.num_referring += 1
        self.num_referred_tokens += j * bs

    def _produce(self, p: Pending, i: int) -> list[str]:
        """Block i of `p` is here, and its hash known: the requests it serves."""
        bs = self.block_size
        block = p.states[:, i * bs : (i + 1) * bs]
        served = []
        for req_id, k in self.cache.produce(p.block_hashes[i], block, p.producer):
            if req_id in self.pending:  # else an aborted sample, dropped since
                self._fill(req_id, k, block, p.producer)
                served.append(req_id)
        return served

    def _copy_all(self, msg: wire.DecodedChunk, placed: list) -> None:
        """Check and copy a chunk's runs into their samples, through the chunk's bytes (numpy: a
        torch operation a run costs more than a decode step's one-row copy). `placed`: (the
        sample's rows, its first position, the segment's index and offset in the chunk, its
        tokens). A chunk of a few segments (prefill) is one task a (layer, segment), each run
        checked against its CRC as it is copied, so that even one segment's layers spread over
        the copy threads. A chunk of many (`wire.crc_per_layer`: a decode step) is one task a
        layer, which checks the layer's CRC and copies its runs of more than one token; then
        each one-token segment's rows are copied in one go: a task and a check a (layer,
        segment) made a decode step's reassembly the sink's bottleneck on a GPU
        (docs/benchmarks.md, "Generation")."""
        rows = msg.state_rows()
        per_layer = wire.crc_per_layer(len(msg.header.segments))
        if per_layer:
            longer = [run for run in placed if run[4] > 1]
            tasks = [(msg, rows, i, -1, longer) for i in range(rows.shape[0])]
        else:
            tasks = [(msg, rows, i, run[2], [run]) for run in placed for i in range(rows.shape[0])]
        if self.copiers and len(tasks) > 1:
            for _ in self.copiers.map(_copy_runs, tasks):  # re-raises a copy's error
                pass
        else:
            for task in tasks:
                _copy_runs(task)
        if per_layer:
            for target, start, _, lo, n in placed:
                if n == 1:
                    target[:, start] = rows[:, lo]

    def _room(self, p: Pending, states: torch.Tensor) -> None:
        """Where the sample's rows go, at its first chunk: a buffer, or for a sample longer than
        the sink may hold (sink/stream.py) its spill file. fp8 rows are H + 4 bytes."""
        num_layers, row_bytes = len(self.layers), states.shape[-1] * states.element_size()
        nbytes = num_layers * p.capacity * row_bytes
        # A response's sample is held whole: its length is known only at its end (the plan checked it fits).
        if self.spill_dir is None or not p.final or not stream.streams(nbytes, self.buffer_bytes):
            p.buffer(num_layers, states.shape[-1], states.dtype, self.buffers)
            return
        if self.block_size:  # the plan refuses this
            raise CorecapError(f"sample {p.key!r}: its {nbytes} bytes of states exceed half of --buffer-gb, and "
                               "streaming them to disk does not work with prefix caching")
        p.spill = SpillFile(self.spill_dir, nbytes)
        p.rows = stream.SpilledRows(p.spill, num_layers, p.capacity, row_bytes, fp8=states.dtype == torch.uint8)
        self.num_streamed += 1

    def forget(self, req_id: str, until: int = 0) -> None:
        """Drop a pending sample (its request was aborted), never handed on; `on_forgotten` gives
        its buffer and reservation back. With prefix caching on, not before the states of its first
        `until` positions (those its scheduled steps compute, the driver says) are here: the full
        blocks among them are in vLLM's prefix cache, and a later hit needs their states. States of
        it after that are skipped."""
        p = self.pending.get(req_id)
        if p is None:  # none pending, or delivered
            self.forgotten.add(req_id)
            return
        p.until = until if self.block_size else 0
        self._complete([req_id])

    def _drop_forgotten(self, req_id: str, p: Pending) -> None:
        del self.pending[req_id]
        self.forgotten.add(req_id)
        if p.producer is not None:
            self.cache.release(p.producer)
        if p.spill is not None:
            p.spill.discard()
        p.held.clear()
        self.on_forgotten(p)

    def knows(self, msg: wire.DecodedChunk) -> bool:
        return all(seg.req_id in self.pending or seg.req_id in self.forgotten for seg in msg.header.segments)

    def take(self, msg: wire.DecodedChunk, t_recv: float) -> None:
        h = msg.header
        if h.layers != self.layers:
            raise CorecapError(f"worker sent layers {h.layers}, expected {self.layers}")
        positions, token_ids = msg.positions.tolist(), msg.token_ids.tolist()  # a decode step's scalars
        placed, runs = [], []  # placed: see `_copy_all`
        offset = 0
        for j, seg in enumerate(h.segments):
            n = seg.num_tokens
            lo, hi = offset, offset + n
            offset = hi
            p = self.pending.get(seg.req_id)
            if p is None and seg.req_id in self.forgotten:
                continue
            if p is None:
                raise CorecapError(f"worker sent states for unknown request {seg.req_id!r}")
            start = positions[lo]
            end = start + n
            limit = len(p.token_ids) if p.final else p.capacity
            # A decode step's one token per request needs no run check (one check a token is the
            # sink's cost per request then).
            contiguous = n == 1 or np.array_equal(msg.positions[lo:hi], np.arange(start, end))
            if not contiguous or end > limit:
                raise CorecapError(
                    f"sample {p.key!r}: received positions {start}..{positions[hi - 1]}, "
                    f"not a contiguous run inside its {limit} tokens"
                )
            known = max(start, min(end, len(p.token_ids)))  # a response's ids are checked once it is known
            if known > start and (
                p.token_ids[start] != token_ids[lo] if n == 1
                else not np.array_equal(msg.token_ids[lo : lo + known - start], p.token_ids[start:known])
            ):
                raise CorecapError(f"sample {p.key!r}: received token ids differ from the sample's "
                                   f"at positions {start}..")
            if not p.final and end > len(p.token_ids):
                if n == 1:
                    p.received[start] = token_ids[lo]
                else:
                    p.received[known:end] = msg.token_ids[lo + known - start : hi]
            if p.rows is None:
                self._room(p, msg.states)
            placed.append((p.rows, start, j, lo, n))
            p.cover(start, n)
            runs.append((seg.req_id, p, start, n))
        self._copy_all(msg, placed)
        served = []
        if self.block_size:  # every full block this chunk completed, for later hits on it
            for _, p, start, n in runs:
                for i in completed_blocks(start, start + n, self.block_size, len(p.block_hashes or ())):
                    served += self._produce(p, i)
        self._complete([r[0] for r in runs] + served)
        if self.timed:
            self.timings.append(ChunkTiming(
                step=h.step, num_tokens=h.num_tokens, nbytes=msg.states.nbytes, t_copy=h.t_copy, t_ready=h.t_ready,
                t_recv=t_recv, t_done=time.time(),
            ))
        self.forgotten.chunk_taken()


def _copy_runs(task: tuple) -> None:
    """Check layer i's run of segment j (-1: of every segment, `wire.crc_per_layer`) against its
    CRC-32, then copy layer i of the runs `placed` into their samples."""
    msg, rows, i, j, placed = task
    try:
        msg.check_run(i, j, rows[i] if j < 0 else rows[i, placed[0][3] : placed[0][3] + placed[0][4]])
    except wire.WireError as e:
        raise CorecapError(str(e)) from None
    src = rows[i]
    for target, start, _, lo, n in placed:
        target[i, start : start + n] = src[lo : lo + n]
