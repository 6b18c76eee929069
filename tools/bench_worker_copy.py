"""What a DataLoader worker pays per item besides reading it: torch's pickler copies every tensor a
worker returns into shared memory. One thread, one EAGLE-3-sized sample (2,048 x 4 x 4,096 bf16),
each line the median of --repeat:
  - Store.get of a zstd-planes sample, then the pickler's copy of its states;
  - safetensors.load_file of the same states, then the pickler's copy (load_file maps the file:
    its read happens inside the copy);
  - the decode alone, then the copy; and the decode written straight into a tensor allocated in
    shared memory (UntypedStorage._new_shared), then the (now nearly free) pickling.

    PYTHONPATH=$PWD python3 tools/bench_worker_copy.py [--repeat 7]
"""

from __future__ import annotations

import argparse
import io
import os
import pickle
import shutil
import statistics
import sys
import tempfile
import time
from multiprocessing.reduction import ForkingPickler

import numpy as np
import torch
import torch.multiprocessing  # noqa: F401  (registers torch's reductions with ForkingPickler)
import zstandard

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_export import build_store  # noqa: E402

from corecap.store import Store, codec  # noqa: E402


def pickled(obj) -> None:
    ForkingPickler(io.BytesIO(), pickle.HIGHEST_PROTOCOL).dump(obj)


def timed(fn, repeat: int) -> float:
    """Median ms of fn()."""
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - t))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args()
    from safetensors.torch import load_file, save_file

    workdir = tempfile.mkdtemp(prefix="bench-worker-copy-")
    try:
        store = os.path.join(workdir, "store")
        build_store(store, "speculators", 0, 2, 2048)
        with Store.open(store) as s:
            states = s.get("s000001").hidden_states
        hs = os.path.join(workdir, "hs_0.safetensors")
        save_file({"hidden_states": states.contiguous()}, hs)
        n = states.numel() * states.element_size()
        raw = states.contiguous().view(torch.uint8).numpy().reshape(-1)
        enc = codec.encode(raw, "bfloat16", "zstd-planes")
        planes = codec.check_planes(memoryview(enc), "bfloat16", n)
        dctx = zstandard.ZstdDecompressor()

        def get():
            with Store.open(store) as s:
                return s.get("s000001").hidden_states

        def decode():
            return torch.frombuffer(codec.decode(enc, "bfloat16", n, "zstd-planes"), dtype=torch.uint8)

        def decode_into_shared():
            out = torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage._new_shared(n))
            words = out.numpy().view("<u2")
            data = [np.frombuffer(p if m == 0 else dctx.decompress(p, max_output_size=n // 2), np.uint8) for m, p in planes]
            np.copyto(words, data[1])
            words <<= 8
            words |= data[0]
            return out

        assert torch.equal(decode_into_shared(), decode())
        rows = [
            ("Store.get", timed(get, args.repeat), timed(lambda: pickled(get()), args.repeat)),
            ("safetensors.load_file", timed(lambda: load_file(hs), args.repeat), timed(lambda: pickled(load_file(hs)), args.repeat)),
            ("decode", timed(decode, args.repeat), timed(lambda: pickled(decode()), args.repeat)),
            ("decode into shared memory", timed(decode_into_shared, args.repeat), timed(lambda: pickled(decode_into_shared()), args.repeat)),
        ]
        print(f"{n / 1e6:.1f} MB of states, median of {args.repeat}, ms")
        for name, alone, with_copy in rows:
            print(f"{name:28s} alone {alone:7.1f}   then pickled {with_copy:7.1f}   (pickling {with_copy - alone:6.1f})")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
