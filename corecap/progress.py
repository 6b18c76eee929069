"""A progress line on a terminal: one self-rewriting line of counts and rates, silent in logs;
and `Heartbeat`, lines while a long start runs silent.

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


class Heartbeat:
    """Lines while something long runs silent (vLLM's engine start: weights, compilation, KV
    cache, CUDA graphs), so that no run says nothing for more than `interval` seconds: one as
    each phase begins (`phase`, where the caller can tell), and `WHAT: N s, PHASE` after each
    `interval` without one. A context manager; its thread calls `log` (which must be thread-safe)."""

    def __init__(self, what: str, log, interval: float = 15.0):
        import threading

        self.what, self.log, self.interval = what, log, interval
        self.current = ""
        self.start = self.last = time.monotonic()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, daemon=True, name="corecap-heartbeat")

    def phase(self, name: str) -> None:
        with self._lock:
            self.current, self.last = name, time.monotonic()
            self.log(f"{self.what}: {name} ({self.last - self.start:.0f} s)")

    def _beat(self) -> None:
        while not self._stop.wait(min(1.0, self.interval)):
            with self._lock:
                now = time.monotonic()
                if now - self.last >= self.interval:
                    self.last = now
                    self.log(f"{self.what}: {now - self.start:.0f} s" + (f", {self.current}" if self.current else ""))

    def __enter__(self) -> "Heartbeat":
        self.start = self.last = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
