"""Generation and capture in one run (`corecap run --max-tokens N`, issue 33) against the two-pass
pipeline users run today, on one model shape (dummy weights), in one call. The arms and how each
is timed are tools/common/generation.py's (shared with the CPU's tools/bench/generate.py):

  one-run   `corecap run --max-tokens N`: generation and durable capture in one run;
  generate  pass 1: vLLM's `LLM(model).generate(...)` (async scheduling on), responses as JSONL;
  capture   pass 2: `corecap run` (capture only) over pass 1's JSONL;
  one-run-sync  (not in the default arms) the one run with `--no-async-scheduling`: corecap's
            loop as it was before it took vLLM's async scheduling, for an A/B on one machine.

    VLLM_USE_FLASHINFER_SAMPLER=0 python3 -m tools.gpu.generate \
        --shape 8b [--prompts N] [--max-tokens 512] [--arms generate,capture,one-run] [--out DIR] [--dir DIR]
    python -m tools.gpu.generate --cpu-smoke        # the tiny shape, 8 short prompts, 16 tokens (a CPU check)

Prompts: N of uniformly 256-1,024 random tokens (a fixed seed). Prefix caching is each tool's default; random
prompts share no block. Results: one JSON line per arm in OUT/bench_generate.jsonl, the one run's
`corecap trace` as OUT/trace_summary_SHAPE.txt and its trace.json xz-compressed; the last lines
printed are the summary.
"""

from __future__ import annotations

import argparse
import os
import shutil
import time

from tools.common.child import append_jsonl, command_line
from tools.common.disk import dd_rate
from tools.common.generation import (
    ARMS, ArmFailed, Setup, keep_trace, random_prompts, run_corecap, run_generate, summary, write_jsonl,
)
from tools.gpu.shapes import SHAPES, model_dir

PROMPT_LENGTHS = (256, 1024)
# >= 20 s of generation an arm on the H200, each arm inside one call
PROMPTS = {"8b": 1024, "1b": 4096, "qwen3moe": 512, "tiny": 8}
TARGETS = ("end to end >= 1.3x", "generation rate >= 0.9")


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--shape", default="8b", choices=[s for s in PROMPTS])
    ap.add_argument("--prompts", type=int, default=None, help="prompts (default: the shape's, >= 20 s of work an arm)")
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-model-len", type=int, default=None, help="both tools' (default: the model's)")
    ap.add_argument("--buffer-gb", type=float, default=None, help="corecap's --buffer-gb (default: corecap's)")
    ap.add_argument("--layers", default=None, help="corecap's --layers (default: the shape's, as tools.gpu.shapes)")
    ap.add_argument("--arms", default=",".join(ARMS), help="comma-separated, in order: " + ", ".join(ARMS))
    ap.add_argument("--dd", action="store_true", help="also the disk's fsync'd write rate (4 GiB)")
    ap.add_argument(
        "--cpu-smoke", action="store_true", help="the tiny shape, 8 prompts of 16-64 tokens, 16 new tokens each"
    )
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument(
        "--dir", default=os.path.expanduser("~/gen"), help="configs, prompts, stores (default: %(default)s)"
    )
    args = ap.parse_args()
    lengths = PROMPT_LENGTHS
    if args.cpu_smoke:
        args.shape, args.prompts, args.max_tokens, lengths = "tiny", args.prompts or 8, 16, (16, 64)
    os.makedirs(args.dir, exist_ok=True)
    os.makedirs(args.out, exist_ok=True)
    print(f"# {command_line()}", flush=True)
    setup = Setup(
        model=model_dir(args.dir, args.shape), max_tokens=args.max_tokens,
        layers=args.layers or SHAPES[args.shape]["layers"], seed=args.seed, load_format="dummy",
        max_model_len=args.max_model_len, buffer_gb=args.buffer_gb,
    )
    vocab = SHAPES[args.shape]["config"]["vocab_size"]
    num_prompts = args.prompts or PROMPTS[args.shape]
    data = write_jsonl(os.path.join(args.dir, f"{args.shape}-prompts.jsonl"),
                       random_prompts(num_prompts, lengths, (10, vocab - 1000)))
    responses = os.path.join(args.dir, f"{args.shape}-responses.jsonl")
    store = os.path.join(args.dir, "store")
    results: dict[str, dict] = {}
    if args.dd:
        rec = {"shape": args.shape, "arm": "dd", "gb_s": dd_rate(args.dir, 4096 << 20, block_mib=1)}
        append_jsonl(os.path.join(args.out, "bench_generate.jsonl"), rec)
        print(f"dd: {rec['gb_s']:.3f} GB/s", flush=True)
    for arm in args.arms.split(","):
        t = time.time()
        try:
            if arm == "generate":
                rec = run_generate(setup, data, responses)
            elif arm == "capture":
                rec = run_corecap(setup, responses, store, generate=False)
            elif arm == "one-run":
                rec = run_corecap(setup, data, store, generate=True)
                keep_trace(store, args.out, args.shape)
            elif arm == "one-run-sync":
                rec = run_corecap(setup, data, store, generate=True, extra=("--no-async-scheduling",))
            else:
                raise SystemExit(f"--arms: {arm!r}: expected one of {', '.join(ARMS)}, one-run-sync")
            results[arm] = rec
            status = "ok"
        except ArmFailed as e:
            rec = {"failed": str(e), "stderr_tail": e.stderr[-12000:]}
            status = f"FAILED ({e})\n{e.stderr[-4000:]}"
        shutil.rmtree(store, ignore_errors=True)  # an 8B store is ~25 GB: one at a time on the disk
        append_jsonl(
            os.path.join(args.out, "bench_generate.jsonl"),
            {
                "shape": args.shape,
                "arm": arm,
                "prompts": num_prompts,
                "max_tokens": args.max_tokens,
                "layers": setup.layers,
                "buffer_gb": args.buffer_gb,
                **rec,
            },
        )
        print(f"{args.shape}:{arm}: {status} in {time.time() - t:.0f}s", flush=True)
    print("\n".join(summary(args.shape, results) + [f"targets: {', '.join(TARGETS)}"]), flush=True)


if __name__ == "__main__":
    main()
