"""`corecap serve` on a GPU, under many concurrent clients: against `corecap run` on the same
prompts, and against `vllm serve` with vLLM's `extract_hidden_states` and speculators' file
connector (vLLM's `ExampleHiddenStatesConnector`, configured as speculators' launcher does).

    VLLM_USE_FLASHINFER_SAMPLER=0 python3 -m tools.gpu.serve --shape 8b --modes run,serve,vllm \
        [--clients 64,256,512] [--prompts N] [--dir DIR] [--out DIR]

Shapes and prompts are tools/gpu/shapes.py's (dummy weights, random token ids). Every mode
captures the same states: the shape's three aux layers and the last layer's output before the
final norm (speculators' file: `--layers A,B,C,prenorm` for corecap, aux ids `A,B,C,N` for vLLM).

- run: `corecap run` into a store under --dir; its rates are its trace's (from reading the data
  to the last sample handed to storage, and to the last durable commit), as tools/gpu/shapes.py
  reports them.
- serve: `corecap serve --hidden-states-backend file --hidden-states-path DIR/hidden_states`;
  vllm: `vllm serve` (`python -m vllm.entrypoints.openai.api_server`) with the connector writing
  under the same folder. Once the server answers /health, 64 short warm-up prompts (not a prefix of
  the measured ones) go first; then, for each client count C, C threads post every prompt once
  to /v1/completions (token ids, max_tokens 1, as speculators' reader asks), wait for the file's
  `.lock` as speculators' reader does, and remove both. A wave's rate is its prompts'
  tokens over the time from its first request to its last file removed: it includes the wave's
  first engine steps, not the engine's start.

Each result is a JSON line in OUT/bench_gpu_serve.jsonl; a table is printed at the end. A server
that fails to start (vLLM refuses MLA models in its hidden-states connector) is recorded with the
last lines of its log.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request

import numpy as np

from tools.common import traces
from tools.common.child import append_jsonl, child_env, command_line, free_port, wait_healthy
from tools.gpu.shapes import ROOT, SHAPES, model_dir, prompts, write_prompts

WARM_UP = 64


def layers(shape: str) -> tuple[str, list[int]]:
    """corecap's `--layers` and vLLM's aux layer ids for the same states: the shape's aux layers
    and the last layer's output before the final norm."""
    aux = [int(k) for k in SHAPES[shape]["layers"].split(",")[:-1]]
    num_layers = SHAPES[shape]["config"]["num_hidden_layers"]
    return ",".join(map(str, aux)) + ",prenorm", [*aux, num_layers]


def mode_run(args, ps: list[np.ndarray]) -> dict:
    data = write_prompts(os.path.join(args.dir, f"{args.shape}-serve-prompts.jsonl"), ps)
    store = os.path.join(args.dir, "serve-bench-store.lmdb")
    shutil.rmtree(store, ignore_errors=True)
    cmd = [sys.executable, "-m", "corecap.cli", "run", "--model", model_dir(args.dir, args.shape), "--data", data,
           "--store", store, "--layers", layers(args.shape)[0], "--load-format", "dummy"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=child_env(), timeout=args.timeout)
    if proc.returncode != 0:
        return {"mode": "run", "failed": True, "stderr_tail": proc.stderr[-2000:]}
    rates = traces.rates(traces.load(store), sum(len(p) for p in ps), since="start")
    shutil.rmtree(store, ignore_errors=True)
    return {"mode": "run", "capture_tok_s": rates["capture_tok_s"], "durable_tok_s": rates["durable_tok_s"],
            "capture_s": rates["capture_s"], "summary": proc.stdout.strip().splitlines()[-1]}


def server_command(args, mode: str, port: int, hidden: str) -> list[str]:
    model = model_dir(args.dir, args.shape)
    corecap_layers, vllm_ids = layers(args.shape)
    if mode == "serve":
        return [sys.executable, "-m", "corecap.cli", "serve", "--model", model, "--port", str(port),
                "--load-format", "dummy", "--layers", corecap_layers,
                "--hidden-states-backend", "file", "--hidden-states-path", hidden]
    speculative = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
                   "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": vllm_ids}}}
    transfer = {"kv_connector": "ExampleHiddenStatesConnector", "kv_role": "kv_producer",
                "kv_connector_extra_config": {"shared_storage_path": hidden}}
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--port", str(port),
            "--load-format", "dummy", "--skip-tokenizer-init", "--served-model-name", "bench",
            "--speculative-config", json.dumps(speculative), "--kv-transfer-config", json.dumps(transfer),
            *args.vllm_args.split()]


