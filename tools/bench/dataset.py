"""corecap.StoreDataset's read rate against reading the same samples from speculators' own
hs_{i}.safetensors files (an export of the same store), each through DataLoader(num_workers=2,
batch_size=None): StoreDataset, the same without its shared-memory pool (reuse_shared_memory=False,
how it read before), speculators' ArrowDataset (what its trainer reads) and a bare
safetensors.load_file of each hs file (the files' floor). Warm (page cache) and cold (every file
dropped from the page cache with posix_fadvise before each pass); and StoreDataset over the same
samples stored with the raw codec (decoding is then a CRC). Then, on one thread, the time
per sample split into reading the bytes and decoding them, to show which dominates.

EAGLE-3-sized samples: 2,048 tokens x 4 layers (2,16,29,prenorm) x 4,096, bf16, activation-like.

    flock /tmp/corecap-engine.lock python -m tools.bench.dataset --samples 32 [--seconds 20] [--dir /tmp] [--touch]
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import sys
import tempfile
import time

import torch
import torch.utils.data

import corecap
from corecap.store import Store, decode_header, decode_sample
from corecap.export.driver import export_store
from tools.common.stores import build_store


class HsFiles(torch.utils.data.Dataset):
    """hs_{i}.safetensors read with safetensors alone: no speculators, no checks."""

    def __init__(self, directory: str, num: int):
        self.paths = [os.path.join(directory, "hidden_states", f"hs_{i}.safetensors") for i in range(num)]

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        from safetensors.torch import load_file

        return load_file(self.paths[i])


def drop_cache(paths) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def one_pass(loader, cold_files, touch: bool) -> float:
    """One pass of a DataLoader whose workers persist (their start is not timed); with `touch`,
    the main process reads a byte of every page of each item's states, as a trainer reads them."""
    if cold_files:
        drop_cache(cold_files)
    start = time.perf_counter()
    for item in loader:
        for t in item.values() if touch else ():  # speculators' items hold the states in two tensors
            if isinstance(t, torch.Tensor) and t.nbytes > 1 << 20:
                int(t.reshape(-1).view(torch.uint8)[::4096].sum())
    return time.perf_counter() - start


def split_store(store: str, cold: bool) -> tuple[float, float, float]:
    """ms per sample reading the encoded bytes, ms decoding them, MB read per sample (one thread)."""
    files = glob.glob(os.path.join(store, "states-*.bin"))
    if cold:
        drop_cache(files)
    read = decode = nbytes = 0.0
    with Store.open(store) as s, s.env.begin(buffers=True) as txn:
        keys = list(s.keys())
        for key in keys:
            t0 = time.perf_counter()
            hv = txn.get(key.encode(), db=s.headers_db)
            header = decode_header(key, hv)
            states = s.states(key, header, txn.get(key.encode(), db=s.samples_db), s.committed_end(txn))
            t1 = time.perf_counter()
            decode_sample(key, hv, states, len(s.meta.layers))
            t2 = time.perf_counter()
            read, decode, nbytes = read + t1 - t0, decode + t2 - t1, nbytes + len(states)
    n = len(keys)
    return read / n * 1e3, decode / n * 1e3, nbytes / n / 1e6


def split_files(out: str, num: int, cold: bool) -> tuple[float, float]:
    """ms per sample for load_file of an hs file, MB per file (one thread)."""
    from safetensors.torch import load_file

    paths = [os.path.join(out, "hidden_states", f"hs_{i}.safetensors") for i in range(num)]
    if cold:
        drop_cache(paths)
    start = time.perf_counter()
    for p in paths:
        for t in load_file(p).values():
            t.clone()  # load_file maps the file lazily: read it, as the DataLoader's copy to its worker's shm does
    return (time.perf_counter() - start) / num * 1e3, sum(os.path.getsize(p) for p in paths) / num / 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--seconds", type=float, default=20.0, help="at least this long per arm and cache state")
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--touch", action="store_true", help="the main process reads every page of each item's states")
    args = ap.parse_args()
    from speculators.train.data import ArrowDataset

    torch.set_num_threads(1)
    tmp = tempfile.mkdtemp(prefix="bench-dataset-", dir=args.dir)
    try:
        store, out = os.path.join(tmp, "store"), os.path.join(tmp, "spec")
        build_store(store, "speculators", 0, args.samples, args.tokens)
        raw = os.path.join(tmp, "store-raw")  # the same samples stored uncompressed: decoding is then a CRC
        build_store(raw, "speculators", 0, args.samples, args.tokens, codec="raw")
        export_store(store, out, "speculators", workers=2)
        store_files = glob.glob(os.path.join(store, "*.bin")) + [os.path.join(store, "data.mdb")]
        raw_files = glob.glob(os.path.join(raw, "*.bin")) + [os.path.join(raw, "data.mdb")]
        spec_files = glob.glob(os.path.join(out, "hidden_states", "*.safetensors"))
        spec_files += glob.glob(os.path.join(out, "*.arrow"))
        datasets = {
            "StoreDataset": (corecap.StoreDataset(store), store_files),
            "StoreDataset, no reuse": (corecap.StoreDataset(store, reuse_shared_memory=False), store_files),
            "StoreDataset, raw codec": (corecap.StoreDataset(raw), raw_files),
            "speculators ArrowDataset": (ArrowDataset(max_len=args.tokens, datapath=out, on_missing="raise"),
                                         spec_files),
            "safetensors.load_file": (HsFiles(out, args.samples), spec_files),
        }
        arms = {
            name: (torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2, prefetch_factor=2,
                                               persistent_workers=True), files)
            for name, (ds, files) in datasets.items()
        }
        sample_gb = args.tokens * 4 * 4096 * 2 / 1e9
        for cold in (False, True):
            times = {name: [] for name in arms}
            for ds, files in arms.values():  # a warm-up pass each (also fills the cache for "warm")
                one_pass(ds, files if cold else None, args.touch)
            while min(sum(t) for t in times.values()) < args.seconds:
                for name, (ds, files) in arms.items():  # alternating
                    times[name].append(one_pass(ds, files if cold else None, args.touch))
            for name, t in times.items():
                per_s = [args.samples / x for x in t]
                print(f"{'cold' if cold else 'warm'} {name:26s} passes {len(t):2d}  "
                      f"samples/s {min(per_s):6.1f}-{max(per_s):6.1f} "
                      f"(median {sorted(per_s)[len(per_s) // 2]:5.1f})  "
                      f"GB/s of states {min(per_s) * sample_gb:.2f}-{max(per_s) * sample_gb:.2f}", flush=True)
        for cold in (False, True):
            r, d, mb = split_store(store, cold)
            rr, rd, rmb = split_store(raw, cold)
            f, fmb = split_files(out, args.samples, cold)
            print(f"one thread, {'cold' if cold else 'warm'}: "
                  f"store read {r:.1f} ms ({mb:.1f} MB) + decode {d:.1f} ms = {r + d:.1f} ms;"
                  f" raw store read {rr:.1f} ms ({rmb:.1f} MB) + decode {rd:.1f} ms = {rr + rd:.1f} ms;"
                  f" hs file load_file + read {f:.1f} ms ({fmb:.1f} MB)", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
