"""corecap with its DEFAULT flags against plain vLLM with ITS defaults, on several model shapes
(dummy weights), as a new user runs them: `corecap run --model --data --store --layers
--load-format dummy` and nothing else, against `LLM(model, load_format="dummy").generate(...,
max_tokens=1)`. One process per mode; every result a JSON line in OUT/bench_shapes.jsonl.

    VLLM_USE_FLASHINFER_SAMPLER=0 python3 -m tools.gpu.shapes \
        --runs 1b:plain,1b:corecap,1b:corecap-fp8,1b:corecap-raw,8b:plain,8b:corecap [--out DIR] [--dir DIR]

--dir holds the models' configs, the prompts, the store and dd's file (default:
BENCH_SHAPES_ROOT, else ~/shapes).

Shapes (configs of the public models, dummy weights): 8b (Llama-3-8B, 1,024 x 1,024 tokens),
1b (Llama-3.2-1B, 256-token prompts), dsv2lite (DeepSeek-V2-Lite: MLA + MoE, 1,024-token
prompts), qwen3moe (Qwen3-30B-A3B, 1,024-token prompts), dsv3 (DeepSeek-V3 / Kimi-K2's 61 layers
with 16 routed experts, 1,024-token prompts; dsv3-seed: the same with the seed's --max-num-seqs 4
--max-model-len 2048, given to plain vLLM too; dsv3-h100: its experts a sixth as wide, to fit an
80 GB H100), 8b-a (the 8b model on issue 19's
dataset (a): a 2,048-token prompt shared by all, then a unique 256-1,024-token tail; rates
count every sample's tokens, cached or not). Prompt counts give each corecap run
>= 20 s of steady capture at the rates seen before, and plain vLLM as long or longer.
Modes: plain, plain-fp8q (`quantization="fp8"`), corecap, corecap-fp8 (`--store-dtype fp8`),
corecap-raw (`--codec raw`), corecap-fp8q (`--quantization fp8`), corecap-pc
(`--enable-prefix-caching`: what caching costs where nothing is shared), dd (the disk's fsync'd
write rate). `SHAPE:MODE@N` runs N prompts instead of the shape's count (a longer steady phase).
corecap's rates come from its trace: from when it starts reading the dataset to the last
sample handed to storage (capture) and to the last durable commit (durable); plain's from
generate()'s call to its return. Both exclude the engine's start.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time

import numpy as np

from tools.common import traces
from tools.common.child import PREFIX, append_jsonl, child_env, run_bounded
from tools.common.disk import dd_rate
from tools.common.rss import RssPeaks, process_tree

ROOT = os.environ.get("BENCH_SHAPES_ROOT", os.path.expanduser("~/shapes"))  # --dir's default
LLAMA = dict(model_type="llama", architectures=["LlamaForCausalLM"], rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
             hidden_act="silu", torch_dtype="bfloat16")
SHAPES = {
    "8b": dict(config={**LLAMA, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                       "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
                       "max_position_embeddings": 8192, "rope_theta": 500000.0, "tie_word_embeddings": False},
               prompt_len=1024, plain_prompts=1024, corecap_prompts=1024, layers="2,16,29,32"),
    "1b": dict(config={**LLAMA, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                       "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256,
                       "max_position_embeddings": 131072, "rope_theta": 500000.0, "tie_word_embeddings": True,
                       "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                        "original_max_position_embeddings": 8192, "rope_type": "llama3"}},
               prompt_len=256, plain_prompts=22528, corecap_prompts=8192, layers="2,8,13,16"),
    "dsv2lite": dict(config={"model_type": "deepseek_v2", "architectures": ["DeepseekV2ForCausalLM"],
                             "vocab_size": 102400,
                             "hidden_size": 2048, "intermediate_size": 10944, "moe_intermediate_size": 1408,
                             "num_hidden_layers": 27, "num_attention_heads": 16, "num_key_value_heads": 16,
                             "n_shared_experts": 2, "n_routed_experts": 64, "routed_scaling_factor": 1.0,
                             "kv_lora_rank": 512, "q_lora_rank": None, "qk_rope_head_dim": 64, "v_head_dim": 128,
                             "qk_nope_head_dim": 128, "norm_topk_prob": False, "n_group": 1, "topk_group": 1,
                             "num_experts_per_tok": 6, "moe_layer_freq": 1, "first_k_dense_replace": 1,
                             "max_position_embeddings": 163840, "rms_norm_eps": 1e-6, "rope_theta": 10000,
                             "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707,
                                              "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096,
                                              "type": "yarn"},
                             "attention_bias": False, "scoring_func": "softmax", "topk_method": "greedy",
                             "tie_word_embeddings": False, "bos_token_id": 100000, "eos_token_id": 100001,
                             "hidden_act": "silu", "torch_dtype": "bfloat16"},
                     prompt_len=1024, plain_prompts=2048, corecap_prompts=2048, layers="2,13,24,27"),
    "qwen3moe": dict(config={"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 151936,
                             "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
                             "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
                             "head_dim": 128,
                             "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
                             "decoder_sparse_step": 1,
                             "mlp_only_layers": [], "max_position_embeddings": 40960, "rope_theta": 1000000.0,
                             "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "hidden_act": "silu",
                             "bos_token_id": 151643, "eos_token_id": 151645, "torch_dtype": "bfloat16"},
                     prompt_len=1024, plain_prompts=1536, corecap_prompts=1536, layers="2,24,45,48"),
    # issue 34 item 7: DeepSeek-V3 / Kimi-K2's 61 layers, hidden 7,168, MLA and the noaux_tc router
    # of 8 groups (top 4 groups, top 8 experts) as released, but 16 routed experts of 1,536 instead
    # of 256 of 2,048, so its ~93 GB of bf16 weights fit one H200 beside a KV cache for the model's
    # whole 163,840 tokens (at 16 experts of 2,048: ~114 GB, too little left for that).
    "dsv3": dict(config={"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"],
                         "vocab_size": 129280,
                         "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 1536,
                         "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
                         "n_shared_experts": 1, "n_routed_experts": 16, "routed_scaling_factor": 2.5,
                         "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128,
                         "qk_nope_head_dim": 128, "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4,
                         "num_experts_per_tok": 8, "moe_layer_freq": 1, "first_k_dense_replace": 3,
                         "norm_topk_prob": True, "scoring_func": "sigmoid",
                         "max_position_embeddings": 163840, "rms_norm_eps": 1e-6, "rope_theta": 10000,
                         "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                                          "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                                          "type": "yarn"},
                         "attention_bias": False, "tie_word_embeddings": False, "bos_token_id": 0,
                         "eos_token_id": 1, "hidden_act": "silu", "torch_dtype": "bfloat16"},
                 prompt_len=1024, plain_prompts=256, corecap_prompts=256, layers="2,30,58,60"),
    # a smoke test of this script on a CPU
    "tiny": dict(config={**LLAMA, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4,
                         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 2048,
                         "max_position_embeddings": 1024, "tie_word_embeddings": False},
                 prompt_len=128, plain_prompts=64, corecap_prompts=64, layers="1,2,4"),
}
# Issue 19's dataset (a) on a shape: one 2,048-token system prompt shared by every prompt, then a
# unique tail of 256-1,024 tokens (the same seed and lengths as tools/bench/prefix.py's (a)).
SHARED_PREFIX, TAILS = 2048, (256, 1024)
SHAPES["8b-a"] = dict(SHAPES["8b"], shared_prefix=True, plain_prompts=1024, corecap_prompts=1024)
SHAPES["tiny-a"] = dict(SHAPES["tiny"], config={**SHAPES["tiny"]["config"], "max_position_embeddings": 4096},
                        shared_prefix=True, plain_prompts=16, corecap_prompts=16)
# The seed's command (issue 34 item 7): its engine limits, given to plain vLLM and corecap alike.
SHAPES["dsv3-seed"] = dict(SHAPES["dsv3"], engine={"max_num_seqs": 4, "max_model_len": 2048})
# dsv3 for an 80 GB H100, where dsv3's 87.6 GiB of bf16 weights do not load (CUDA out of memory,
# 2026-12-05): the same 61 layers, attention and router, its 16 routed experts a sixth as wide
# (256): 19.9B parameters, 37.1 GiB, counted with transformers' DeepseekV3ForCausalLM on the meta
# device. At 768 wide (57.3 GiB) vLLM's profile left -2.63 GiB for the KV cache under corecap's
# defaults (beside 4.81 GiB of CUDA graphs; 2026-12-05), and one sequence of the model's 163,840
# tokens needs ~10.7 GiB of MLA cache (576 bf16 values a token a layer).
SHAPES["dsv3-h100"] = dict(SHAPES["dsv3"], config={**SHAPES["dsv3"]["config"], "moe_intermediate_size": 256})
CORECAP_FLAGS = {"corecap": [], "corecap-fp8": ["--store-dtype", "fp8"], "corecap-raw": ["--codec", "raw"],
                 "corecap-fp8q": ["--quantization", "fp8"], "corecap-pc": ["--enable-prefix-caching"]}


def model_dir(root: str, shape: str) -> str:
    path = os.path.join(root, shape)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(SHAPES[shape]["config"], f)
    return path


def prompts(shape: str, n: int) -> list[np.ndarray]:
    s = SHAPES[shape]
    vocab = s["config"]["vocab_size"]
    rng = np.random.default_rng(0)
    if not s.get("shared_prefix"):
        return list(rng.integers(10, vocab - 1000, size=(n, s["prompt_len"]), dtype=np.int64))
    system = rng.integers(10, vocab - 1000, size=SHARED_PREFIX, dtype=np.int64)
    return [np.concatenate([system, rng.integers(10, vocab - 1000, size=int(k), dtype=np.int64)])
            for k in rng.integers(TAILS[0], TAILS[1] + 1, size=n)]


def write_prompts(path: str, ps: list[np.ndarray]) -> str:
    """The prompts as corecap's data file (rows `{"id": "pN", "input_ids": [...]}`); its path."""
    with open(path, "w") as f:
        for i, p in enumerate(ps):
            f.write(json.dumps({"id": f"p{i}", "input_ids": p.tolist()}) + "\n")
    return path


