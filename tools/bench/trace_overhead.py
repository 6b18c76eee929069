"""What recording the run's timeline (<store>/trace.json) costs: an A/B benchmark.

    CORECAP_CACHE=/tmp/cc python -m tools.bench.trace_overhead                  # 2 runs per arm
    python -m tools.bench.trace_overhead --repeats 3 --copies 40 -- --max-batched-tokens 256

Two parts:
1. In process, no engine: the cost of the records themselves. It times building and appending
   N StepTiming/ChunkTiming/CommitTiming records (what run.py, the collector and the writer do
   per step) and `write_trace` for them, so the per-step cost is known even where the
   end-to-end difference drowns in noise.
2. End to end: `corecap run` on the demo data repeated --copies times (fresh ids, so a longer
   steady state than the 23-sample demo), alternating arm A (tracing on) and arm B (RunConfig.trace=False, set
   in a child that runs the CLI: run.py skips the per-step appends and trace.json), each into a
   fresh store. Capture seconds come from the run's summary line (tokens / tokens/s; model loading
   and engine start are not in it). Arm B must leave no trace.json: if one appears, the
   switch did not reach the run and the comparison is void, which the script says.

It prints a Markdown block to paste into docs/benchmarks.md (command, machine, date, results).
Each end-to-end run starts an engine (~1 min on 2 CPU cores): keep --repeats small.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

from tools.common.child import child_env, command_line

DEFAULT_RUN_ARGS = ["--max-batched-tokens", "64", "--layers", "0,2,8"]
SUMMARY = re.compile(r"committed (\d+) samples \((\d+) tokens\).* \((\d+) tokens/s\)")


def micro(num_steps: int) -> dict:
    """Seconds per record for building + appending the three timing records, and for writing them."""
    from corecap._vllm.engine import StepTiming
    from corecap.sink.collect import ChunkTiming
    from corecap.trace.timeline import write_trace
    from corecap.sink.writer import CommitTiming

    t = time.time()
    steps, chunks, commits = [], [], []
    begin = time.perf_counter()
    for i in range(num_steps):
        s = StepTiming(start=t, schedule=t, execute=t, sample=t, update=t, end=t, num_tokens=64, num_reqs=4)
        s.finished.append(str(i))
        steps.append(s)
        chunks.append(ChunkTiming(
            step=i, num_tokens=64, nbytes=49_152, t_copy=t, t_ready=t, t_recv=t, t_done=time.time(),
        ))
        commits.append(CommitTiming(t, time.time(), 1, 40_000))
    record = (time.perf_counter() - begin) / num_steps
    with tempfile.TemporaryDirectory(prefix="corecap-bench-") as tmp:
        begin = time.perf_counter()
        write_trace(tmp, t, time.time(), steps, chunks, commits)
        write = time.perf_counter() - begin
        size = os.path.getsize(os.path.join(tmp, "trace.json"))
    return {"num_steps": num_steps, "record_us": record * 1e6, "write_s": write, "bytes_per_step": size / num_steps}


def demo_copies(path: str, copies: int) -> int:
    """The demo dataset repeated `copies` times with fresh ids; returns the number of samples."""
    from corecap.demo import demo_data_path

    with open(demo_data_path()) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    with open(path, "w") as f:
        for k in range(copies):
            for i, row in enumerate(rows):
                f.write(json.dumps({**row, "id": f"{row.get('id', i + 1)}-copy{k}"}) + "\n")
    return copies * len(rows)


# Arm B's child: `corecap run` as the CLI parses it, with the frozen RunConfig's `trace` field
# turned off (the CLI has no flag for it; the library's callers set RunConfig.trace=False).
_UNTRACED = """
import dataclasses, sys
from corecap import cli
traced = cli.capture
cli.capture = lambda cfg, **kw: traced(dataclasses.replace(cfg, trace=False), **kw)
cli.main(sys.argv[1:], prog_name="corecap")
"""


def run_once(arm: str, data: str, store: str, run_args: list[str]) -> dict:
    """Arm A: `corecap run` as users run it; arm B: the same with RunConfig.trace=False."""
    args = ["run", "--data", data, "--store", store, *run_args]
    cmd = [sys.executable, "-m", "corecap.cli", *args] if arm == "A" else [sys.executable, "-c", _UNTRACED, *args]
    begin = time.perf_counter()
    proc = subprocess.run(cmd, env=child_env(), capture_output=True, text=True)
    process_s = time.perf_counter() - begin
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        sys.exit(f"arm {arm}: `{shlex.join(cmd)}` failed ({proc.returncode}): {tail}")
    match = SUMMARY.search(proc.stdout)
    if not match:
        sys.exit(f"arm {arm}: no summary line in the output of `{shlex.join(cmd)}`: {proc.stdout.strip()!r}")
    num_samples, num_tokens, rate = (int(g) for g in match.groups())
    return {
        "arm": arm,
        "num_samples": num_samples,
        "num_tokens": num_tokens,
        "tokens_per_s": rate,
        "capture_s": num_tokens / rate if rate else float("nan"),
        "process_s": process_s,
        "traced": os.path.exists(os.path.join(store, "trace.json")),
    }


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    system = f"{platform.system()} {platform.release()}"
    return f"{cpu}, {os.cpu_count()} cores, {system}, Python {platform.python_version()}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2, help="end-to-end runs per arm (default 2)")
    parser.add_argument("--copies", type=int, default=10, help="times the demo data is repeated (default 10)")
    parser.add_argument("--micro-steps", type=int, default=100_000, help="records for the in-process part")
    parser.add_argument("--micro-only", action="store_true", help="skip the end-to-end runs")
    parser.add_argument("run_args", nargs="*",
                        help=f"after --: options for corecap run (default {' '.join(DEFAULT_RUN_ARGS)})")
    args = parser.parse_args()
    run_args = args.run_args or DEFAULT_RUN_ARGS

    m = micro(args.micro_steps)
    lines = [
        f"### Trace overhead ({time.strftime('%Y-%m-%d')})",
        "",
        f"Command: `{command_line()}`; machine: {machine()}.",
        "",
        f"In process: {m['record_us']:.2f} µs per step to build and keep its step, chunk and commit "
        f"records; write_trace for {m['num_steps']:,} steps: {m['write_s']:.2f} s, "
        f"{m['bytes_per_step']:.0f} bytes per step.",
    ]
    if not args.micro_only:
        with tempfile.TemporaryDirectory(prefix="corecap-bench-") as tmp:
            data = os.path.join(tmp, "data.jsonl")
            num_samples = demo_copies(data, args.copies)
            results = []
            for i in range(args.repeats):
                for arm in ("A", "B") if i % 2 == 0 else ("B", "A"):  # alternate: drift hits both arms
                    store = os.path.join(tmp, f"{arm}{i}.lmdb")
                    r = run_once(arm, data, store, run_args)
                    print(f"run {len(results) + 1}: arm {arm} {r['capture_s']:.3f} s capture, "
                          f"{r['tokens_per_s']} tokens/s, trace.json {'written' if r['traced'] else 'absent'}",
                          file=sys.stderr)
                    results.append(r)
        lines += ["", f"End to end: `corecap run {shlex.join(run_args)}` on the demo data x{args.copies} "
                  f"({num_samples} samples), {args.repeats} runs per arm, alternating:", "",
                  "| arm | tracing | capture s (each) | mean s | tokens/s (mean) |", "| --- | --- | --- | --- | --- |"]
        means = {}
        for arm, label in (("A", "on"), ("B", "off (RunConfig.trace=False)")):
            runs = [r for r in results if r["arm"] == arm]
            seconds = [r["capture_s"] for r in runs]
            means[arm] = statistics.mean(seconds)
            rate = statistics.mean(r["tokens_per_s"] for r in runs)
            each = ", ".join(f"{s:.3f}" for s in seconds)
            lines.append(f"| {arm} | {label} | {each} | {means[arm]:.3f} | {rate:,.0f} |")
        overhead = (means["A"] - means["B"]) / means["B"] if means["B"] else float("nan")
        if args.repeats > 1:
            per_arm = [[r["capture_s"] for r in results if r["arm"] == a] for a in "AB"]
            spread = max(max(seconds) - min(seconds) for seconds in per_arm)
            noise = f"the spread within one arm is {spread:.3f} s, so a difference below that is noise."
        else:
            noise = "one run per arm gives no noise estimate: use --repeats 3 or more."
        lines += ["", f"Tracing costs {overhead:+.1%} of capture time (A vs B); {noise}"]
        if any(r["traced"] for r in results if r["arm"] == "B"):
            lines.append("WARNING: arm B wrote trace.json: RunConfig.trace=False did not reach the run, "
                         "both arms traced.")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
