"""A progress line on a terminal: one self-rewriting line of counts and rates, silent in logs.

Used by `corecap run` (samples captured) and `corecap export` (samples written); a leaf that
imports nothing of corecap's, so that any layer may show one.
"""

from __future__ import annotations

import sys
import time


class Progress:
    """One self-rewriting line on a terminal (samples, tokens, tokens/s, MB/s when bytes are
    counted, ETA); silent in logs."""

    def __init__(self, num_samples: int, enabled: bool | None, stream=None):
        self.stream = stream or sys.stderr
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self.total = num_samples
        self.samples = self.tokens = self.nbytes = 0
        self.start = self.last = time.monotonic()

    def update(self, samples: int, tokens: int, nbytes: int = 0) -> None:
        self.samples += samples
        self.tokens += tokens
        self.nbytes += nbytes
        now = time.monotonic()
        if self.enabled and now - self.last >= 0.5:
            self.last = now
            elapsed = now - self.start
            rate = self.tokens / elapsed
            written = f", {self.nbytes / 1e6 / elapsed:,.0f} MB/s" if self.nbytes else ""
            left = elapsed / self.samples * (self.total - self.samples) if self.samples else float("nan")
            self.stream.write(
                f"\r{self.samples}/{self.total} samples, {self.tokens} tokens, {rate:,.0f} tokens/s{written}, "
                f"ETA {left:,.0f}s   "
            )
            self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\n")
