"""Data-parallel replicas on the CPU: capture throughput of `-dp N` against one engine.

    flock /tmp/corecap-engine.lock python3 -m tools.bench.dp [--dp 1,2] [--seconds 20] [--out DIR]

Each configuration is one `corecap.capture` in a process of its own, on the same synthetic
Llama (8 layers, hidden 512, float32, built from a fixed seed: big enough that the forward
pass, not the driver, sets the pace on 2 cores) and 512-token random prompts, layers
2,4,5,8, prefix caching off. The dataset of `-dp N` holds N times the prompts of `-dp 1`
(calibrated so that `-dp 1` captures for about --seconds), so every run captures that long.
Rates come from the run's trace: tokens over the time from the first engine step to the last
sample reassembled ("capture"), and to the last commit ("durable"). `dp1` leaves the cores to
vLLM, which on this 2-core x86 machine keeps one for the driver and gives the worker the other;
`dp1-1core` pins one engine to one core (VLLM_CPU_OMP_THREADS_BIND=0: what each replica gets
under `-dp 2`), `dp1-2cores` gives one engine both (0-1: the same cores as `-dp 2`, in one
engine). The binding each run got (vLLM's "core ids" lines) is in its record.
Every result is a JSON line in DIR/bench_dp.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time

from tools.common import traces
from tools.common.child import append_jsonl, parse_or_answer, run_child
from tools.common.models import tiny_llama

PROMPT_LEN = 512
PINNED = {"dp1-1core": "0", "dp1-2cores": "0-1"}
LAYERS = (2, 4, 5, 8)


def build_inputs(workdir: str, num_prompts: int) -> tuple[str, str]:
    import numpy as np

    model = tiny_llama(os.path.join(workdir, "model"), vocab_size=4096, hidden_size=512, intermediate_size=1536,
                       num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024)
    data = os.path.join(workdir, f"prompts-{num_prompts}.jsonl")
    rng = np.random.default_rng(0)
    with open(data, "w") as f:
        for i in range(num_prompts):
            f.write(json.dumps({"id": f"p{i}", "input_ids": rng.integers(10, 4000, size=PROMPT_LEN).tolist()}) + "\n")
    return model, data


def one(args) -> dict:
    """A single configuration, in this process: returns its rates."""
    from corecap.api import capture

    store = os.path.join(args.workdir, f"store-{args.one}")
    shutil.rmtree(store, ignore_errors=True)
    dp = 1 if args.one.startswith("dp1") else int(args.one.removeprefix("dp"))
    t0 = time.perf_counter()
    summary = capture(model=args.model, data=args.data, store=store, layers=LAYERS, dtype="float32", dp=dp,
                      max_len=PROMPT_LEN + 8, memory_utilization=0.1, log=lambda m: print(m, flush=True))
    wall = time.perf_counter() - t0
    trace = traces.load(store)
    shutil.rmtree(store, ignore_errors=True)
    rates = traces.rates(trace, summary.num_tokens)
    return {
        "capture_tok_s": rates["capture_tok_s"], "durable_tok_s": rates["durable_tok_s"],
        "capture_s": rates["capture_s"],
        "tokens": summary.num_tokens, "samples": summary.num_committed, "wall_s": wall,
        "replicas": sorted({s.get("replica", 0) for s in trace["steps"]}),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dp", default="1,2", help="replica counts to measure (and dp1-1core)")
    ap.add_argument("--seconds", type=float, default=20.0, help="capture time of -dp 1 to aim for")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parse_or_answer(ap, one)
    if args is None:
        return
    os.makedirs(args.out, exist_ok=True)
    workdir = tempfile.mkdtemp(prefix="bench-dp-")
    modes = [m if m.startswith("dp") else f"dp{m}" for m in args.dp.split(",")] + ["dp1-1core", "dp1-2cores"]
    try:
        # Calibrate: a short -dp 1 run gives the rate; then -dp 1 gets --seconds worth of prompts.
        model, data = build_inputs(workdir, 16)
        rate = _run(args, "dp1", model, data, workdir)["capture_tok_s"]
        per_replica = max(16, int(rate * args.seconds / PROMPT_LEN))
        print(f"calibration: {rate:,.0f} tokens/s at -dp 1 -> {per_replica} prompts per replica", flush=True)
        for mode in modes:
            replicas = 1 if mode.startswith("dp1") else int(mode.removeprefix("dp"))
            model, data = build_inputs(workdir, per_replica * replicas)
            rec = {"mode": mode, "date": time.strftime("%Y-%m-%d %H:%M"), "load_avg_before": os.getloadavg()[0],
                   **_run(args, mode, model, data, workdir)}
            print(json.dumps(rec), flush=True)
            append_jsonl(os.path.join(args.out, "bench_dp.jsonl"), rec)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _run(args, mode: str, model: str, data: str, workdir: str) -> dict:
    env = {"VLLM_CPU_OMP_THREADS_BIND": PINNED[mode]} if mode in PINNED else None
    result, proc = run_child(__spec__.name, ["--one", mode, "--model", model, "--data", data, "--workdir", workdir],
                             timeout=1800, env=env)
    lines = (proc.stdout + proc.stderr).splitlines()  # vLLM logs to stdout
    binding = sorted({line.split("] ", 1)[-1].strip() for line in lines if "core ids=" in line})
    return {**result, "binding": binding}


if __name__ == "__main__":
    main()
