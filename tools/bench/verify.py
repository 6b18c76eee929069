"""`corecap verify`'s rate on the machine it runs on: a store of EAGLE-3-sized samples (4 layers x 1,024
tokens x 4,096, bf16, random), written once, then verified with 1 thread and with the default
number (`corecap verify --threads`); on one thread the time per sample is split into reading +
decoding and the states checks (NaN/Inf, all-zero layers).

    python -m tools.bench.verify [--samples 24] [--codec zstd-planes] [--repeat 3] [--threads 1,4]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

from corecap.store import verify
from tools.common.stores import HIDDEN, LAYERS, random_store

TOKENS = 1024


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=24)
    ap.add_argument("--codec", default="zstd-planes")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", default=f"1,{verify.default_threads()}", help="comma-separated thread counts")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="bench-verify-")
    try:
        path = os.path.join(tmp, "store")
        random_store(path, args.samples, TOKENS, args.codec)
        checks = []
        original = verify._check_states

        def timed_check(states, layers):
            start = time.perf_counter()
            try:
                return original(states, layers)
            finally:
                checks.append(time.perf_counter() - start)

        verify._check_states = timed_check
        for threads in sorted({int(t) for t in args.threads.split(",")}):
            for _ in range(args.repeat):
                checks.clear()
                start = time.perf_counter()
                report = verify.verify_store(path, num_threads=threads)
                total = time.perf_counter() - start
                assert report.ok and report.num_samples == args.samples, report.line()
                per_sample = total / args.samples * 1e3
                check = sum(checks) / args.samples * 1e3
                split = ""
                if threads == 1:
                    split = f": read + decode {per_sample - check:.1f} ms, states checks {check:.1f} ms"
                print(
                    f"{args.samples} samples of {len(LAYERS['specforge'])}x{TOKENS}x{HIDDEN} bf16, codec {args.codec}, "
                    f"{threads} thread(s): {per_sample:.1f} ms per sample ({args.samples / total:.1f} samples/s){split}"
                )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