def mode_dd(args) -> dict:
    return {"gb_s": dd_rate(args.dir, 4096 << 20, block_mib=1)}


def mode_plain(args) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    extra = {"quantization": "fp8"} if args.mode == "plain-fp8q" else {}
    extra.update(SHAPES[args.shape].get("engine", {}))
    t0 = time.perf_counter()
    llm = LLM(model=model_dir(args.dir, args.shape), load_format="dummy", skip_tokenizer_init=True, **extra)
    load = time.perf_counter() - t0
    sp = SamplingParams(max_tokens=1, detokenize=False)
    ps = prompts(args.shape, args.prompts or SHAPES[args.shape]["plain_prompts"])
    warm = np.random.default_rng(1).integers(10, 1000, size=(32, len(ps[0])))  # not a prefix of the run's prompts
    llm.generate([TokensPrompt(prompt_token_ids=p.tolist()) for p in warm], sp, use_tqdm=False)
    batch = [TokensPrompt(prompt_token_ids=p.tolist()) for p in ps]
    tokens = sum(len(p) for p in ps)
    t = time.perf_counter()
    llm.generate(batch, sp, use_tqdm=False)
    dt = time.perf_counter() - t
    c = llm.llm_engine.vllm_config
    return {"tok_s": tokens / dt, "seconds": dt, "load_s": load, "tokens": tokens,
            "max_num_batched_tokens": c.scheduler_config.max_num_batched_tokens,
            "max_num_seqs": c.scheduler_config.max_num_seqs,
            "async_scheduling": c.scheduler_config.async_scheduling,
            "prefix_caching": c.cache_config.enable_prefix_caching,
            # what vLLM left for the KV cache, as corecap's record has it in `memory_lines` ("GPU
            # KV cache size: N tokens"): vLLM's own log lines go to this child's stdout, not kept
            "kv_cache_tokens": (c.cache_config.num_gpu_blocks or 0) * c.cache_config.block_size}


