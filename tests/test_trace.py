"""corecap.trace, trace_views and profile.samples_for_steps on synthetic timelines with known
geometry (no vLLM, no model)."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
from click.testing import CliRunner

from corecap.errors import CorecapError
from corecap.probe import samples_for_steps
from corecap.cli import trace
from corecap.trace.analysis import (
    bottleneck,
    critical_path,
    drain_line,
    overlap,
    phases,
    summarize,
    throughput,
    unaccounted,
)
from corecap.trace.timeline import load_trace
from corecap.trace.views import plot, to_chrome

T0 = 1_000.0
SCHEDULE, EXECUTE, SAMPLE, UPDATE, GAP = 0.005, 0.060, 0.010, 0.005, 0.020
STEP = SCHEDULE + EXECUTE + SAMPLE + UPDATE


def synthetic_trace(num_steps: int = 10, drain: float = 0.05, commit: float = 0.003) -> dict:
    """Steps of fixed phases separated by GAP; per step one chunk whose worker copy and wire lie
    inside execute_model, whose reassembly straddles its end, and one commit after it."""
    steps, chunks, commits = [], [], []
    t = T0 + GAP
    for i in range(num_steps):
        s = {"start": t, "schedule": t + SCHEDULE, "execute": t + SCHEDULE + EXECUTE}
        s["sample"] = s["execute"] + SAMPLE
        s["update"] = s["end"] = s["sample"] + UPDATE
        s.update(num_tokens=64, num_reqs=2, finished=[str(i)])
        steps.append(s)
        x = s["execute"]
        chunks.append({"step": i + 1, "num_tokens": 64, "nbytes": 49_152,
                       "t_copy": x - 0.010, "t_ready": x - 0.006, "t_recv": x - 0.005, "t_done": x + 0.005})
        commits.append({"start": x + 0.006, "end": x + 0.006 + commit, "num_samples": 1, "nbytes": 40_000})
        t = s["end"] + GAP
    end = steps[-1]["end"] + drain if steps else T0 + drain
    return {"version": 1, "start": T0, "end": end, "steps": steps, "chunks": chunks, "commits": commits}


def test_driver_rows_sum_to_wall_time():
    t = synthetic_trace()
    rows = {p.name: p for p in phases(t)}
    wall = t["end"] - t["start"]
    serial = sum(p.total for p in rows.values() if p.serial)
    assert serial == pytest.approx(wall, abs=1e-9)
    assert rows["execute_model"].total == pytest.approx(10 * EXECUTE)
    assert rows["between steps"].total == pytest.approx(10 * GAP)
    assert rows["drain"].total == pytest.approx(0.05)
    assert len(rows["between steps"].intervals) == 10


def test_no_step_unaccounted():
    t = synthetic_trace()
    assert max(abs(x) for x in unaccounted(t)) < 1e-9
    t["steps"][3]["end"] += 0.002  # driver work after update_from_output that no phase timed
    assert unaccounted(t)[3] == pytest.approx(0.002)
    assert sum(p.total for p in phases(t) if p.serial) == pytest.approx(t["end"] - t["start"])


def test_throughput_steady_state_drops_ends():
    t = synthetic_trace(num_steps=20)
    t["steps"][0]["num_tokens"] = 1  # warm-up and tail steps do not count in steady state
    t["steps"][-1]["num_tokens"] = 1
    rate = throughput(t)
    assert rate["steady_steps"] == (3, 18)
    span = t["steps"][17]["end"] - t["steps"][2]["start"]
    assert rate["steady_tokens_per_s"] == pytest.approx(16 * 64 / span)
    assert rate["tokens_per_s"] == pytest.approx((18 * 64 + 2) / (t["end"] - t["start"]))
    assert rate["store_bytes"] == 20 * 40_000


def test_bottleneck_is_the_forward_pass():
    line = bottleneck(synthetic_trace())
    assert line.startswith("bottleneck: execute_model")
    assert "\n" not in line


def test_bottleneck_is_a_saturated_store():
    # Commits of a whole step's length: the writer is busy all the time.
    t = synthetic_trace(commit=STEP + GAP)
    t["commits"][-1]["end"] = t["end"]
    assert bottleneck(t).startswith("bottleneck: store commit")


def test_a_thread_pool_is_saturated_only_when_all_its_threads_are_busy():
    t = synthetic_trace()
    start, end = t["start"], t["end"]
    half = (end - start) / 2
    # Two encoders, one busy all the time, the other half of it: at least one always busy.
    t["encodes"] = [{"start": start, "end": end}, {"start": start, "end": start + half}]
    line = bottleneck(t)
    assert not line.startswith("bottleneck: codec") and "codec at 75%" in line
    t["encodes"].append({"start": start + half, "end": end})  # now both, all the time
    assert bottleneck(t).startswith("bottleneck: codec (checksums and compression), busy 100%")


def test_bottleneck_is_the_drain():
    t = synthetic_trace(num_steps=2, drain=2.0)
    t["commits"].append({"start": t["steps"][-1]["end"] + 0.1, "end": t["end"] - 0.1, "num_samples": 5, "nbytes": 1})
    path = critical_path(t)
    assert path["drain: store commit"] == pytest.approx(1.8)
    assert path["drain: waiting"] == pytest.approx(0.2)
    assert sum(path.values()) == pytest.approx(t["end"] - t["start"])
    assert bottleneck(t).startswith("bottleneck: drain: store commit")


def test_overlap_of_data_path_with_forward():
    """Inside = while the workers compute: the driver in execute_model or waiting in sample_tokens."""
    t = synthetic_trace(num_steps=4)
    inside, busy = overlap(t)
    # Per step, ms from the end of execute_model: copy [-10,-6] inside execute_model, reassembly
    # [-5,+5] across it into sample_tokens [0,+10], commit [+6,+9] inside sample_tokens.
    assert busy == pytest.approx(4 * 0.017)
    assert inside == pytest.approx(4 * 0.017)
    for c in t["commits"]:  # [+26,+29]: after update_from_output, between steps
        c["start"] += 0.020
        c["end"] += 0.020
    inside, busy = overlap(t)
    assert busy == pytest.approx(4 * 0.017) and inside == pytest.approx(4 * 0.014)


def test_summarize_names_every_row():
    text = summarize(synthetic_trace())
    for row in ("schedule", "execute_model", "sample_tokens", "update_from_output", "unaccounted",
                "between steps", "drain", "total", "worker copy", "wire", "reassembly", "store commit"):
        assert f"  {row} " in text
    assert "tokens/s:" in text and "MB/s" in text and "overlap:" in text
    assert len([line for line in text.splitlines() if line.startswith("bottleneck:")]) == 1
    total = next(line for line in text.splitlines() if line.strip().startswith("total"))
    assert "100.0" in total


def test_summarize_says_its_tokens_are_the_computed_ones():
    """A step's tokens are the scheduled ones (_vllm/engine.py: total_num_scheduled_tokens): a
    prefix-cached store's `corecap run` line counts more, the stored tokens; the line says why."""
    trace = synthetic_trace()
    first = summarize(trace).splitlines()[0]
    computed = sum(s["num_tokens"] for s in trace["steps"])
    assert first.startswith(f"{len(trace['steps'])} steps, {computed} tokens computed (prefix-cache hits are not: "
                            "`corecap run` counts every stored token), "), first


