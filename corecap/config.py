"""Run configuration: built once from the CLI options, frozen, passed down."""

from __future__ import annotations

import os
from dataclasses import dataclass

from corecap import CorecapError
from corecap.codec import DEFAULT_CODEC


@dataclass(frozen=True)
class RunConfig:
    model: str | None = None  # None: the built-in demo model
    data: str | None = None  # None: the built-in demo dataset
    store: str = "corecap.lmdb"
    layers: tuple[int, ...] | None = None  # None: default_layers(N)
    tp: int = 1
    batch: int = 4
    max_len: int = 2048
    max_batched_tokens: int | None = None
    dtype: str = "auto"
    load_format: str = "auto"
    enforce_eager: bool = False
    memory_utilization: float | None = None
    stall_timeout: float = 600.0  # seconds without progress before a run is declared hung
    codec: str = DEFAULT_CODEC  # see corecap/codec.py; store.FP8 for lossy fp8
    nonfinite: str = "stop"  # NaN/Inf in captured states: "stop" the run, or "store" and flag
    overflow: str = "error"  # samples longer than max_len: error, truncate or skip (corecap/data.py)
    invalid: str | None = None  # invalid rows: error or skip (default: skip under overflow=skip)
    shard: tuple[int, int] | None = None  # (K, N): only the keys whose stable hash mod N is K
    progress: bool | None = None  # None: a progress line when stderr is a terminal
    buffer_bytes: int = 4 << 30  # states awaiting commit before the capture waits for the disk
    encode_threads: int = min(8, max(2, (os.cpu_count() or 2) // 2))  # sink: checksums, compression


def parse_layers(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise CorecapError(f"--layers {text!r}: expected comma-separated integers, e.g. 2,16,29,32") from None


def default_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's three (2, N//2, N-3) plus the final hidden state, clipped and de-duplicated."""
    return tuple(sorted({min(max(k, 0), num_layers) for k in (2, num_layers // 2, num_layers - 3, num_layers)}))


def resolve_layers(layers: tuple[int, ...] | None, num_layers: int) -> tuple[int, ...]:
    if layers is None:
        return default_layers(num_layers)
    if not layers:
        raise CorecapError("--layers: no layer given")
    bad = [k for k in layers if not 0 <= k <= num_layers]
    if bad:
        raise CorecapError(f"--layers: index {bad[0]} is outside 0..{num_layers} (the model has {num_layers} layers)")
    return tuple(sorted(set(layers)))
