"""Long samples: which ones the sink streams to disk instead of holding, and the rows it streams.

The sink holds a sample's states in a buffer from its first chunk until its commit, and the
writer lets one sample larger than --buffer-gb through alone: a 128k-token sample of Kimi-K2.5's
shape (~9 GB of bf16 states) would then cost its whole size in memory. A sample whose states
exceed half of --buffer-gb (`streams`) is reassembled in its spill file instead
(corecap/store/spill.py): each chunk's rows are written there at once, so the sink holds none of
them beyond the chunk itself. Half: the samples held whole then still fit two at a time in the
writer's bound, so encoding one overlaps writing the other.

What a streamed sample cannot do yet, refused before the model loads (corecap/plan.py,
`check_long_samples`): fp8 (the stored layout is not the rows'), a response the model writes
(its length is known only at its end, and the layout depends on it) and vLLM's prefix caching
(the states cache shares views of samples held in memory). Its codec is `raw` whatever
--codec says: zstd-planes compresses byte planes of the whole payload, which a chunk alone
cannot give; each sample names its own codec, so readers need nothing new.
"""

from __future__ import annotations

import numpy as np

from corecap.store.spill import SpillFile


def streams(num_bytes: int, buffer_bytes: int) -> bool:
    """Whether a sample of `num_bytes` of states (in the sink's buffers) streams to disk."""
    return num_bytes > buffer_bytes // 2


class SpilledRows:
    """A streamed sample's rows, addressed as the copy threads address a buffer's `[L, T, row]`
    array (corecap/sink/collect.py `_copy_runs`): `rows[layer, start:end] = src` writes one run,
    `rows[:, position] = src` one token's rows of every layer, each at its place in the spill
    file's `[L, T, row]` layout."""

    def __init__(self, spill: SpillFile, num_layers: int, num_tokens: int, row_bytes: int):
        self.spill = spill
        self.num_layers = num_layers
        self.num_tokens = num_tokens
        self.row_bytes = row_bytes

    def _offset(self, layer: int, position: int) -> int:
        return (layer * self.num_tokens + position) * self.row_bytes

    def __setitem__(self, key: tuple, value: np.ndarray) -> None:
        layer, where = key
        if isinstance(layer, slice):  # [:, position]
            for i in range(self.num_layers):
                self.spill.write(self._offset(i, where), value[i])
        else:  # [layer, start:end]
            self.spill.write(self._offset(layer, where.start), value)
