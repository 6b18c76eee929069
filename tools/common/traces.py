"""Rates from a run's trace (the store's trace.json, corecap/trace/timeline.py): "capture" ends when
the last sample was reassembled, "durable" at the last commit, "steps" at the last engine step's
end. Each is measured from `start`, the trace's own start or its first engine step."""

from __future__ import annotations

import json
import os


def load(store: str) -> dict:
    with open(os.path.join(store, "trace.json")) as f:
        return json.load(f)


def rates(trace: dict, num_tokens: int, since: str = "first_step") -> dict:
    """tokens/s and seconds of the three clocks, over `num_tokens` (the samples' tokens; with
    prefix caching the engine computes fewer: `computed_tokens`). since: "first_step" or "start"."""
    start = trace["steps"][0]["start"] if since == "first_step" else trace["start"]
    capture_end = max(c["t_done"] for c in trace["chunks"])
    durable_end = max(c["end"] for c in trace["commits"])
    steps_end = trace["steps"][-1]["end"]
    return {
        "capture_tok_s": num_tokens / (capture_end - start), "durable_tok_s": num_tokens / (durable_end - start),
        "steps_tok_s": num_tokens / (steps_end - trace["steps"][0]["start"]),
        "capture_s": capture_end - start, "durable_s": durable_end - start,
        "computed_tokens": sum(s["num_tokens"] for s in trace["steps"]),
        "committed_bytes": sum(c["nbytes"] for c in trace["commits"]),
    }