def mode_corecap(args) -> dict:
    ps = prompts(args.shape, args.prompts or SHAPES[args.shape]["corecap_prompts"])
    data = write_prompts(os.path.join(args.dir, f"{args.shape}-prompts.jsonl"), ps)
    store = os.path.join(args.dir, "store.lmdb")
    shutil.rmtree(store, ignore_errors=True)
    cmd = [sys.executable, "-m", "corecap.cli", "run", "--model", model_dir(args.dir, args.shape), "--data", data,
           "--store", store,
           "--layers", SHAPES[args.shape]["layers"], "--load-format", "dummy", *CORECAP_FLAGS[args.mode],
           *SHAPES[args.shape].get("corecap_flags", ()), *engine_flags(SHAPES[args.shape].get("engine", {}))]
    t0 = time.perf_counter()
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as child:
        with RssPeaks(process_tree(child.pid), interval=0.2) as peaks:
            stdout, stderr = child.communicate()
    proc = subprocess.CompletedProcess(cmd, child.returncode, stdout, stderr)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"corecap run failed ({proc.returncode}): {proc.stderr[-2000:]}\n{_log_tail(store)}")
    trace = traces.load(store)
    tokens = sum(len(p) for p in ps)  # the samples' tokens; with prefix caching the engine computes fewer
    rates = traces.rates(trace, tokens, since="start")
    nbytes = rates["committed_bytes"]
    name = f"trace_{args.shape}_{args.mode}_{time.strftime('%H%M%S')}.json"
    shutil.copy(os.path.join(store, "trace.json"), os.path.join(args.out, name))
    memory = memory_lines(_log(store))
    shutil.rmtree(store, ignore_errors=True)
    os.remove(data)
    return {
        "capture_tok_s": rates["capture_tok_s"], "durable_tok_s": rates["durable_tok_s"],
        "steps_tok_s": rates["steps_tok_s"], "capture_s": rates["capture_s"],
        "tokens": tokens, "computed_tokens": rates["computed_tokens"], "stored_bytes": nbytes,
        "bytes_per_token": nbytes / tokens, "wall_s": wall, "trace": name,
        "engine_line": next((line for line in proc.stderr.splitlines() if line.startswith("engine:")), ""),
        "prefix_line": next((line for line in proc.stderr.splitlines() if line.startswith("prefix cache: ")), ""),
        "summary": proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else "",
        "largest_child_peak_rss_gb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20,
        "peak_rss_gb_by_process": peaks.largest_gb(4),
        "workers": trace.get("workers", []), "memory_lines": memory,
    }


