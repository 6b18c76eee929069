"""What a run did, in numbers and in its last line (`RunSummary.line`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class RunSummary:
    store: str
    num_samples: int
    num_committed: int
    num_skipped: int
    num_tokens: int
    nbytes: int
    seconds: float
    raw_bytes: int = 0  # the states' size before the codec
    outcomes: str = ""  # the dataset's outcome counts (truncated, skipped, ...)
    num_referring: int = 0  # stored once: samples whose prefix refers to earlier samples' states
    referred_bytes: int = 0  # the raw states those references stand for (not written)
    num_stored_whole: int = 0  # with prefix cache hits, stored whole: their source was not yet committed
    generated: str = ""  # --max-tokens: the responses written, e.g. "1,800 tokens in 23 responses (eos 20, length 3)"
    num_streamed: int = 0  # long samples streamed to disk as their chunks came (corecap/sink/stream.py)
    sink_rss_start: int = 0  # the sink process's resident bytes before its first chunk
    sink_rss_peak: int = 0  # and at its peak (VmHWM)
    buffer_bytes: int = 0  # --buffer-gb: the bound on the sink's buffers for states (corecap/sink/budget.py)
    sink_buffers_peak: int = 0  # the most those buffers held at once: in flight, awaiting commit, free for reuse

    def line(self) -> str:
        rate = self.num_tokens / self.seconds if self.seconds else 0.0
        per_token = self.nbytes / self.num_tokens if self.num_tokens else 0
        ratio = f", codec ratio {self.raw_bytes / self.nbytes:.2f}x" if self.nbytes and self.raw_bytes else ""
        return (
            f"{self.store}: committed {self.num_committed} samples ({self.num_tokens} tokens), "
            f"skipped {self.num_skipped} already stored, {self.nbytes / 1e6:.1f} MB "
            f"({per_token:.0f} B/token{ratio}) in {self.seconds:.1f}s ({rate:.0f} tokens/s)"
            + (f"; generated {self.generated}" if self.generated else "")
            + (f"; input: {self.outcomes}" if self.outcomes else "")
            + (f"; stored once: {self.num_referring} samples refer to earlier ones for their prefix "
               f"({self.referred_bytes / 1e6:.1f} MB of raw states not written), "
               f"{self.num_stored_whole} with cache hits "
               "stored whole (the sample they would refer to was not yet committed)"
               if self.num_referring or self.num_stored_whole else "")
            + (f"; streamed to disk: {self.num_streamed} samples longer than half of --buffer-gb "
               f"(the sink's memory {self.sink_rss_start / 2**20:,.0f} MiB at start, "
               f"{self.sink_rss_peak / 2**20:,.0f} MiB at its peak; --buffer-gb {self.buffer_bytes / 2**20:,.0f} MiB)"
               if self.num_streamed else "")
        )
