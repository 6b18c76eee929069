"""`corecap export`'s rate on this machine, against the two things it may be bound by: the disk
(dd's fsync'd sequential write rate, on the same file system) and corecap's decode rate (the
store's samples decoded on the same number of threads, nothing written). Also the same decode
plus the layout's gather and cast (every copy the export makes, minus the file writes), to show
what Python adds, and the export's peak RSS as the store doubles (a fresh process each time).

EAGLE-3-sized samples (tools/common/stores.py): 2,048 tokens x 4 layers x 4,096, bf16,
activation-like.

    flock /tmp/corecap-engine.lock python -m tools.bench.export --format speculators --samples 128 \
        [--workers 2] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from corecap.store import Store, decode_header
from corecap.export import formats as layouts
from corecap.store.codec import DTYPES
from tools.common.child import child_env
from tools.common.disk import dd_rate
from tools.common.stores import HIDDEN, LAYERS, build_store

TOKENS = 2048


def decode_rate(path: str, workers: int, gather: str | None) -> tuple[float, float]:
    """(GB/s of decoded states, samples/s) decoding every sample on `workers` threads as the
    export does (the walking thread reads, a pool decodes); with `gather`, also building that
    format's tensors (the export's copies and casts), never writing them."""
    layout = layouts.LAYOUTS[gather]("/nonexistent") if gather else None
    nbytes = num = 0
    with Store.open(path) as store, store.env.begin(buffers=True) as txn, ThreadPoolExecutor(workers) as pool:
        positions = tuple(range(len(store.meta.layers)))

        def work(key, header, states):
            sample = store.decode(key, header, states)
            if layout is not None:
                _gather(layout, sample, positions)
            return header.payload_bytes

        pending = deque()
        start = time.perf_counter()
        end = store.committed_end(txn)
        for k, header_value in txn.cursor(db=store.headers_db):
            key = bytes(k).decode()
            header = decode_header(key, header_value)
            states = store.states(key, header, txn.get(bytes(k), db=store.samples_db), end)
            pending.append(pool.submit(work, key, header, states))
            while len(pending) >= 2 * workers:
                nbytes += pending.popleft().result()
                num += 1
        while pending:
            nbytes += pending.popleft().result()
            num += 1
        seconds = time.perf_counter() - start
    return nbytes / seconds / 1e9, num / seconds


def _gather(layout, sample, positions) -> None:
    """The layout's own write, into /dev/null: every copy and cast the export makes but the disk's."""
    layout.write("/dev/null", sample.input_ids, np.ones(len(sample.input_ids), np.uint8), sample.hidden_states,
                 positions, DTYPES["bfloat16"])


_CHILD = """
import json, resource, sys, threading, time
from corecap.export import driver as export, formats as layouts
from corecap.store import store

spent = {}  # stage -> seconds summed over the threads that ran it
lock = threading.Lock()

def timed(name, fn):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            with lock:
                spent[name] = spent.get(name, 0.0) + time.perf_counter() - start
    return wrapper

store.Store.decode = timed("decode", store.Store.decode)
export.commit_file = timed("fsync + rename", export.commit_file)
layout = layouts.LAYOUTS[sys.argv[3]]
layout.write = timed("gather + write", layout.write)
store.Store.states = timed("read (walking thread)", store.Store.states)
start = time.perf_counter()
s = export.export_store(sys.argv[1], sys.argv[2], sys.argv[3], workers=int(sys.argv[4]))
print(json.dumps({"seconds": s.seconds, "wall": time.perf_counter() - start, "nbytes": s.nbytes,
                  "samples": s.num_samples,
                  "maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "stage_ms_per_sample": {k: round(v / s.num_samples * 1e3, 1) for k, v in spent.items()}}))
"""


def export_once(store: str, out: str, fmt: str, workers: int) -> dict:
    """One export in a fresh process: its rate and peak RSS."""
    done = subprocess.run([sys.executable, "-c", _CHILD, store, out, fmt, str(workers)], env=child_env(), check=True,
                          capture_output=True, text=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["gb_s"] = result["nbytes"] / result["seconds"] / 1e9
    result["samples_s"] = result["samples"] / result["seconds"]
    shutil.rmtree(out)
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--format", choices=sorted(LAYERS), default="speculators")
    ap.add_argument("--samples", type=int, default=128, help="the larger store; the smaller holds half")
    ap.add_argument("--tokens", type=int, default=TOKENS)
    ap.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1))
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where the store and the export go (one file system)")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="bench-export-", dir=args.dir)
    try:
        store = os.path.join(tmp, "store")
        half = args.samples // 2
        t = time.perf_counter()
        build_store(store, args.format, 0, half, args.tokens)
        shape = f"{args.tokens} x {len(LAYERS[args.format])} x {HIDDEN}"
        print(f"built {half} samples of {shape} bf16 in {time.perf_counter() - t:.0f}s", flush=True)
        sample_bytes = args.tokens * len(LAYERS[args.format]) * HIDDEN * 2
        rows = {}
        rows["dd (before)"] = dd_rate(tmp, min(4 << 30, half * sample_bytes))
        print(f"dd conv=fsync: {rows['dd (before)']:.3f} GB/s", flush=True)
        for name, gather in (("decode", None), ("decode + gather", args.format)):
            gb, per_s = decode_rate(store, args.workers, gather)
            rows[name] = (gb, per_s)
            print(f"{name} ({args.workers} threads): {gb:.3f} GB/s, {per_s:.1f} samples/s", flush=True)
        small = export_once(store, os.path.join(tmp, "out"), args.format, args.workers)
        print(f"export {half} samples: {json.dumps(small)}", flush=True)
        build_store(store, args.format, half, args.samples - half, args.tokens)  # the store doubles
        large = export_once(store, os.path.join(tmp, "out"), args.format, args.workers)
        print(f"export {args.samples} samples: {json.dumps(large)}", flush=True)
        gb, per_s = decode_rate(store, args.workers, None)
        print(f"decode, {args.samples} samples ({args.workers} threads): {gb:.3f} GB/s, {per_s:.1f} samples/s",
              flush=True)
        rows["dd (after)"] = dd_rate(tmp, min(4 << 30, half * sample_bytes))
        print(f"dd conv=fsync (after): {rows['dd (after)']:.3f} GB/s", flush=True)
        store_bytes = sum(os.path.getsize(os.path.join(store, f)) for f in os.listdir(store))
        ratio = sample_bytes * args.samples / store_bytes
        print(f"store: {store_bytes / 1e9:.2f} GB for {args.samples} samples ({ratio:.2f}x)")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
