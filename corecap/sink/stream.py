"""Long samples: which ones the sink streams to disk instead of holding, and the rows it streams.

The sink holds a sample's states in a buffer from its first chunk until its commit, and the
driver lets one sample larger than --buffer-gb through alone (corecap/sink/budget.py): a
128k-token sample of Kimi-K2.5's shape (~9 GB of bf16 states) would then cost its whole size in
memory. A sample whose states exceed half of --buffer-gb (`streams`) is reassembled in its spill
file instead (corecap/store/spill.py): each chunk's rows are written there at once, so the sink
holds none of them beyond the chunk itself, and the driver reserves no room for it. Half: the
samples held whole then still fit two at a time in the bound, so encoding one overlaps writing
the other.

What a streamed sample cannot do yet: vLLM's prefix caching (the states cache shares views of
samples held in memory), refused before the model loads (corecap/plan.py, `check_long_samples`);
and a response the model writes (its length, and so its layout, is known only at its end) is held
whole instead. Its codec is `raw` whatever --codec says: zstd-planes compresses byte planes of
the whole payload, which a chunk alone cannot give; each sample names its own codec, so readers
need nothing new. fp8 (`--store-dtype fp8`) streams as it is stored: codes, then scales.
"""

from __future__ import annotations

import numpy as np

from corecap.store.fp8rows import ROW_EXTRA
from corecap.store.spill import SpillFile


def streams(num_bytes: int, buffer_bytes: int) -> bool:
    """Whether a sample of `num_bytes` of states (in the sink's buffers) streams to disk."""
    return num_bytes > buffer_bytes // 2


class SpilledRows:
    """A streamed sample's rows, addressed as the copy threads address a buffer's `[L, T, row]`
    array (corecap/sink/collect.py `_copy_runs`): `rows[layer, start:end] = src` writes one run,
    `rows[:, position] = src` one token's rows of every layer, each at its place in the spill
    file's layout: `[L, T, H]` states, or with `fp8` (the workers' rows of H codes and a float32
    scale, corecap/store/fp8rows.py) the stored fp8 payload, codes `[L, T, H]` then scales `[L, T]`."""

    def __init__(self, spill: SpillFile, num_layers: int, num_tokens: int, row_bytes: int, fp8: bool = False):
        self.spill = spill
        self.num_layers = num_layers
        self.num_tokens = num_tokens
        self.row_bytes = row_bytes
        self.fp8 = fp8

    def _write(self, layer: int, position: int, rows: np.ndarray) -> None:
        """`rows`: uint8 [n, row] of tokens position.. of this layer."""
        index = layer * self.num_tokens + position
        if not self.fp8:
            self.spill.write(index * self.row_bytes, rows)
            return
        hidden = self.row_bytes - ROW_EXTRA
        self.spill.write(index * hidden, rows[:, :hidden])
        self.spill.write(self.num_layers * self.num_tokens * hidden + index * ROW_EXTRA, rows[:, hidden:])

    def __setitem__(self, key: tuple, value: np.ndarray) -> None:
        layer, where = key
        if isinstance(layer, slice):  # [:, position]
            for i in range(self.num_layers):
                self._write(i, where, value[i : i + 1])
        else:  # [layer, start:end]
            self._write(layer, where.start, value)
