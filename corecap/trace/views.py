"""`corecap trace --chrome/--plot`: a trace (corecap/trace/timeline.py) as Chrome trace events for
ui.perfetto.dev or chrome://tracing, and as a timeline PNG (matplotlib, imported only here).
"""

from __future__ import annotations

import numpy as np

from corecap.errors import CorecapError
from corecap.trace.analysis import DATA_STAGES, STEP_PHASES, bottleneck, lanes, phase, phases, throughput

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
    for p in (phase(rows, "between steps"), phase(rows, "drain")):
        for a, b in p.intervals:
            if b > a:
                span(p.name, "driver", a, b, driver, 1)
    for name, key, a, b in DATA_STAGES:
        on_worker, base, title, label = CHROME_TRACKS[name]
        pid = worker if on_worker else driver
        records = trace.get(key, [])
        lane_of = lanes([(r[a], r[b]) for r in records])
        for lane in sorted(set(lane_of)):
            meta(pid, base + lane, "thread_name", title + (f" #{lane + 1}" if lane else ""), base + lane)
        for r, lane in zip(records, lane_of):
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


def check_plot(png_path: str | None) -> None:
    """Refuse `--plot` at once where matplotlib is missing: before the table, or a profiling run, is printed."""
    import importlib.util

    if png_path and importlib.util.find_spec("matplotlib") is None:
        raise CorecapError(_NO_MATPLOTLIB)


_NO_MATPLOTLIB = "--plot needs matplotlib (pip install matplotlib)"


def plot(trace: dict, png_path: str, title: str = "") -> None:
    """A timeline PNG: one row per track over time, and each step's phases stacked below."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        raise CorecapError(_NO_MATPLOTLIB) from None

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
        lane_of = lanes(p.intervals)
        num_lanes = max(lane_of) + 1
        height = 0.8 / num_lanes
        for lane in range(num_lanes):
            mine = [(a - t0, b - a) for (a, b), k in zip(p.intervals, lane_of) if k == lane and b > a]
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
        stacks["between steps"] = phase(rows, "between steps").durations * 1e3
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
