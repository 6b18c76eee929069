"""fp8 quantised on the GPU, as the workers do under `--store-dtype fp8`, against the CPU's
`quantize_fp8` (tests/test_fp8.py checks that one against an independent reference): the same
payload to the bit? One JSON line per dtype and case, then the time one 1B-shaped step takes
(4 layers x 16,384 tokens x 2,048, bf16) on the device.

    python3 -m tools.gpu.fp8rows [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from corecap.store.fp8 import quantize_fp8
from corecap.store.fp8rows import fp8_payload, quantize_fp8_rows


def cases(dtype: torch.dtype, g: torch.Generator) -> dict[str, torch.Tensor]:
    finfo = torch.finfo(dtype)
    spread = torch.randn(3, 200, 512, generator=g) * torch.logspace(-30, 30, 200)[None, :, None]
    outliers = torch.randn(3, 100, 512, generator=g)
    outliers[:, :, 7] *= 500
    tiny = torch.randn(3, 50, 512, generator=g) * finfo.tiny
    extremes = torch.linspace(-finfo.max, finfo.max, 3 * 8 * 512, dtype=torch.float64).view(3, 8, 512)
    zeros = torch.zeros(3, 4, 512)
    zeros[1] = -0.0
    return {name: t.double().clamp(-finfo.max, finfo.max).to(dtype) for name, t in
            dict(spread=spread, outliers=outliers, tiny=tiny, extremes=extremes, zeros=zeros).items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    out = []
    g = torch.Generator().manual_seed(3)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for name, states in cases(dtype, g).items():
            rows = quantize_fp8_rows([t.cuda() for t in states], states.shape[1]).cpu()
            same = fp8_payload(rows).tobytes() == quantize_fp8(states).tobytes()
            out.append({"dtype": str(dtype), "case": name, "rows": states.shape[0] * states.shape[1],
                        "bit_identical": same})
            print(json.dumps(out[-1]), flush=True)
    step = [torch.randn(16384, 2048, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    for _ in range(3):
        quantize_fp8_rows(step, 16384)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        quantize_fp8_rows(step, 16384)
    end.record()
    torch.cuda.synchronize()
    stack_start, stack_end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    stack_start.record()
    for _ in range(20):
        torch.stack(step)
    stack_end.record()
    torch.cuda.synchronize()
    out.append({"step": "4 x 16384 x 2048 bf16", "quantize_ms": start.elapsed_time(end) / 20,
                "stack_ms (what lossless does instead)": stack_start.elapsed_time(stack_end) / 20})
    print(json.dumps(out[-1]), flush=True)
    with open(os.path.join(args.out, "gpu_fp8rows.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in out)
    if not all(r.get("bit_identical", True) for r in out):
        raise SystemExit("fp8 rows on the GPU differ from quantize_fp8 on the CPU")


if __name__ == "__main__":
    main()
