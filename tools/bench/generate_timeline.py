"""The sink's memory over one `corecap run --max-tokens 256` on the demo model (every layer, as
tools/bench/generate_memory.py runs it): /proc/PID/status's VmRSS, RssAnon, RssFile and RssShmem
(MiB) of every child of the run every 0.1 s, kept as JSON rows [t, rss, anon, file, shmem] for the
sink, named by process id: a vLLM worker is a `spawn_main` child too until it titles itself
VLLM::Worker (its import, ~665 MiB on the CPU, in the first seconds), so a pid that ever does is a
worker, and the sink is the `spawn_main` child that never does (tools/common/generation.py,
role_peak_mib). With it, the sink's own figures from the run's trace ("sink": its RSS before its
first chunk, its VmHWM, the most its buffers held; corecap/trace/timeline.py).

    flock /tmp/corecap-engine.lock python -m tools.bench.generate_timeline PROMPTS.jsonl OUT.json \
        [BUFFER_GB|none]
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time

from tools.bench.generate_memory import LAYERS, LENGTHS, default_model
from tools.common import traces
from tools.common.child import child_env
from tools.common.generation import Setup, corecap_command, pid_role, process_role, sink_memory_mib

FIELDS = ("VmRSS", "RssAnon", "RssFile", "RssShmem")


def status_mib(pid: int) -> list[int] | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f)
        return [int(fields[k].split()[0]) // 1024 for k in FIELDS]
    except (OSError, KeyError):
        return None


def main() -> None:
    import psutil

    data, out = sys.argv[1], sys.argv[2]
    buffer_gb = None if len(sys.argv) < 4 or sys.argv[3] == "none" else float(sys.argv[3])
    setup = Setup(model=default_model(), max_tokens=256, layers=LAYERS, max_model_len=LENGTHS[1] + 256,
                  buffer_gb=buffer_gb)
    store = tempfile.mkdtemp(prefix="bench-timeline-")
    t0 = time.time()
    proc = subprocess.Popen(corecap_command(setup, data, store, True), env=child_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    root = psutil.Process(proc.pid)
    rows: dict[int, list] = {}
    roles: dict[int, set[str]] = {}
    while proc.poll() is None:
        try:
            children = root.children(recursive=True)
        except psutil.Error:
            children = []
        for child in children:
            try:
                roles.setdefault(child.pid, set()).add(process_role(f"{child.name()}: {' '.join(child.cmdline())}"))
            except psutil.Error:
                continue
            mib = status_mib(child.pid)
            if mib is not None:
                rows.setdefault(child.pid, []).append([round(time.time() - t0, 2), *mib])
        time.sleep(0.1)
    _, stderr = proc.communicate()
    try:
        own = sink_memory_mib(traces.load(store))
    except OSError:
        own = {}
    shutil.rmtree(store, ignore_errors=True)
    sinks = [pid for pid, seen in roles.items() if pid_role(seen) == "sink"]
    assert len(sinks) == 1, f"expected one sink among the run's children, found {sinks} ({roles})"
    sink = rows[sinks[0]]
    with open(out, "w") as f:
        json.dump({"cols": ["t", "rss", "anon", "file", "shmem"], "rows": sink, "sink_own": own,
                   "tail": stderr.splitlines()[-4:]}, f)
    peak = max(sink, key=lambda r: r[1])
    print("sink peak rss row", peak, "peak anon", max(r[2] for r in sink), "n", len(sink), "its own", own)


if __name__ == "__main__":
    main()
