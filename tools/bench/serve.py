"""`corecap serve` against `corecap run` on the same prompts: the rate at which each delivers
the prompts' states, on the CPU.

    python3 -m tools.bench.serve [--samples 96] [--lengths 128,768] [--clients 4,16] [--modes run,serve]
                                 [--repeat 1] [--out DIR]

A synthetic Llama (4 layers of hidden 1,024, float32, a fixed seed), the same random prompts
(token ids from a fixed seed), layers 1,2,3,prenorm, vLLM's prefix caching off in both (the
server runs without it), 16 sequences and 2,048 tokens a step, compiled.

- run: `corecap run` into a store; its rate is its summary's (the samples' tokens from the
  first engine step to the last commit).
- serve: `corecap serve --hidden-states-backend file`, once healthy; C client threads post
  every prompt once to /v1/completions (token ids, max_tokens 1, as speculators asks) and remove
  each file once answered, as speculators' reader does; the rate is the prompts' tokens over the
  time from the first request to the last answer.
- serve-store: the same with `--store` (each sample delivered also committed to a store, after
  its answer); the rate is measured as for serve, the store's commits included only as far as
  they hold the answers back.

Each result is a JSON line in DIR/bench_serve.jsonl; the table is printed at the end.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

from tools.common.child import append_jsonl, child_env, command_line, free_port, wait_healthy
from tools.common.generation import random_prompts, write_jsonl
from tools.common.models import tiny_llama

LAYERS = "1,2,3,prenorm"
ENGINE = ["--dtype", "float32", "--max-num-seqs", "16", "--max-num-batched-tokens", "2048",
          "--no-enable-prefix-caching", "--layers", LAYERS]
SHAPE = dict(hidden_size=1024, intermediate_size=2048, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=2, vocab_size=4096, max_position_embeddings=2048)


def run_rate(model: str, data: str, workdir: str) -> dict:
    store = os.path.join(workdir, "run.lmdb")
    proc = subprocess.run([sys.executable, "-m", "corecap.cli", "run", "--model", model, "--data", data,
                           "--store", store, *ENGINE], capture_output=True, text=True, env=child_env(), timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"corecap run failed:\n{proc.stderr[-3000:]}")
    found = re.search(r"committed (\d+) samples \((\d+) tokens\).* in ([\d.]+)s \((\d+) tokens/s\)", proc.stdout)
    return {"mode": "run", "samples": int(found[1]), "tokens": int(found[2]), "seconds": float(found[3]),
            "tokens_per_s": int(found[4])}


def serve_rate(model: str, prompts: list[list[int]], workdir: str, clients: int, store: bool = False) -> dict:
    port = free_port()
    name = f"{'serve-store' if store else 'serve'}-{clients}-{time.monotonic_ns()}"
    hidden = os.path.join(workdir, f"hidden-{name}")
    log = open(os.path.join(workdir, f"{name}.log"), "w")
    keep = ["--store", os.path.join(workdir, f"{name}.lmdb")] if store else []
    server = subprocess.Popen([sys.executable, "-m", "corecap.cli", "serve", "--model", model, "--port", str(port),
                               "--hidden-states-path", hidden, *keep, *ENGINE], stdout=log, stderr=subprocess.STDOUT,
                              env=child_env())
    try:
        url = f"http://127.0.0.1:{port}"
        if not wait_healthy(url, server, 900):
            raise SystemExit(f"corecap serve exited ({server.returncode})" if server.poll() is not None
                             else "corecap serve did not become healthy")

        def ask(ids: list[int]) -> int:
            body = json.dumps({"prompt": ids, "max_tokens": 1}).encode()
            request = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=600) as answer:
                path = json.loads(answer.read())["kv_transfer_params"]["hidden_states_path"]
            os.remove(path)  # what speculators' reader does once it has the states
            return len(ids)

        start = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(clients) as pool:
            tokens = sum(pool.map(ask, prompts))
        seconds = time.monotonic() - start
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(120)
        log.close()
    result = {"mode": "serve-store" if store else "serve", "clients": clients, "samples": len(prompts),
              "tokens": tokens, "seconds": round(seconds, 2), "tokens_per_s": int(tokens / seconds)}
    if store:  # its last line says what it committed: every sample, or the bench is void
        with open(log.name) as f:
            found = re.search(r"--store .*: (\d+) samples committed", f.read())
        result["stored"] = int(found[1]) if found else None
        if result["stored"] != len(prompts):
            raise SystemExit(f"corecap serve --store committed {result['stored']} of {len(prompts)}: {log.name}")
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=96)
    ap.add_argument("--lengths", default="128,768", help="prompt lengths, low,high")
    ap.add_argument("--clients", default="4,16", help="concurrent clients of the server, comma-separated")
    ap.add_argument("--modes", default="run,serve", help="run, serve, serve-store (the server with --store)")
    ap.add_argument("--repeat", type=int, default=1, help="each server mode this many times, interleaved")
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    workdir = tempfile.mkdtemp(prefix="bench-serve-")
    model = tiny_llama(os.path.join(workdir, "model"), seed=0, **SHAPE)
    low, high = map(int, args.lengths.split(","))
    rows = random_prompts(args.samples, (low, high), (3, SHAPE["vocab_size"]), seed=0)
    data = write_jsonl(os.path.join(workdir, "prompts.jsonl"), rows)
    modes = args.modes.split(",")
    results = [run_rate(model, data, workdir)] if "run" in modes else []
    prompts = [r["input_ids"] for r in rows]
    for _ in range(args.repeat):
        for c in args.clients.split(","):
            for mode in [m for m in modes if m != "run"]:
                results.append(serve_rate(model, prompts, workdir, int(c), store=mode == "serve-store"))
    for result in results:
        append_jsonl(os.path.join(args.out, "bench_serve.jsonl"), {**result, "command": command_line()})
    base = results[0]["tokens_per_s"]
    for r in results:
        who = "corecap run" if r["mode"] == "run" else f"corecap {r['mode'].replace('-store', ' --store')}, " \
              f"{r['clients']} clients"
        print(f"{who:36s} {r['tokens_per_s']:>8,} tokens/s  {r['tokens_per_s'] / base:.3f}x  "
              f"({r['tokens']:,} tokens in {r['seconds']} s)")


if __name__ == "__main__":
    main()
