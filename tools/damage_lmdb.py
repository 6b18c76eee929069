"""Random damage to a store's data.mdb itself (LMDB's pages, which tests/test_hostile.py leaves to
one named case: LMDB trusts its pages, and a crash there would be LMDB's): flip bits anywhere in
the file, then run `corecap verify` and `corecap ls` on it and count how each ended: exit status,
a traceback (a bug), a signal (a crash inside LMDB) or a timeout (a loop).

    python -m tools.damage_lmdb [--trials 100] [--seed 11] [--samples 400] [--timeout 120]
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import shutil
import subprocess
import sys
import tempfile

import numpy as np
import torch

from corecap.store import FORMAT_VERSION, LAYER_MEANING, ModelIdentity, Store, StoreMeta, encode_sample


def build(path: str, num_samples: int) -> None:
    identity = ModelIdentity(
        path="/m", architecture="LlamaForCausalLM", config_hash="c" * 32, weights_fingerprint="w" * 32, num_layers=8,
        hidden_size=16, vocab_size=100,
    )
    meta = StoreMeta(format_version=FORMAT_VERSION, model=identity, layers=(2, 4, 8), layer_meaning=LAYER_MEANING,
                     dtype="bfloat16", hidden_size=16, corecap_version="0", vllm_version="0", codec="zstd-planes")
    with Store.create_or_open(path, meta) as store:
        store.put_many([
            encode_sample(f"k{i:04d}", np.arange(8 + i % 50), torch.randn(3, 8 + i % 50, 16).bfloat16(), (2, 4, 8),
                          codec=("raw", "zstd-planes")[i % 2])
            for i in range(num_samples)
        ])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=100)
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--samples", type=int, default=400)
    parser.add_argument("--timeout", type=float, default=120)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    root = tempfile.mkdtemp(prefix="corecap-damage-")
    base, store = os.path.join(root, "base"), os.path.join(root, "store")
    build(base, args.samples)
    size = os.path.getsize(os.path.join(base, "data.mdb"))
    tally: collections.Counter = collections.Counter()
    for trial in range(args.trials):
        shutil.rmtree(store, ignore_errors=True)
        shutil.copytree(base, store, ignore=shutil.ignore_patterns("lock.mdb"))
        with open(os.path.join(store, "data.mdb"), "r+b") as f:
            for _ in range(rng.choice([1, 4, 32])):
                pos = rng.randrange(size)
                f.seek(pos)
                byte = f.read(1)[0]
                f.seek(pos)
                f.write(bytes([byte ^ (1 << rng.randrange(8))]))
        for command in ("verify", "ls"):
            try:
                done = subprocess.run([sys.executable, "-m", "corecap.cli", command, "--store", store],
                                      capture_output=True, text=True, timeout=args.timeout)
            except subprocess.TimeoutExpired:
                tally[(command, "timeout")] += 1
                print(f"trial {trial}: {command} took over {args.timeout} s", flush=True)
                continue
            if done.returncode < 0 or "Traceback" in done.stderr:
                print(f"trial {trial}: {command} {done.returncode}: {done.stderr.strip()[-400:]}", flush=True)
            ended = f"signal {-done.returncode}" if done.returncode < 0 else f"exit {done.returncode}"
            tally[(command, ended + (" with a traceback" if "Traceback" in done.stderr else ""))] += 1
    shutil.rmtree(root)
    for (command, ended), count in sorted(tally.items()):
        print(f"{command:7s} {ended:30s} {count}")


if __name__ == "__main__":
    main()