def test_summarize_without_steps():
    t = synthetic_trace(num_steps=0)
    assert "0 steps" in summarize(t)
    assert bottleneck(t).startswith("bottleneck: drain: waiting")


def test_chrome_trace_events_are_complete():
    t = synthetic_trace()
    text = json.dumps(to_chrome(t))
    events = json.loads(text)["traceEvents"]
    assert events
    for e in events:
        assert {"name", "ph", "ts", "pid", "tid"} <= e.keys(), e
        if e["ph"] == "X":
            assert isinstance(e["dur"], int) and e["dur"] >= 0 and e["ts"] >= 0
    names = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert {"step loop", "worker copy", "wire", "collector (reassembly)", "committer (fdatasync + LMDB)"} <= names
    assert len({e["pid"] for e in events}) == 2  # driver and worker processes
    steps = [e for e in events if e["ph"] == "X" and e["name"].startswith("step ")]
    assert len(steps) == 10


def test_chrome_phases_nest_inside_their_step():
    events = to_chrome(synthetic_trace())["traceEvents"]
    xs = [e for e in events if e["ph"] == "X" and e["pid"] == 1 and e["tid"] == 1]
    steps = [e for e in xs if e["name"].startswith("step ")]
    for name in ("schedule", "execute_model", "sample_tokens", "update_from_output"):
        for step, phase in zip(steps, [e for e in xs if e["name"] == name]):
            assert step["ts"] <= phase["ts"] and phase["ts"] + phase["dur"] <= step["ts"] + step["dur"]


def test_chrome_overlapping_chunks_get_their_own_tracks():
    t = synthetic_trace(num_steps=3)
    for c in t["chunks"]:  # every chunk in flight until the end: three at once
        c["t_recv"] = t["end"]
    events = to_chrome(t)["traceEvents"]
    wire_tids = {e["tid"] for e in events if e["ph"] == "X" and e["name"].startswith("wire ")}
    assert len(wire_tids) == 3


