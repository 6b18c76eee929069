"""Prefix caching on the CPU: capture rate, stored bytes and peak RSS with caching off and on.

    flock /tmp/corecap-engine.lock python3 -m tools.bench.prefix [--datasets a,b,c]
        [--modes off,on,on-small] [--samples 24] [--model-shape small|wide] [--out DIR]

Datasets (written here, from a fixed seed, as token ids):
  a  a 2,048-token system prompt shared by every sample, plus a unique tail of 256-1,024 tokens
  b  multi-turn conversations stored one sample per turn (turn k's sample is turns 1..k, each
     turn 128-384 tokens): every sample is a prefix of the next one of its conversation
  c  unique random prompts of 256-1,024 tokens (nothing shared: what caching costs)
Modes: `off` (--no-enable-prefix-caching), `on` (--enable-prefix-caching, --block-size 32,
corecap tracking as many blocks as the KV cache holds), `on-small` (the same with
--prefix-blocks 64: fewer than (a)'s system prompt and a step's own, so corecap evicts from
vLLM), `on-128` (vLLM's CPU block size, 128).

Each (dataset, mode) is one `corecap.capture` in a process of its own, on a synthetic Llama
(`--model-shape`: small, 8 layers of hidden 512, or wide, 4 of 1,024; float32, a fixed seed),
layers 2,4,5,8 (wide: 1-4), 8 sequences and 2,048 tokens a step. The capture rate is the
samples' tokens over the time from the first engine step to the last commit (from the run's
trace); stored bytes are what the run committed (summary.nbytes: states and headers) and the
store's state files on disk; with caching on a sample that starts with a committed sample's
cached blocks refers to it and stores only its tail (stored once), and the store is then checked
by `corecap verify` (verify_ok, not timed); peak RSS is the driver's own (getrusage), the
sink's (which holds the states cache) and the largest worker's (both sampled every 50 ms).
Every result is a JSON line in DIR/bench_prefix.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import tempfile
import time

from tools.common import traces
from tools.common.child import append_jsonl, parse_or_answer, run_child
from tools.common.models import tiny_llama
from tools.common.rss import RssPeaks, children_by_role

LAYERS = {"small": (2, 4, 5, 8), "wide": (1, 2, 3, 4)}  # by --model-shape
MEMORY_SHARE = {"small": 0.1, "wide": 0.3}  # wide's activations at 2,048 tokens a step need more than 0.1 leaves
MODES = {
    "off": {},
    "on": {"enable_prefix_caching": True, "block_size": 32},
    "on-small": {"enable_prefix_caching": True, "block_size": 32, "prefix_blocks": 64},
    "on-128": {"enable_prefix_caching": True},
}


# `--model-shape`: "small" (hidden 512, 8 layers; attention over a 2.5k context is ~45% of a
# token's FLOPs) and "wide" (hidden 1,024, 4 layers, a Llama-like MLP ratio; ~27%, nearer an 8B
# model's ~9%): the share of work that prefix caching cannot remove, since a tail's tokens still
# attend to the cached prefix.
MODEL_SHAPES = {
    "small": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=4),
    "wide": dict(hidden_size=1024, intermediate_size=3584, num_hidden_layers=4, num_attention_heads=16,
                 num_key_value_heads=8),
}


def build_model(workdir: str, shape: str = "small") -> str:
    return tiny_llama(os.path.join(workdir, f"model-{shape}"), vocab_size=4096, max_position_embeddings=4096,
                      **MODEL_SHAPES[shape])


def build_data(workdir: str, dataset: str, num_samples: int) -> str:
    import numpy as np

    rng = np.random.default_rng(0)
    tokens = lambda n: rng.integers(10, 4000, size=int(n)).tolist()  # noqa: E731
    rows = []
    if dataset == "a":
        system = tokens(2048)
        rows = [system + tokens(n) for n in rng.integers(256, 1025, size=num_samples)]
    elif dataset == "b":
        while len(rows) < num_samples:
            turns: list[int] = []
            for _ in range(6):
                turns = turns + tokens(rng.integers(128, 385))
                rows.append(turns)
        rows = rows[:num_samples]
    elif dataset == "c":
        rows = [tokens(n) for n in rng.integers(256, 1025, size=num_samples)]
    else:
        raise SystemExit(f"--datasets: unknown dataset {dataset!r} (a, b or c)")
    path = os.path.join(workdir, f"data-{dataset}-{num_samples}.jsonl")
    with open(path, "w") as f:
        for i, ids in enumerate(rows):
            f.write(json.dumps({"id": f"s{i}", "input_ids": ids}) + "\n")
    return path


def one(args) -> dict:
    """A single (dataset, mode), in this process."""
    from corecap.api import capture

    store = os.path.join(args.workdir, f"store-{args.one}")
    shutil.rmtree(store, ignore_errors=True)
    lines: list[str] = []
    t0 = time.perf_counter()
    with RssPeaks(children_by_role, interval=0.05) as peaks:
        summary = capture(model=args.model, data=args.data, store=store, layers=LAYERS[args.model_shape],
                          dtype="float32", batch=8, max_batched_tokens=2048, max_len=3200,
                          memory_utilization=MEMORY_SHARE[args.model_shape],
                          log=lines.append, **MODES[args.one])
    wall = time.perf_counter() - t0
    rates = traces.rates(traces.load(store), summary.num_tokens)
    state_files = sum(os.path.getsize(os.path.join(store, f)) for f in os.listdir(store) if f.startswith("states-"))
    from corecap.store.verify import verify_store

    report = verify_store(store)
    shutil.rmtree(store, ignore_errors=True)
    return {
        "capture_tok_s": rates["durable_tok_s"], "capture_s": rates["durable_s"],
        "tokens": summary.num_tokens, "computed_tokens": rates["computed_tokens"], "samples": summary.num_committed,
        "stored_bytes": summary.nbytes, "state_file_bytes": state_files, "raw_bytes": summary.raw_bytes,
        "referred_bytes": summary.referred_bytes, "num_referring": summary.num_referring,
        "num_stored_whole": summary.num_stored_whole, "verify_ok": report.ok, "wall_s": wall,
        "driver_peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "sink_peak_rss_mib": peaks.mib.get("corecap-sink", 0.0), "worker_peak_rss_mib": peaks.mib.get("worker", 0.0),
        "prefix_line": next((x for x in lines if x.startswith("prefix cache: ")), None),
        "engine_line": next((x for x in lines if x.startswith("engine: ")), None),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--datasets", default="a,b,c")
    ap.add_argument("--modes", default="off,on,on-small")
    ap.add_argument("--samples", type=int, default=24, help="samples per dataset")
    ap.add_argument("--model-shape", choices=sorted(MODEL_SHAPES), default="small")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parse_or_answer(ap, one)
    if args is None:
        return
    os.makedirs(args.out, exist_ok=True)
    workdir = tempfile.mkdtemp(prefix="bench-prefix-")
    records = []
    try:
        model = build_model(workdir, args.model_shape)
        for dataset in args.datasets.split(","):
            data = build_data(workdir, dataset, args.samples)
            for mode in args.modes.split(","):
                rec = {"dataset": dataset, "mode": mode, "model_shape": args.model_shape,
                       "date": time.strftime("%Y-%m-%d %H:%M"),
                       "load_avg_before": os.getloadavg()[0], **_run(mode, model, data, workdir, args.model_shape)}
                print(json.dumps(rec), flush=True)
                records.append(rec)
                append_jsonl(os.path.join(args.out, "bench_prefix.jsonl"), rec)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    for rec in records:  # against caching off on the same dataset
        off = next((r for r in records if r["dataset"] == rec["dataset"] and r["mode"] == "off"), None)
        if off is not None and rec is not off:
            print(f"({rec['dataset']}) {rec['mode']}: capture {rec['capture_tok_s'] / off['capture_tok_s']:.2f}x, "
                  f"stored bytes {rec['stored_bytes'] / off['stored_bytes']:.3f} of off "
                  f"({rec['num_referring']} samples refer, {rec['num_stored_whole']} stored whole, "
                  f"verify {'OK' if rec['verify_ok'] else 'FAILED'})")


def _run(mode: str, model: str, data: str, workdir: str, shape: str) -> dict:
    if mode not in MODES:
        raise SystemExit(f"--modes: unknown mode {mode!r} ({', '.join(MODES)})")
    args = ["--one", mode, "--model", model, "--data", data, "--workdir", workdir, "--model-shape", shape]
    return run_child(__spec__.name, args, timeout=3600)[0]


if __name__ == "__main__":
    main()
