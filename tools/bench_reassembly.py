"""What the sink's reassembly copy costs into fresh vs reused buffers (corecap/collect.py,
BufferPool): one 16,384-token step of 4 layers x 4,096 bf16 states (537 MB) copied into 16
samples of 1,024 tokens, as the collector does, with the CPU threads torch has.

    python tools/bench_reassembly.py [--repeat 3]
"""

from __future__ import annotations

import argparse
import time

import torch

from corecap.collect import BufferPool

LAYERS, HIDDEN, SAMPLE, SAMPLES = 4, 4096, 1024, 16


def one_step(step: torch.Tensor, pool: BufferPool | None) -> float:
    t = time.perf_counter()
    out = []
    for i in range(SAMPLES):
        shape = (LAYERS, SAMPLE, HIDDEN)
        dest = pool.take(shape, step.dtype) if pool else torch.empty(shape, dtype=step.dtype)
        dest[:] = step[:, i * SAMPLE : (i + 1) * SAMPLE]
        out.append(dest)
    seconds = time.perf_counter() - t
    if pool:
        for dest in out:
            pool.give(dest)
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    step = torch.randn(LAYERS, SAMPLES * SAMPLE, HIDDEN).bfloat16()
    pool = BufferPool(2 << 30)
    one_step(step, pool)  # fills the pool
    fresh = [one_step(step, None) for _ in range(args.repeat)]
    reused = [one_step(step, pool) for _ in range(args.repeat)]
    print(f"{step.nbytes / 1e6:.0f} MB per step, {torch.get_num_threads()} torch threads")
    print("fresh buffers:  " + ", ".join(f"{s * 1e3:.0f} ms" for s in fresh))
    print("reused buffers: " + ", ".join(f"{s * 1e3:.0f} ms" for s in reused))


if __name__ == "__main__":
    main()