def mode_server(args, ps: list[np.ndarray], mode: str) -> list[dict]:
    port = free_port()
    hidden = os.path.join(args.dir, "hidden_states")
    shutil.rmtree(hidden, ignore_errors=True)
    os.makedirs(hidden)
    log_path = os.path.join(args.out, f"gpu_serve_{args.shape}_{mode}.log")
    with open(log_path, "w") as log:
        server = subprocess.Popen(server_command(args, mode, port, hidden), stdout=log, stderr=subprocess.STDOUT,
                                  env=child_env())
    url = f"http://127.0.0.1:{port}"
    try:
        start = time.monotonic()
        if not wait_healthy(url, server, args.timeout):
            return [{"mode": mode, "failed": True, "log_tail": _tail(log_path)}]
        started = time.monotonic() - start
        warm = np.random.default_rng(1).integers(10, 1000, size=(WARM_UP, 128))
        _wave(url, list(warm), WARM_UP, mode)
        results = []
        for clients in args.clients:
            tokens, seconds = _wave(url, ps, clients, mode)
            results.append({"mode": mode, "clients": clients, "prompts": len(ps), "tokens": tokens,
                            "seconds": round(seconds, 2), "tok_s": tokens / seconds, "start_s": round(started, 1)})
        return results
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(120)
        except subprocess.TimeoutExpired:
            server.kill()


def _wave(url: str, ps: list[np.ndarray], clients: int, mode: str) -> tuple[int, float]:
    def ask(ids: np.ndarray) -> int:
        body = {"prompt": ids.tolist(), "max_tokens": 1, **({"model": "bench"} if mode == "vllm" else {})}
        request = urllib.request.Request(f"{url}/v1/completions", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=900) as answer:
            path = json.loads(answer.read())["kv_transfer_params"]["hidden_states_path"]
        _take(path)
        return len(ids)

    start = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        tokens = sum(pool.map(ask, ps))
    return tokens, time.monotonic() - start


def _take(path: str) -> None:
    """What speculators' reader does with a file before loading it, then what it does after:
    wait for the writer's lock (flock on `path.lock`), remove the lock, remove the file."""
    lock = path + ".lock"
    if os.path.exists(lock):
        fd = os.open(lock, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        finally:
            os.close(fd)
        os.remove(lock)
    os.remove(path)


def _tail(path: str) -> str:
    with open(path, errors="replace") as f:
        return f.read()[-2500:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="8b", choices=sorted(SHAPES))
    ap.add_argument("--modes", default="run,serve,vllm", help="comma-separated: run, serve, vllm")
    ap.add_argument("--clients", default="64,256,512", type=lambda s: [int(c) for c in s.split(",")])
    ap.add_argument("--prompts", type=int, default=None, help="default: the shape's corecap prompt count")
    ap.add_argument("--vllm-args", default="", help="more options for `vllm serve` (a CPU smoke test: "
                    "'--gpu-memory-utilization 0.2')")
    ap.add_argument("--timeout", type=int, default=540, help="seconds for a run, or for a server to start")
    ap.add_argument("--dir", default=ROOT, help="models' configs, prompts, the store, the states' files")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    ps = prompts(args.shape, args.prompts or SHAPES[args.shape]["corecap_prompts"])
    results = []
    for mode in args.modes.split(","):
        got = [mode_run(args, ps)] if mode == "run" else mode_server(args, ps, mode)
        for result in got:
            result = {"shape": args.shape, **result, "command": command_line()}
            append_jsonl(os.path.join(args.out, "bench_gpu_serve.jsonl"), result)
            print(json.dumps(result), flush=True)
        results += got
    base = next((r["capture_tok_s"] for r in results if r["mode"] == "run" and not r.get("failed")), None)
    for r in results:
        if r.get("failed"):
            print(f"{r['mode']:6s} FAILED: {(r.get('log_tail') or r.get('stderr_tail', '')).strip()[-300:]}")
        elif r["mode"] == "run":
            print(f"run    capture {r['capture_tok_s']:,.0f} tok/s, durable {r['durable_tok_s']:,.0f} tok/s")
        else:
            ratio = f"  {r['tok_s'] / base:.3f}x run's capture" if base else ""
            print(f"{r['mode']:6s} {r['clients']:4d} clients {r['tok_s']:,.0f} tok/s{ratio}")


if __name__ == "__main__":
    main()
