"""The trace file: <store>/trace.json, a run's timeline (written by corecap/run.py, read by
`corecap trace`). A leaf: the analysis (corecap/trace/analysis.py) and pictures
(corecap/trace/views.py) sit above it.

trace.json is {"version": 1, "start", "end", "steps", "chunks", "encodes", "writes", "commits",
"workers", "sink"}, all times time.time() seconds (one clock: the driver and its workers share a host).
Steps are the driver's schedule → execute_model → sample_tokens → update_from_output (workers:
each worker's own counts, `corecap_stats`); chunks are one engine step's capture on its way
worker copy (t_copy → t_ready) → wire (→ t_recv) → reassembly (→ t_done); encodes are the
samples' checksums and compression; writes put a batch of states into the state files; commits
make a batch durable (fdatasync, then the LMDB transaction of its headers); sink is the sink
process's memory in bytes: its bound (--buffer-gb), the most its buffers for states held at once,
and its resident memory before its first chunk and at its peak (optional: none in older traces).
"""

from __future__ import annotations

import json
import os
import stat

import msgspec

from corecap.errors import CorecapError

TRACE_VERSION = 1
TRACE_FILE = "trace.json"
_FIELDS = {
    "steps": ("start", "schedule", "execute", "sample", "update", "end", "num_tokens"),
    "chunks": ("t_copy", "t_ready", "t_recv", "t_done", "nbytes", "num_tokens"),
    "commits": ("start", "end", "num_samples", "nbytes"),
    "encodes": ("start", "end"),  # optional: traces before the codec timing have none
    "writes": ("start", "end", "num_samples", "nbytes"),  # optional: none before the state files
}
# Every number in a trace is a time (seconds since the epoch) or a count: finite and well below
# 2^53 (exact in a float), so that differences and microseconds (the Chrome view) stay finite.
_MAX_NUMBER = 2**53


def write_trace(store_path: str, start: float, end: float, steps, chunks, commits, encodes=(), writes=(),
                workers=(), sink: dict | None = None) -> None:
    """The run's timeline, next to the data: <store>/trace.json, written whole or not at all."""
    record = {
        "version": TRACE_VERSION,
        "start": start,
        "end": end,
        "steps": steps,
        "chunks": chunks,
        "commits": commits,
        "encodes": list(encodes),
        "writes": list(writes),
        "workers": list(workers),
        "sink": dict(sink or {}),
    }
    tmp = os.path.join(store_path, "trace.json.tmp")
    with open(tmp, "wb") as f:
        f.write(msgspec.json.encode(record))
    os.replace(tmp, os.path.join(store_path, TRACE_FILE))


def load_trace(store_path: str) -> dict:
    """The trace of the run into `store_path` (a store directory, or a trace.json itself),
    checked (`check_trace`): a file that is not a trace of ours is a CorecapError."""
    path = store_path if os.path.isfile(store_path) else os.path.join(store_path, TRACE_FILE)
    try:  # O_NONBLOCK: a FIFO in the file's place must not block
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise CorecapError(f"{store_path}: no {TRACE_FILE} (run `corecap run --store {store_path}` first)") from None
    except OSError as e:
        raise CorecapError(f"{path}: cannot read ({e.strerror})") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise CorecapError(f"{path}: not a regular file, expected a trace")
        with open(fd, "rb", closefd=False) as f:
            raw = f.read()
    except OSError as e:
        raise CorecapError(f"{path}: cannot read ({e.strerror})") from None
    finally:
        os.close(fd)
    try:
        trace = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CorecapError(f"{path}: not valid JSON ({getattr(e, 'msg', e)})") from None
    except RecursionError:
        raise CorecapError(f"{path}: not a trace (JSON nested too deep)") from None
    check_trace(trace, path)
    return trace


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and abs(x) <= _MAX_NUMBER  # False for NaN and infinities too


def check_trace(trace, where: str) -> None:
    """Raise CorecapError naming the first field of `trace` that is not what corecap's analysis
    and pictures read (corecap/trace/analysis.py, views.py); fill in the optional lists."""
    if not isinstance(trace, dict):
        raise CorecapError(f"{where}: expected a JSON object, got {type(trace).__name__}")
    if trace.get("version") != TRACE_VERSION:
        raise CorecapError(f"{where}: trace format version {trace.get('version')!r}, expected {TRACE_VERSION}")
    for key in ("start", "end"):
        if not _is_number(trace.get(key)):
            raise CorecapError(f"{where}: missing number {key!r}")
    trace.setdefault("encodes", [])
    trace.setdefault("writes", [])
    workers = trace.setdefault("workers", [])  # optional: none before worker stats
    if not isinstance(workers, list):
        raise CorecapError(f"{where}: 'workers' is not a list")
    for i, stats in enumerate(workers):
        if not isinstance(stats, dict) or not all(isinstance(stats.get(f), int) for f in ("rank", "steps")):
            raise CorecapError(f"{where}: workers[{i}] lacks integer 'rank' and 'steps'")
        numbers = (["ring_wait_s"] * ("ring_wait_s" in stats)
                   + ["cuda_alloc_retries", "cuda_peak_gb"] * ("cuda_alloc_retries" in stats))
        if not all(_is_number(stats.get(f)) for f in numbers):
            raise CorecapError(f"{where}: workers[{i}] has {', '.join(numbers)}, not all numbers")
    sink = trace.setdefault("sink", {})
    if not isinstance(sink, dict) or not all(_is_number(v) for v in sink.values()):
        raise CorecapError(f"{where}: 'sink' is not an object of numbers")
    for key, fields in _FIELDS.items():
        records = trace.get(key)
        if not isinstance(records, list):
            raise CorecapError(f"{where}: missing list {key!r}")
        for i, record in enumerate(records):
            missing = [f for f in fields if not isinstance(record, dict) or not _is_number(record.get(f))]
            if missing:
                raise CorecapError(f"{where}: {key}[{i}] lacks number {missing[0]!r}")
