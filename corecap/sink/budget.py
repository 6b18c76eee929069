"""The sink's memory for states, one bound (--buffer-gb) that the driver keeps by admission.

Every sample the sink holds (corecap/sink/pending.py, `Pending.buffer`) has one buffer of its
whole length (a response's: prompt + --max-tokens) from its first chunk until its commit: while
its states arrive, while the model writes its response, and while it waits in the writer's
queue. So the driver reserves a sample's buffer when it adds the request and gets it back only
when the sink has committed the sample (`Released`, which the sink's commit thread counts up);
a request waits while the buffers of those held, its own included, would not fit. The writer
still encodes and writes in its own threads, ahead of the engine, within that same bound; the
buffer pool's free buffers are kept within it too (corecap/sink/buffers.py). A sample of given
tokens that streams to disk (corecap/sink/stream.py) holds no buffer and reserves none. At least
one sample is always admitted. `corecap serve` with prefix caching admits within --buffer-gb less
the most its prefix cache's copies of blocks may take (corecap/serve/engine_loop.py), an
aborted sample's reservation coming back once the sink has dropped it.

Why at admission and not in the sink: a sample's buffer is taken at its first chunk, and a sink
that waited for room there would stop reading the very chunks that complete the samples holding
it (the responses being written): only the driver can wait without stopping them.
"""

from __future__ import annotations

import multiprocessing

from corecap.sink import stream
from corecap.sink.buffers import size_class


class Released:
    """What the sink has given back, shared with the driver: bytes and samples, counted up by
    the sink's commit thread (its one writer) and read by the driver at each admission."""

    def __init__(self):
        self.counts = multiprocessing.get_context("spawn").RawArray("q", 2)  # bytes, samples

    def add(self, num_bytes: int) -> None:
        self.counts[0] += num_bytes
        self.counts[1] += 1

    @property
    def num_bytes(self) -> int:
        return self.counts[0]

    @property
    def num_samples(self) -> int:
        return self.counts[1]


class StatesBudget:
    """The driver's side of --buffer-gb: which requests the sink has room for now."""

    def __init__(self, budget_bytes: int, token_bytes: int, released: Released, bound: str | None = None):
        """`bound`: what the bound is, as the end line says it (default: --buffer-gb and its value)."""
        self.budget_bytes = budget_bytes
        self.token_bytes = token_bytes
        self.released = released
        self.reserved_bytes = 0  # ever reserved: what is held is this less what the sink released
        self.num_reserved = 0
        self.num_waits = 0  # times a request waited for room
        self.most_held = 0  # samples held at once, at most
        self.bound = bound or f"--buffer-gb {budget_bytes / 2**30:g}"

    def cost(self, num_tokens: int, final: bool) -> int:
        """The buffer a sample of `num_tokens` (a response's: prompt + --max-tokens) takes in the
        sink; 0 for one of given tokens (`final`) that streams to disk instead."""
        nbytes = num_tokens * self.token_bytes
        return 0 if final and stream.streams(nbytes, self.budget_bytes) else size_class(nbytes)

    @property
    def held_bytes(self) -> int:
        return self.reserved_bytes - self.released.num_bytes

    @property
    def num_held(self) -> int:
        return self.num_reserved - self.released.num_samples

    def fits(self, num_bytes: int) -> bool:
        return self.num_held == 0 or self.held_bytes + num_bytes <= self.budget_bytes

    def reserve(self, num_bytes: int) -> None:
        self.reserved_bytes += num_bytes
        self.num_reserved += 1
        self.most_held = max(self.most_held, self.num_held)

    def line(self, peak_bytes: int | None = None) -> str:
        """Said at the end of a run (or a server's) where the bound held requests back;
        `peak_bytes`: the most the sink's buffers held at once (its pool's high-water mark), where
        known."""
        if not self.num_waits:
            return ""
        peak = "" if peak_bytes is None else f"{peak_bytes / 2**20:,.1f} MiB of buffers at the most, "
        return (
            f"samples in the sink: at most {self.most_held} at once (being written or awaiting their commit), "
            f"{peak}held to {self.bound} ({self.token_bytes} bytes a token in the "
            f"sink's buffers; {self.num_waits} requests waited for room); a larger --buffer-gb lets more run at once"
        )
