"""Sink side of the wire: reassemble samples from worker chunks and hand finished ones on.

A sample may arrive in several chunks across engine steps (chunked prefill) and a step's chunk
holds several samples. Nothing is taken on trust: every segment's positions must be a
contiguous run inside its sample and its token ids must equal the sample's own ids at those
positions, so a capture that would land under the wrong sample, or short, is an error, not a
stored sample. A sample is complete when every one of its positions has been received.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from corecap import CorecapError, wire


@dataclass
class _Pending:
    key: str
    token_ids: np.ndarray
    loss_mask: np.ndarray | None
    states: torch.Tensor | None = None
    covered: np.ndarray = field(default=None)  # bool [T]
    num_covered: int = 0


@dataclass
class ChunkTiming:
    step: int
    num_tokens: int
    nbytes: int
    t_copy: float  # worker: capture started
    t_ready: float  # worker: host copy done, sending
    t_recv: float  # sink: received
    t_done: float  # sink: reassembled


class Collector:
    """Reassembles samples from decoded chunks (the sink process's main loop feeds it)."""

    def __init__(self, layers: tuple[int, ...], on_complete: Callable[[_Pending], None]):
        self.layers = layers
        self.on_complete = on_complete
        self.pending: dict[str, _Pending] = {}
        self.timings: list[ChunkTiming] = []

    def expect(self, req_id: str, key: str, token_ids: np.ndarray, loss_mask: np.ndarray | None = None) -> None:
        self.pending[req_id] = _Pending(key, token_ids, loss_mask, covered=np.zeros(len(token_ids), bool))

    def knows(self, msg: wire.DecodedChunk) -> bool:
        return all(seg.req_id in self.pending for seg in msg.header.segments)

    def take(self, msg: wire.DecodedChunk, t_recv: float) -> None:
        h = msg.header
        if h.layers != self.layers:
            raise CorecapError(f"worker sent layers {h.layers}, expected {self.layers}")
        offset = 0
        for seg in h.segments:
            lo, hi = offset, offset + seg.num_tokens
            offset = hi
            p = self.pending.get(seg.req_id)
            if p is None:
                raise CorecapError(f"worker sent states for unknown request {seg.req_id!r}")
            positions = msg.positions[lo:hi]
            start = int(positions[0])
            if not np.array_equal(positions, np.arange(start, start + seg.num_tokens)) or start + seg.num_tokens > len(p.token_ids):
                raise CorecapError(
                    f"sample {p.key!r}: received positions {start}..{int(positions[-1])}, "
                    f"not a contiguous run inside its {len(p.token_ids)} tokens"
                )
            if not np.array_equal(msg.token_ids[lo:hi], p.token_ids[start : start + seg.num_tokens]):
                raise CorecapError(f"sample {p.key!r}: received token ids differ from the sample's at positions {start}..")
            if p.states is None:
                p.states = torch.empty((len(self.layers), len(p.token_ids), h.hidden_size), dtype=msg.states.dtype)
            p.states[:, start : start + seg.num_tokens] = msg.states[:, lo:hi]
            newly = seg.num_tokens - int(p.covered[start : start + seg.num_tokens].sum())
            p.covered[start : start + seg.num_tokens] = True
            p.num_covered += newly
            if p.num_covered == len(p.token_ids):
                del self.pending[seg.req_id]
                self.on_complete(p)
        self.timings.append(ChunkTiming(h.step, h.num_tokens, msg.states.nbytes, h.t_copy, h.t_ready, t_recv, time.time()))
