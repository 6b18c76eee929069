"""The sink's memory over one `corecap run --max-tokens 256` on the demo model (every layer, as
tools/bench/generate_memory.py runs it): /proc/PID/status's VmRSS, RssAnon, RssFile and RssShmem
(MiB) of every `spawn_main` child of the run every 0.1 s, as JSON rows [t, rss, anon, file, shmem].
Before a vLLM worker titles itself VLLM::Worker it is such a child too (its import, ~665 MiB on
the CPU, in the first seconds); the sink is the one that lives to the end.

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
from tools.common.child import child_env
from tools.common.generation import Setup, corecap_command

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
    rows = []
    while proc.poll() is None:
        try:
            children = [c for c in root.children(recursive=True) if "spawn_main" in " ".join(c.cmdline())]
        except psutil.Error:
            children = []
        for child in children:
            mib = status_mib(child.pid)
            if mib is not None:
                rows.append([round(time.time() - t0, 2), *mib])
        time.sleep(0.1)
    _, stderr = proc.communicate()
    shutil.rmtree(store, ignore_errors=True)
    with open(out, "w") as f:
        json.dump({"cols": ["t", "rss", "anon", "file", "shmem"], "rows": rows, "tail": stderr.splitlines()[-4:]}, f)
    peak = max(rows, key=lambda r: r[1])
    print("peak rss row", peak, "peak anon", max(r[2] for r in rows), "n", len(rows))


if __name__ == "__main__":
    main()