def engine_flags(engine: dict) -> list[str]:
    """A shape's engine limits as corecap's flags (vLLM's names, dashed)."""
    return [arg for key, value in engine.items() for arg in ("--" + key.replace("_", "-"), str(value))]


def _log(store: str) -> str:
    try:
        with open(os.path.join(store, "corecap.log"), errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def _log_tail(store: str) -> str:
    return _log(store)[-3000:]


MEMORY_WORDS = ("Model loading took", "KV cache memory", "CUDA graph memory", "KV cache size", "Maximum concurrency",
                "Graph capturing finished", "torch.compile took")


def memory_lines(log: str) -> list[str]:
    """vLLM's lines in a corecap run's log on where the GPU's memory went (weights, compile, graphs,
    KV cache), kept in its record (plain vLLM's record has `kv_cache_tokens`)."""
    return [line.strip()[-200:] for line in log.splitlines() if any(w in line for w in MEMORY_WORDS)]


MODES = {"dd": mode_dd, "plain": mode_plain, "plain-fp8q": mode_plain, **{m: mode_corecap for m in CORECAP_FLAGS}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", default="", help="comma-separated SHAPE:MODE[@PROMPTS] (or dd)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--timeout", type=int, default=420)
    ap.add_argument("--dir", default=ROOT, help="models' configs, prompts, store, dd's file (default: %(default)s)")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    out = os.path.join(args.out, "bench_shapes.jsonl")
    if args.one:
        answer_one(args, out)
        return
    run_each(__spec__.name, args, out)


def answer_one(args, out: str) -> None:
    """The child's part: the one run `--one SHAPE:MODE[@PROMPTS]` names, its record printed and appended to `out`."""
    run, _, count = args.one.partition("@")
    args.shape, _, args.mode = run.rpartition(":")
    args.prompts = int(count) if count else None
    rec = {"run": args.one, **MODES[args.mode](args)}
    print(PREFIX + json.dumps(rec), flush=True)
    append_jsonl(out, rec)


def run_each(module: str, args, out: str) -> None:
    """The parent's part: each of `--runs` in a child `python -m module --one RUN` of its own; a
    child that failed or timed out is appended to `out` with its stderr's tail, and the next runs."""
    for run in args.runs.split(","):
        t = time.time()
        cmd = [sys.executable, "-m", module, "--one", run if ":" in run else f":{run}", "--out", args.out,
               "--dir", args.dir]
        rc, err = run_bounded(cmd, args.timeout, env=child_env())
        if rc == 0:
            print(f"{run}: ok in {time.time() - t:.0f}s", flush=True)
            continue
        tail = (err or "")[-3000:]
        last = next((line for line in reversed(tail.splitlines()) if line.strip()), "")
        print(f"{run}: FAILED: {last[-300:]} in {time.time() - t:.0f}s", flush=True)
        append_jsonl(out, {"run": run, "failed": True, "stderr_tail": tail})


if __name__ == "__main__":
    main()
