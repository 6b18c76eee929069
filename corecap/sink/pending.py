"""A sample the sink is reassembling (corecap/sink/collect.py): its token ids, where its states
go (a buffer of the pool, or a long sample's spill file), which of its positions have come, and
with prefix caching its blocks' hashes, its cache hits and its own producer entry."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from corecap.sink.prefix_cache import Producer
from corecap.store.spill import SpillFile


@dataclass(kw_only=True)
class Pending:
    """One sample being reassembled (`Collector.pending`)."""

    key: str
    token_ids: np.ndarray
    loss_mask: np.ndarray | None
    states: torch.Tensor | None = None
    rows: np.ndarray | None = None  # `states` as bytes, uint8 [L, capacity, bytes a row]; or a long sample's file
    spill: SpillFile | None = None  # a long sample's states, streamed to disk (sink/stream.py); `states` None
    covered: np.ndarray = field(default=None)  # bool [T]
    num_covered: int = 0
    block_hashes: list[bytes] | None = None  # vLLM's, of each full block (prefix caching on)
    producer: Producer | None = None  # this sample as others' source (prefix caching on)
    num_hits: int = 0  # leading blocks vLLM took from its prefix cache
    sources: dict[int, Producer] = field(default_factory=dict)  # hit block → the sample that produced it
    # hit block → its producer's states (a view), not yet copied
    held: dict[int, torch.Tensor] = field(default_factory=dict)
    # A response the model writes: positions [len(token_ids), capacity) are its, received before
    # the driver says which tokens it holds (`Collector.generated`); their ids as received.
    capacity: int = 0
    received: np.ndarray | None = None  # int32 [capacity]
    generation: object = None  # store.Generation, once the response is known
    final: bool = True  # token_ids is the whole sample
    media: object = None  # store.Media: the sample's images
    reserved: int = 0  # bytes of --buffer-gb the driver holds for it until its commit (sink/budget.py)
    # Aborted (`Collector.forget`) while the states of its first `until` positions are on their
    # way: kept for the blocks they complete, never handed on
    until: int | None = None

    def cover(self, start: int, num_tokens: int) -> None:
        if num_tokens == 1:  # a decode step's token: numpy's slice sum costs more than the check
            self.num_covered += not self.covered[start]
            self.covered[start] = True
            return
        self.num_covered += num_tokens - int(self.covered[start : start + num_tokens].sum())
        self.covered[start : start + num_tokens] = True

    def buffer(self, num_layers: int, hidden_size: int, dtype: torch.dtype, buffers) -> torch.Tensor:
        if self.states is None:
            shape = (num_layers, self.capacity, hidden_size)
            self.states = buffers.take(shape, dtype) if buffers else torch.empty(shape, dtype=dtype)
            self.rows = self.states.view(torch.uint8).numpy().reshape(num_layers, self.capacity, -1)
        return self.states

    def stored_states(self) -> torch.Tensor:
        """The states of the sample's tokens (a response's buffer may hold room for more)."""
        return self.states if self.states.shape[1] == len(self.token_ids) else self.states[:, : len(self.token_ids)]
