"""How long `corecap run`'s pass over the input takes per image, before the model loads: each
image row is rendered and expanded by the model's own processor (vLLM's, as it will run it), so
that lengths, masks and a resume's check are known before any weight loads.

    python3 -m tools.bench.image_check [--rows 40,200] [--dir DIR]

`corecap run` on N rows of one 448 x 448 PNG and 512 tokens of text each (tools/gpu/images.py's
rows and its kimi-h100 checkpoint: Kimi-K2.5's vision processor and tokenizer as released, no
weights, `--load-format dummy`), timed from its engine line (vLLM's configuration built) to the
data line it prints once the pass is over; the run is then stopped, before the model loads. The
per-image figure is the slope between the two row counts (the pass's fixed cost, e.g. the
processor's kernels compiled on first use, drops out).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time

from tools.common.child import child_env
from tools.gpu import images


def pass_seconds(model: str, data: str, store: str) -> float:
    """Seconds from `corecap run`'s engine line to its data line."""
    shutil.rmtree(store, ignore_errors=True)
    proc = subprocess.Popen([sys.executable, "-m", "corecap.cli", "run", "--model", model, "--data", data,
                             "--store", store, "--load-format", "dummy", "--dtype", "bfloat16", "--no-progress"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child_env(),
                            start_new_session=True)
    start = None
    try:
        for line in proc.stdout:
            if line.startswith("engine: "):
                start = time.monotonic()
            elif line.startswith(data + ":") and start is not None:
                print(line.rstrip(), flush=True)
                return time.monotonic() - start
        raise SystemExit(f"corecap run ended (exit {proc.wait()}) before its data line")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="40,200", help="two row counts")
    ap.add_argument("--dir", default="/tmp/corecap-image-check")
    args = ap.parse_args()
    few, many = map(int, args.rows.split(","))
    model = os.path.join(args.dir, "kimi-kimi-h100")
    if not os.path.exists(os.path.join(model, "config.json")):
        model = images.checkpoint(args.dir, "kimi-h100")
    seconds = {}
    for n in (few, many):
        data = images.write_rows(os.path.join(args.dir, f"rows-{n}"), model, n, 512)
        seconds[n] = pass_seconds(model, data, os.path.join(args.dir, f"store-{n}"))
        print(f"{n} rows: the pass took {seconds[n]:.1f} s", flush=True)
    per_image = (seconds[many] - seconds[few]) / (many - few)
    print(f"per image (448 x 448, 512 tokens of text): {per_image * 1e3:.1f} ms", flush=True)


if __name__ == "__main__":
    main()
