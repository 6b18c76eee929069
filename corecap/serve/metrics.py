"""What `GET /metrics` shows, in Prometheus' text format (as vLLM's server offers one): requests
by endpoint and status, tokens captured and their rate, the queue, the bytes delivered, with
prefix caching on what vLLM's prefix cache gave, and with --store what is committed there."""

from __future__ import annotations

import collections
import threading
import time

_RATE_WINDOW_S = 10.0  # tokens/s over the last this many seconds


class Metrics:
    def __init__(self):
        self.lock = threading.Lock()
        self.requests: collections.Counter = collections.Counter()  # (endpoint, status) → count
        self.num_tokens = 0  # prompt tokens whose states were delivered
        self.num_step_tokens = 0  # tokens the engine computed
        self.num_bytes = 0  # bytes of states files written
        self.queued = 0  # requests waiting for the engine
        self.running = 0  # requests in the engine or the sink
        self.num_aborted = 0  # requests ended early: their clients went away
        self.steps: collections.deque = collections.deque()  # (time, tokens) of recent steps
        self.kept = None  # with --store: the sink's latest report of its copy (sink.messages.Kept)
        # with prefix caching on (the engine thread sets it after each step): prompt tokens taken
        # from vLLM's prefix cache, blocks evicted from it for corecap's bound, blocks tracked now
        self.prefix: tuple[int, int, int] | None = None

    def answered(self, endpoint: str, status: int) -> None:
        with self.lock:
            self.requests[(endpoint, status)] += 1

    def stepped(self, num_tokens: int) -> None:
        now = time.monotonic()
        with self.lock:
            self.num_step_tokens += num_tokens
            self.steps.append((now, num_tokens))
            while self.steps and now - self.steps[0][0] > _RATE_WINDOW_S:
                self.steps.popleft()

    def aborted(self) -> None:
        with self.lock:
            self.num_aborted += 1

    def delivered(self, num_tokens: int, nbytes: int) -> None:
        with self.lock:
            self.num_tokens += num_tokens
            self.num_bytes += nbytes

    def text(self) -> str:
        now = time.monotonic()
        with self.lock:
            recent = sum(n for t, n in self.steps if now - t <= _RATE_WINDOW_S)
            lines = [
                "# HELP corecap_requests_total Requests answered, by endpoint and HTTP status.",
                "# TYPE corecap_requests_total counter",
                *(f'corecap_requests_total{{endpoint="{e}",status="{s}"}} {n}'
                  for (e, s), n in sorted(self.requests.items())),
                "# HELP corecap_prompt_tokens_total Tokens whose states were delivered.",
                "# TYPE corecap_prompt_tokens_total counter",
                f"corecap_prompt_tokens_total {self.num_tokens}",
                "# HELP corecap_engine_tokens_total Tokens the engine computed.",
                "# TYPE corecap_engine_tokens_total counter",
                f"corecap_engine_tokens_total {self.num_step_tokens}",
                f"# HELP corecap_tokens_per_second Tokens the engine computed per second, over the last "
                f"{_RATE_WINDOW_S:.0f} s.",
                "# TYPE corecap_tokens_per_second gauge",
                f"corecap_tokens_per_second {recent / _RATE_WINDOW_S:.1f}",
                "# HELP corecap_delivered_bytes_total Bytes of states files written for clients.",
                "# TYPE corecap_delivered_bytes_total counter",
                f"corecap_delivered_bytes_total {self.num_bytes}",
                "# HELP corecap_requests_aborted_total Requests ended before their states were written: "
                "their clients went away.",
                "# TYPE corecap_requests_aborted_total counter",
                f"corecap_requests_aborted_total {self.num_aborted}",
                "# HELP corecap_queue_depth Requests waiting for the engine.",
                "# TYPE corecap_queue_depth gauge",
                f"corecap_queue_depth {self.queued}",
                "# HELP corecap_requests_running Requests in the engine, or being written.",
                "# TYPE corecap_requests_running gauge",
                f"corecap_requests_running {self.running}",
            ]
            if self.prefix is not None:
                hits, evicted, tracked = self.prefix
                lines += [
                    "# HELP corecap_prefix_cache_hit_tokens_total Prompt tokens taken from vLLM's prefix cache "
                    "(their states from the server's copy of the block).",
                    "# TYPE corecap_prefix_cache_hit_tokens_total counter",
                    f"corecap_prefix_cache_hit_tokens_total {hits}",
                    "# HELP corecap_prefix_cache_evicted_blocks_total Blocks evicted from vLLM's prefix cache "
                    "for the bound on the blocks the server keeps states of (--prefix-blocks).",
                    "# TYPE corecap_prefix_cache_evicted_blocks_total counter",
                    f"corecap_prefix_cache_evicted_blocks_total {evicted}",
                    "# HELP corecap_prefix_cache_blocks Blocks whose states the server keeps now: the most a "
                    "request may take from vLLM's prefix cache.",
                    "# TYPE corecap_prefix_cache_blocks gauge",
                    f"corecap_prefix_cache_blocks {tracked}",
                ]
            if self.kept is not None:
                lines += _store_lines(self.kept)
        return "\n".join(lines) + "\n"


def _store_lines(kept) -> list[str]:
    return [
        "# HELP corecap_store_samples_total Samples delivered and committed to --store.",
        "# TYPE corecap_store_samples_total counter",
        f"corecap_store_samples_total {kept.num_committed}",
        "# HELP corecap_store_bytes_total Bytes of states committed to --store.",
        "# TYPE corecap_store_bytes_total counter",
        f"corecap_store_bytes_total {kept.nbytes}",
        "# HELP corecap_store_skipped_total Samples delivered but not stored: their key was stored already, "
        "with the same input or another.",
        "# TYPE corecap_store_skipped_total counter",
        f'corecap_store_skipped_total{{input="same"}} {kept.num_same}',
        f'corecap_store_skipped_total{{input="other"}} {kept.num_other}',
        "# HELP corecap_store_failed 1 once a write to --store failed (a full disk): no more samples are stored.",
        "# TYPE corecap_store_failed gauge",
        f"corecap_store_failed {int(bool(kept.failure))}",
    ]
