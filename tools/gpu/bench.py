"""GPU benchmark, one device call: plain vLLM prefill vs vLLM's built-in hidden-state extraction vs
corecap vs HF transformers, on a Llama-3-8B-shaped model with dummy weights, 512 prompts x 1,024
random tokens, layers 2,16,29,32, prefix caching off; plus the disk's fsync'd sequential bandwidth
(dd) and the store's, with corecap's commit pattern, against LMDB's.

    VLLM_USE_FLASHINFER_SAMPLER=0 python3 -m tools.gpu.bench \
        --modes dd,store,corecap,plain,extract,hf [--repeat 1] [--prompts 512] [--out DIR] [--dir DISK]

--dir is the disk under test (default: the home directory): the model's config.json, the stores and dd's file go there.

A mode may carry its own prompt count, `corecap@1024` (for the peak-RSS-as-prompts-double check).
`--dp N` (a multi-GPU machine): corecap runs N engine replicas, one per GPU, into one store
(`-dp N`), and plain vLLM, which refuses offline data parallelism for a dense model, runs N
processes at once, one per GPU (CUDA_VISIBLE_DEVICES=k), each with its share of the prompts:
their summed tokens/s is the N-replica baseline. --prompts is the total over the replicas.
`plain-sync` is plain vLLM with async scheduling off, as corecap steps it. `corecap-fp8` stores lossy
fp8 (`--store-dtype fp8`), `corecap-raw` the raw codec (`--codec raw`), and `corecap-socket` sends
the states inside the ZeroMQ messages instead of through the shared-memory ring
(`RunConfig.ring=False`, which corecap's tests use; the CLI has no flag for it).

Modes dropped (docs/benchmarks.md keeps their results, measured with environment switches
the package no longer reads: it has no CORECAP_* switch but the cache location):
`corecap-earlycopy` (CORECAP_EARLY_COPY=1: the device-to-host copy before the step's output),
`corecap-serial` (CORECAP_STEPS_IN_FLIGHT=1: one engine step in flight) and
`corecap-sinkthreads` (CORECAP_SINK_TORCH_THREADS=16, CORECAP_SINK_COPY_THREADS=1: the sink's old
thread settings) measured orders and settings that are now fixed in the code
(corecap/_vllm/worker.py, `STEPS_IN_FLIGHT` in corecap/_vllm/engine.py, `_TORCH_THREADS` and
`copy_threads()` in corecap/sink/process.py); mode `store` no longer writes a format 1 store
(states inline in LMDB, `store_format1_put_many_gb_s`): this corecap reads and writes formats 2
and 3 only (corecap/store/format.py, `READABLE_VERSIONS`).
Each mode runs in its own process (one engine per process); every result is a JSON line in
DIR/bench_gpu.jsonl. Clocks: "capture" = until the last sample is handed to storage; "durable" =
until everything is on disk (corecap: the last commit, states fdatasync'd and LMDB fsync'd;
built-in: all files exist and os.sync() returned). Both start when generation starts (after the
engine is up and warm): for corecap, when it starts reading the dataset and adding requests.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import time

from tools.common import traces
from tools.common.child import PREFIX, append_jsonl, child_env, run_bounded
from tools.common.disk import dd_rate

CONFIG = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096, intermediate_size=14336,
    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
    max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0, torch_dtype="bfloat16",
    bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
)
LAYERS = [2, 16, 29, 32]
PROMPT_LEN = 1024
ENGINE = dict(max_model_len=2048, max_num_seqs=256, max_num_batched_tokens=16384, gpu_memory_utilization=0.85)


def prompts(n: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(10, 128000) for _ in range(PROMPT_LEN)] for _ in range(n)]


def model_dir(args) -> str:
    return os.path.join(args.dir, "llama8b")


def emit(out: str, rec: dict) -> None:
    print(PREFIX + json.dumps(rec), flush=True)
    append_jsonl(os.path.join(out, "bench_gpu.jsonl"), rec)


def mode_dd(args) -> dict:
    return {"gb_s": dd_rate(args.dir, 2048 << 20, block_mib=1)}


def mode_store(args) -> dict:
    """4 GiB of raw 32 MiB samples (1,024 tokens x 4 layers x 4,096 x bf16), 2 per commit, into:
    corecap's store (states files + LMDB pointers) by put_many and by the writer's pipelined
    append/commit; plain LMDB puts for comparison."""
    import threading

    import lmdb
    import numpy as np
    import torch

    from corecap.store import FORMAT_VERSION, LAYER_MEANING, ModelIdentity, Store, StoreMeta, encode_sample

    path = os.path.join(args.dir, "bw.store")
    ident = ModelIdentity(
        path="x", architecture="x", config_hash="x", weights_fingerprint="x", num_layers=32, hidden_size=4096,
        vocab_size=128256,
    )
    states = torch.randn(4, PROMPT_LEN, 4096).bfloat16()
    ids = np.arange(PROMPT_LEN)
    batch = [encode_sample(f"k{j}", ids, states, tuple(LAYERS)) for j in range(2)]
    out = {}

    def batches():
        return [[dataclasses.replace(r, key=f"k{i}-{r.key}") for r in batch] for i in range(64)]

    for name, pipelined in [("store_put_many", False), ("store_pipelined", True)]:
        shutil.rmtree(path, ignore_errors=True)
        meta = StoreMeta(format_version=FORMAT_VERSION, model=ident, layers=tuple(LAYERS), layer_meaning=LAYER_MEANING,
                         dtype="bfloat16", hidden_size=4096, corecap_version="0", vllm_version="0")
        todo = batches()
        with Store.create_or_open(path, meta) as store:
            t = time.perf_counter()
            nbytes = 0
            if pipelined:  # as corecap/sink/writer.py: write batch i+1 while batch i is synced and committed
                import queue

                q: queue.Queue = queue.Queue(maxsize=1)
                committer = threading.Thread(target=lambda: [store.commit(a) for a in iter(q.get, None)])
                committer.start()
                for records in todo:
                    q.put(store.append(records))
                    nbytes += sum(r.nbytes for r in records)
                q.put(None)
                committer.join()
            else:
                for records in todo:
                    nbytes += store.put_many(records)
            out[f"{name}_gb_s"] = nbytes / (time.perf_counter() - t) / 1e9
    shutil.rmtree(path, ignore_errors=True)
    value = states.view(torch.uint8).numpy()
    lmdb_settings = [("default_32MiB", {}, 1), ("default_256MiB", {}, 8), ("writemap", {"writemap": True}, 2)]
    for name, flags, per_txn in lmdb_settings:
        env = lmdb.open(path, map_size=16 << 30, **flags)
        t = time.perf_counter()
        for i in range(0, 128, per_txn):
            with env.begin(write=True) as txn:
                for j in range(per_txn):
                    txn.put(b"%08d" % (i + j), value)
        out[f"lmdb_{name}_gb_s"] = 128 * value.nbytes / (time.perf_counter() - t) / 1e9
        env.close()
        shutil.rmtree(path)
    return out


def mode_plain(args) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    extra = {"async_scheduling": False} if args.one == "plain-sync" else {}
    t0 = time.perf_counter()
    llm = LLM(model=model_dir(args), load_format="dummy", skip_tokenizer_init=True, enable_prefix_caching=False,
              **ENGINE, **extra)
    load = time.perf_counter() - t0
    sp = SamplingParams(max_tokens=1, detokenize=False)
    ps = prompts(args.prompts)
    llm.generate([TokensPrompt(prompt_token_ids=p) for p in ps[:32]], sp, use_tqdm=False)
    t = time.perf_counter()
    llm.generate([TokensPrompt(prompt_token_ids=p) for p in ps], sp, use_tqdm=False)
    dt = time.perf_counter() - t
    try:
        async_scheduling = llm.llm_engine.vllm_config.scheduler_config.async_scheduling
    except AttributeError:
        async_scheduling = "unknown"
    return {"tok_s": len(ps) * PROMPT_LEN / dt, "seconds": dt, "load_s": load, "async_scheduling": async_scheduling}


def mode_extract(args) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    path = os.path.join(args.dir, "hs_extract")
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    t0 = time.perf_counter()
    llm = LLM(
        model=model_dir(args), load_format="dummy", skip_tokenizer_init=True, enable_prefix_caching=False, **ENGINE,
        speculative_config={"method": "extract_hidden_states", "num_speculative_tokens": 1,
                            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": LAYERS}}},
        kv_transfer_config={"kv_connector": "ExampleHiddenStatesConnector", "kv_role": "kv_producer",
                            "kv_connector_extra_config": {"shared_storage_path": path}},
    )
    load = time.perf_counter() - t0
    sp = SamplingParams(max_tokens=1, detokenize=False)
    ps = prompts(args.prompts)
    llm.generate([TokensPrompt(prompt_token_ids=p) for p in ps[:32]], sp, use_tqdm=False)
    n_warm = len(glob.glob(path + "/*.safetensors"))
    t = time.perf_counter()
    llm.generate([TokensPrompt(prompt_token_ids=p) for p in ps], sp, use_tqdm=False)
    t_gen = time.perf_counter() - t
    while len(glob.glob(path + "/*.safetensors")) < n_warm + len(ps) and time.perf_counter() - t < 600:
        time.sleep(0.05)
    os.sync()
    t_dur = time.perf_counter() - t
    files = glob.glob(path + "/*.safetensors")
    nbytes = sum(os.path.getsize(f) for f in files)
    shutil.rmtree(path, ignore_errors=True)
    tokens = len(ps) * PROMPT_LEN
    return {"capture_tok_s": tokens / t_gen, "durable_tok_s": tokens / t_dur, "files": len(files),
            "bytes_per_token": nbytes / ((n_warm + len(ps)) * PROMPT_LEN) if files else None, "load_s": load}


def corecap_options(mode: str, codec: str | None = None) -> dict:
    """RunConfig options of a corecap mode beyond the workload's (config.build's names)."""
    from corecap.store import FP8

    options = {"codec": codec} if codec else {}
    return {**options, **{"corecap-fp8": {"codec": FP8}, "corecap-raw": {"codec": "raw"},
                          "corecap-socket": {"ring": False}}.get(mode, {})}


def mode_corecap(args) -> dict:
    from corecap.store.codec import crc32
    from corecap.config import build
    from corecap.run import run

    data = os.path.join(args.dir, f"prompts-{args.prompts}.jsonl")
    with open(data, "w") as f:
        for i, p in enumerate(prompts(args.prompts)):
            f.write(json.dumps({"id": f"p{i}", "input_ids": p}) + "\n")
    store = os.path.join(args.dir, "corecap.lmdb")
    shutil.rmtree(store, ignore_errors=True)
    extra = corecap_options(args.one, args.codec)
    cfg = build(
        model=model_dir(args), data=data, store=store, layers=tuple(LAYERS), batch=ENGINE["max_num_seqs"],
        max_len=ENGINE["max_model_len"], max_batched_tokens=ENGINE["max_num_batched_tokens"],
        load_format="dummy", memory_utilization=ENGINE["gpu_memory_utilization"], dp=args.dp, **extra,
    )
    t0 = time.perf_counter()
    summary = run(cfg, log=lambda m: print(m, flush=True))
    wall = time.perf_counter() - t0
    trace = traces.load(store)
    # From the moment corecap starts reading the dataset and adding requests, as plain vLLM's
    # clock starts when generate() is called (the rates from the first engine step are kept too,
    # as `*_from_first_step`, for comparison).
    tokens = summary.num_tokens
    rates, from_first_step = traces.rates(trace, tokens, since="start"), traces.rates(trace, tokens)
    name = f"trace_{args.one}_{args.prompts}_{time.strftime('%H%M%S')}.json"  # one per run, repeats too
    shutil.copy(os.path.join(store, "trace.json"), os.path.join(args.out, name))
    shutil.rmtree(store, ignore_errors=True)
    return {
        "capture_tok_s": rates["capture_tok_s"], "durable_tok_s": rates["durable_tok_s"],
        "steps_tok_s": rates["steps_tok_s"],
        "capture_from_first_step_tok_s": from_first_step["capture_tok_s"],
        "durable_from_first_step_tok_s": from_first_step["durable_tok_s"],
        "feed_s": trace["steps"][0]["start"] - trace["start"],
        "bytes_per_token": summary.nbytes / tokens, "committed": summary.num_committed,
        "driver_peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "largest_child_peak_rss_gb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20, "wall_s": wall,
        "raw_bytes_per_token": summary.raw_bytes / tokens,
        "codec": extra.get("codec", "default"), "ring": cfg.ring, "trace": name, "workers": trace.get("workers", []),
        "crc32": crc32.__module__,  # zlib_ng.zlib_ng, or zlib where zlib-ng's wheel did not come along
        "dp": args.dp, "replicas_stepped": sorted({s.get("replica", 0) for s in trace["steps"]}),
    }


def mode_hf(args) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**{k: v for k, v in CONFIG.items() if k not in ("architectures", "model_type")})
    with torch.device("cuda"):
        m = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    batch, n = 8, 64
    ids = torch.tensor(prompts(n), device="cuda")
    with torch.no_grad():
        m(ids[:batch], output_hidden_states=True)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for i in range(0, n, batch):
            o = m(ids[i : i + batch], output_hidden_states=True)
            torch.stack([o.hidden_states[k] for k in LAYERS]).cpu()
        torch.cuda.synchronize()
        dt = time.perf_counter() - t
    return {"tok_s": n * PROMPT_LEN / dt, "batch": batch}


MODES = {"dd": mode_dd, "store": mode_store, "plain": mode_plain, "plain-sync": mode_plain, "extract": mode_extract,
         "corecap": mode_corecap, "corecap-fp8": mode_corecap, "corecap-raw": mode_corecap,
         "corecap-socket": mode_corecap,
         "hf": mode_hf}
# Modes of earlier calls whose switches are gone (the docstring says why); asked for, they are refused.
DROPPED = {"corecap-earlycopy": "CORECAP_EARLY_COPY", "corecap-serial": "CORECAP_STEPS_IN_FLIGHT",
           "corecap-sinkthreads": "CORECAP_SINK_TORCH_THREADS, CORECAP_SINK_COPY_THREADS"}


def parse_modes(text: str, prompts: int) -> list[tuple[str, int]]:
    """`--modes`: (mode, prompts) per entry; `corecap@1024` carries its own prompt count."""
    out = []
    for entry in text.split(","):
        mode, _, num = entry.strip().partition("@")
        if mode in DROPPED:
            raise ValueError(f"mode {mode!r} was dropped: corecap no longer reads {DROPPED[mode]} (see --help)")
        if mode not in MODES:
            raise ValueError(f"mode {mode!r}: expected one of {', '.join(MODES)}")
        if num and not (num.isdigit() and int(num) > 0):
            raise ValueError(f"mode {entry!r}: expected MODE@PROMPTS with a positive count")
        out.append((mode, int(num) if num else prompts))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=f"modes: {', '.join(MODES)}")
    ap.add_argument("--modes", default="dd,store,corecap,plain,extract,hf",
                    help="comma-separated; MODE@PROMPTS for its own count")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=512)
    ap.add_argument("--codec", default=None, help="corecap store codec (default: corecap's default)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--timeout", type=int, default=300)
    ap.add_argument("--dp", type=int, default=1,
                    help="data-parallel replicas, one GPU each (corecap -dp N; plain: N processes)")
    ap.add_argument("--dir", default=os.path.expanduser("~"),
                    help="the disk under test: model config, stores, dd (default: ~)")
    args = ap.parse_args()
    try:
        modes = parse_modes(args.one or args.modes, args.prompts)
    except ValueError as e:
        ap.error(str(e))
    os.makedirs(model_dir(args), exist_ok=True)
    with open(os.path.join(model_dir(args), "config.json"), "w") as f:
        json.dump(CONFIG, f)
    if args.one:
        rec = {"mode": args.one, "prompts": args.prompts, **MODES[args.one](args)}
        emit(args.out, rec)
        return
    for r in range(args.repeat):
        for mode, num in modes:
            cmd = [sys.executable, "-m", __spec__.name, "--one", mode, "--prompts", str(num), "--out", args.out,
                   "--dp", str(args.dp), "--dir", args.dir]
            if args.codec:
                cmd += ["--codec", args.codec]
            t = time.time()
            if args.dp > 1 and mode in ("plain", "plain-sync"):
                _plain_replicas(args, mode, num, r)
                continue
            rc, err = run_bounded(cmd, args.timeout, env=child_env())
            if rc != 0:
                emit(args.out, {"mode": mode, "repeat": r, "rc": rc, "seconds": round(time.time() - t),
                                "stderr_tail": (err or "")[-3000:]})
            else:
                print(f"{mode}: ok in {time.time() - t:.0f}s", flush=True)


def _plain_replicas(args, mode: str, prompts: int, repeat: int) -> None:
    """Plain vLLM's N-replica baseline: N processes at once, one GPU and 1/N of the prompts each."""
    share = prompts // args.dp
    procs = []
    for k in range(args.dp):
        out = os.path.join(args.out, f"replica{k}")
        cmd = [sys.executable, "-m", __spec__.name, "--one", mode, "--prompts", str(share), "--out", out, "--dir",
               args.dir]
        os.makedirs(out, exist_ok=True)
        env = child_env({"CUDA_VISIBLE_DEVICES": str(k)})
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
    results = []
    for k, proc in enumerate(procs):
        out, err = proc.communicate(timeout=args.timeout)
        lines = [json.loads(x.removeprefix(PREFIX)) for x in out.splitlines() if x.startswith(PREFIX)]
        if proc.returncode != 0 or not lines:
            emit(args.out, {"mode": mode, "dp": args.dp, "replica": k, "repeat": repeat, "rc": proc.returncode,
                            "stderr_tail": err[-3000:]})
            return
        results.append(lines[-1])
    emit(args.out, {"mode": mode, "dp": args.dp, "prompts": share * args.dp, "repeat": repeat,
                    "tok_s": sum(r["tok_s"] for r in results), "seconds_max": max(r["seconds"] for r in results),
                    "per_replica_tok_s": [r["tok_s"] for r in results]})


if __name__ == "__main__":
    main()