def test_plot_writes_a_picture(tmp_path):
    import matplotlib.image

    path = tmp_path / "trace.png"
    plot(synthetic_trace(), str(path), title="synthetic")
    raw = path.read_bytes()
    assert raw[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(raw) > 20_000
    pixels = matplotlib.image.imread(str(path))
    assert pixels.shape[0] > 500 and pixels.shape[1] > 1000
    assert float(np.var(pixels[..., :3])) > 0.01  # not one color


def test_plot_bins_many_steps(tmp_path):
    path = tmp_path / "long.png"
    plot(synthetic_trace(num_steps=1000), str(path))
    assert path.stat().st_size > 20_000


def test_load_trace_missing(tmp_path):
    store = str(tmp_path / "nothing.lmdb")
    with pytest.raises(CorecapError,
                       match=r"nothing.lmdb: no trace.json \(run `corecap run --store .*nothing.lmdb` first\)"):
        load_trace(store)


def test_load_trace_rejects_other_versions(tmp_path):
    (tmp_path / "trace.json").write_text(json.dumps({**synthetic_trace(), "version": 2}))
    with pytest.raises(CorecapError, match="trace format version 2, expected 1"):
        load_trace(str(tmp_path))


def test_load_trace_names_a_bad_record(tmp_path):
    t = synthetic_trace()
    del t["chunks"][4]["t_recv"]
    (tmp_path / "trace.json").write_text(json.dumps(t))
    with pytest.raises(CorecapError, match=r"chunks\[4\] lacks number 't_recv'"):
        load_trace(str(tmp_path))


def test_load_trace_accepts_the_file_itself(tmp_path):
    (tmp_path / "trace.json").write_text(json.dumps(synthetic_trace()))
    assert load_trace(str(tmp_path / "trace.json"))["version"] == 1


def test_samples_for_steps():
    assert samples_for_steps([], 5, 4, None) == 20
    # Budget 64, samples of 100 tokens: one finishes about every 1.6 steps.
    assert samples_for_steps([100] * 50, 10, 4, 64) == 6
    # Short samples: --batch limits a step, not the budget.
    assert samples_for_steps([10] * 50, 3, 4, 1000) == 12
    assert samples_for_steps([10] * 5, 100, 4, 1000) == 5  # the data runs out


def test_cli_prints_table_and_writes_files(tmp_path):
    (tmp_path / "trace.json").write_text(json.dumps(synthetic_trace()))
    chrome, png = tmp_path / "c.json", tmp_path / "t.png"
    result = CliRunner().invoke(trace, ["--store", str(tmp_path), "--chrome", str(chrome), "--plot", str(png)])
    assert result.exit_code == 0, result.output
    assert "bottleneck: execute_model" in result.output
    assert json.loads(chrome.read_text())["traceEvents"]
    assert png.stat().st_size > 20_000


def test_cli_plot_without_matplotlib_says_so_before_the_table(tmp_path, monkeypatch):
    (tmp_path / "trace.json").write_text(json.dumps(synthetic_trace()))
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what an environment without it imports
    result = CliRunner().invoke(trace, ["--store", str(tmp_path), "--plot", str(tmp_path / "t.png")])
    assert result.exit_code == 2
    assert result.output.splitlines() == ["corecap: error: --plot needs matplotlib (pip install matplotlib)"]
    result = CliRunner().invoke(trace, ["--store", str(tmp_path), "--steps", "3", "--plot", str(tmp_path / "t.png")])
    assert result.output.splitlines() == ["corecap: error: --plot needs matplotlib (pip install matplotlib)"]


def test_cli_errors_are_one_line(tmp_path):
    result = CliRunner().invoke(trace, ["--store", str(tmp_path / "none.lmdb")])
    assert result.exit_code == 2
    assert result.output.strip().count("\n") == 0 and "corecap: error:" in result.output
    result = CliRunner().invoke(trace, ["--store", str(tmp_path), "--batch", "8"])
    assert result.exit_code == 2 and "--batch applies only with --steps" in result.output
    result = CliRunner().invoke(trace, ["--store", str(tmp_path), "--steps", "3"])
    assert result.exit_code == 2 and "--store and --steps exclude each other" in result.output


def test_codec_time_is_a_data_path_row():
    trace = synthetic_trace(num_steps=10)
    trace["encodes"] = [{"start": T0 + 0.01 * i, "end": T0 + 0.01 * i + 0.002} for i in range(10)]
    rows = {p.name: p for p in phases(trace)}
    assert len(rows["codec"].intervals) == 10
    assert abs(rows["codec"].total - 0.02) < 1e-9
    assert "codec" in summarize(trace)
    names = {e["name"] for e in to_chrome(trace)["traceEvents"]}
    assert "encode" in names


def test_drain_line_times_each_stage_from_the_last_step():
    t = synthetic_trace(num_steps=3, drain=0.5)
    last = t["steps"][-1]["end"]
    t["encodes"] = [{"start": last, "end": last + 0.25}]
    t["writes"] = [{"start": last + 0.25, "end": last + 0.3, "num_samples": 1, "nbytes": 1}]
    t["commits"].append({"start": last + 0.3, "end": last + 0.45, "num_samples": 1, "nbytes": 1})
    # the last chunk's reassembly ended 5 ms after its step's execute_model: 10 ms before the step's end
    assert drain_line(t) == (
        "after the last step: 0.500 s to the end; last reassembly -0.010, last encode +0.250, "
        "last write +0.300, last commit +0.450 s"
    )
    assert drain_line(t) in summarize(t).splitlines()
    assert drain_line(synthetic_trace(num_steps=0)) == "after the last step: no step"
