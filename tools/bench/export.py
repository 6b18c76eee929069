"""`corecap export`'s rate on the machine it runs on, in every format, against the two things it may be bound
by: the disk (dd's fsync'd sequential write rate, on the same file system, before and after the
exports) and corecap's decode rate (each store's samples decoded on the same number of threads as
the export's, nothing written). Each export runs in a fresh process (tools/bench/export_child.py)
that times its stages per sample (decode, gather + write, fsync + rename).

EAGLE-3-sized samples (tools/common/stores.py): an 8B-shaped model, 2,048 tokens x 4 layers x
4,096, bf16, activation-like. Two stores, since no one store holds what every format needs
without a fifth layer to decode: layers 2,16,29,prenorm (speculators, bf16 and --dtype fp8) and
2,16,29,32 (every other format).

    flock /tmp/corecap-engine.lock python -m tools.bench.export --samples 240 \\
        [--formats speculators,deepspec,...] [--workers 2] [--dir /tmp] [--jsonl-out FILE]

A format's tokens/s against its ceilings: the decode's tokens/s, and the disk's (dd's bytes/s over
the bytes the format writes per token).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor

from corecap.store import Store, decode_header
from tools.bench.export_child import FORMATS
from tools.common.child import append_jsonl, command_line, run_child
from tools.common.disk import dd_rate
from tools.common.stores import HIDDEN, LAYERS, build_store

TOKENS = 2048
STORE_OF = {name: ("speculators" if name.startswith("speculators") else "specforge") for name in FORMATS}


def decode_rate(path: str, workers: int) -> dict:
    """Every sample decoded on `workers` threads as the export does (the walking thread reads, a
    pool decodes, at most 2 x workers in flight), nothing written."""
    nbytes = num = tokens = 0
    with Store.open(path) as store, store.env.begin(buffers=True) as txn, ThreadPoolExecutor(workers) as pool:
        def work(key, header, states):
            store.decode(key, header, states)
            return header.payload_bytes, header.num_tokens

        pending = deque()
        start = time.perf_counter()
        end = store.committed_end(txn)

        def collect():
            nonlocal nbytes, num, tokens
            b, t = pending.popleft().result()
            nbytes, num, tokens = nbytes + b, num + 1, tokens + t

        for k, header_value in txn.cursor(db=store.headers_db):
            key = bytes(k).decode()
            header = decode_header(key, header_value)
            states = store.states(key, header, txn.get(bytes(k), db=store.samples_db), end)
            pending.append(pool.submit(work, key, header, states))
            while len(pending) >= 2 * workers:
                collect()
        while pending:
            collect()
        seconds = time.perf_counter() - start
    return {"seconds": seconds, "samples": num, "tokens": tokens, "nbytes": nbytes,
            "tokens_s": tokens / seconds, "mb_s": nbytes / seconds / 1e6}


def export_rate(store: str, out: str, name: str, workers: int) -> dict:
    """One export in a fresh process: its rates, stages and peak RSS; its output removed."""
    result, _ = run_child("tools.bench.export_child", [store, out, name, str(workers)], timeout=1800)
    result["tokens_s"] = result["tokens"] / result["seconds"]
    result["mb_s"] = result["nbytes"] / result["seconds"] / 1e6
    result["bytes_per_token"] = result["nbytes"] / result["tokens"]
    shutil.rmtree(out, ignore_errors=True)
    if os.path.exists(out):
        os.unlink(out)
    return result


def table(results: dict, decode: dict, dd: list[float]) -> str:
    """The markdown table docs/benchmarks.md shows: each format beside its two ceilings."""
    lines = ["| format | tokens/s | MB/s written | bytes/token | decode alone, tokens/s | disk ceiling, tokens/s "
             "(dd before / after) | ms/sample: read, decode, gather + write, fsync + rename | peak RSS MB |",
             "|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        dec = "-" if name == "jsonl" else f"{decode[STORE_OF[name]]['tokens_s']:,.0f}"  # jsonl reads no states
        disk = " / ".join(f"{d * 1e9 / r['bytes_per_token']:,.0f}" for d in dd)
        stages = r["stage_ms_per_sample"]
        ms = ", ".join(str(stages.get(k, "-")) for k in ("read (walking thread)", "decode", "gather + write",
                                                          "fsync + rename"))
        lines.append(f"| {name} | {r['tokens_s']:,.0f} | {r['mb_s']:,.1f} | {r['bytes_per_token']:,.0f} | "
                     f"{dec} | {disk} | {ms} | {r['maxrss_mb']:,.0f} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--formats", default=",".join(FORMATS), help=f"comma-separated, of {', '.join(FORMATS)}")
    ap.add_argument("--samples", type=int, default=240,
                    help="in each of the two stores (240: 13-30 s an export on 2 cores)")
    ap.add_argument("--tokens", type=int, default=TOKENS)
    ap.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1))
    ap.add_argument("--dir", default=tempfile.gettempdir(),
                    help="where the stores and the exports go (one file system)")
    ap.add_argument("--jsonl-out", help="append each measurement to this file, one JSON object a line")
    args = ap.parse_args()
    names = args.formats.split(",")
    unknown = [n for n in names if n not in FORMATS]
    if unknown:
        ap.error(f"--formats: unknown {unknown}; expected some of {list(FORMATS)}")

    def record(kind: str, obj: dict) -> None:
        print(f"{kind}: {json.dumps(obj)}", flush=True)
        if args.jsonl_out:
            append_jsonl(args.jsonl_out, {"kind": kind, **obj})

    record("setup", {"command": command_line(), "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                     "loadavg": os.getloadavg(), "cpus": os.cpu_count(), "workers": args.workers})
    tmp = tempfile.mkdtemp(prefix="bench-export-", dir=args.dir)
    try:
        stores = {}
        for which in sorted({STORE_OF[n] for n in names}):
            stores[which] = os.path.join(tmp, which)
            t = time.perf_counter()
            build_store(stores[which], which, 0, args.samples, args.tokens)
            nbytes = sum(os.path.getsize(os.path.join(stores[which], f)) for f in os.listdir(stores[which]))
            record("store", {"store": which, "layers": list(LAYERS[which]), "samples": args.samples,
                             "shape": [args.tokens, len(LAYERS[which]), HIDDEN], "bytes": nbytes,
                             "build_s": time.perf_counter() - t})
        sample_bytes = args.tokens * 4 * HIDDEN * 2
        dd = [dd_rate(tmp, min(4 << 30, args.samples * sample_bytes // 2))]
        record("dd", {"when": "before", "gb_s": dd[0]})
        decode = {}
        for which, path in stores.items():
            decode[which] = decode_rate(path, args.workers)
            record("decode", {"store": which, **decode[which]})
        results = {}
        for name in names:
            results[name] = export_rate(stores[STORE_OF[name]], os.path.join(tmp, "out"), name, args.workers)
            record("export", {"loadavg": os.getloadavg(), **results[name]})
        dd.append(dd_rate(tmp, min(4 << 30, args.samples * sample_bytes // 2)))
        record("dd", {"when": "after", "gb_s": dd[1]})
        print(table(results, decode, dd))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
