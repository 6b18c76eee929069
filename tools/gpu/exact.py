"""GPU exactness check: corecap on vLLM's default path (torch.compile + CUDA graphs) against HF
transformers on the same GPU, for a tiny Llama (head_dim 64), in bf16 and float32, on the V2 and
V1 model runners; chunked prefill, shared prefixes, duplicate inputs and a 1-token sample included.

    VLLM_USE_FLASHINFER_SAMPLER=0 python3 -m tools.gpu.exact [--tp N] [--out DIR] \
        [--cases bfloat16,float32,bfloat16:v1,float32:highest]

A case is a dtype, then optionally `:v1` (VLLM_USE_V2_MODEL_RUNNER=0), `:highest`
(VLLM_FLOAT32_MATMUL_PRECISION=highest: no TF32 in vLLM's float32 matmuls), `:tf32`
(TRITON_F32_DEFAULT=tf32: Triton's own default, which corecap replaces by ieee for float32) or
`:socket` (`RunConfig.ring=False`: states inside the ZeroMQ messages, not through the
shared-memory ring; earlier calls set it with CORECAP_RING_SLOTS=0, which corecap no longer reads)
or `:fp8q` (`--quantization fp8`: vLLM's online fp8 of the same weights; not HF-exact by nature,
so it is also compared with the unquantized capture of the same dtype, when that case ran first
in the same call: `vs corecap bfloat16 unquantized`).

Writes gpu_exact.json (worst relative error per case, per sample/layer and per token) to --out.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time

from tools.common.child import child_env
from tools.common.models import exactness_rows, write_rows

VOCAB = 1024
LAYERS = (0, 1, 2, 4, 7, 8, "prenorm")  # prenorm: the last decoder layer's output (HF: a forward hook)
VARIANT_ENV = {"highest": {"VLLM_FLOAT32_MATMUL_PRECISION": "highest"}, "tf32": {"TRITON_F32_DEFAULT": "tf32"}}
RUNNER_WORDS = ("model runner", "backend", "shared-memory ring", "matmul", "workers:")  # log lines a record keeps
VARIANT_OPTIONS = {"socket": {"ring": False}, "fp8q": {"quantization": "fp8"}}  # RunConfig options of a variant


def build_model(path: str) -> None:
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=8,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    )
    torch.manual_seed(1234)
    transformers.LlamaForCausalLM(config).to(torch.float32).save_pretrained(path)


def rows() -> list[dict]:
    return exactness_rows(VOCAB, low=0, max_random=300)


def one_case(model: str, data: str, store: str, dtype: str, variant: str, tp: int) -> None:
    """Runs in a fresh process (one engine per process)."""
    from corecap.config import build
    from corecap.run import run

    cfg = build(model=model, data=data, store=store, layers=LAYERS, tp=tp, batch=4, max_len=2048,
                    max_batched_tokens=128, dtype=dtype, memory_utilization=0.3, **VARIANT_OPTIONS.get(variant, {}))
    t = time.time()
    print(run(cfg).line(), f"(wall {time.time() - t:.0f}s)", flush=True)


def _keep_prenorm(model):
    """A forward hook for the last decoder layer: keeps its output (before the final norm) as model.prenorm."""
    def hook(module, args, output) -> None:
        model.prenorm = output[0] if isinstance(output, tuple) else output
    return hook


def _record(worst: dict, key: str, case: str, got, ref) -> None:
    """Keep the worst relative error per sample and layer and per token of `got` against `ref`."""
    diff = got - ref
    w = worst.setdefault(key, {}).setdefault(case, [0.0, 0.0])
    w[0] = max(w[0], (diff.flatten(1).norm(dim=1) / ref.flatten(1).norm(dim=1)).max().item())
    w[1] = max(w[1], (diff.norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-30)).max().item())


def compare(model: str, data_rows: list[dict], store: str, dtype: str, unquantized: str | None = None) -> dict:
    import torch
    import transformers

    from corecap.store import Store

    worst = {}
    refs = {}
    for ref_dtype in {"float32", dtype}:
        m = transformers.LlamaForCausalLM.from_pretrained(model, dtype=getattr(torch, ref_dtype)).cuda().eval()
        m.model.layers[-1].register_forward_hook(_keep_prenorm(m))
        refs[ref_dtype] = m
    with contextlib.ExitStack() as stack:
        s = stack.enter_context(Store.open(store))
        u = stack.enter_context(Store.open(unquantized)) if unquantized is not None else None
        assert sorted(s.keys()) == sorted(r["id"] for r in data_rows), "keys differ"
        for r in data_rows:
            sample = s.get(r["id"])
            assert sample.input_ids.tolist() == r["input_ids"], r["id"]
            got = sample.hidden_states.float().cuda()
            case = r["id"].split("-")[0]
            for ref_dtype, m in refs.items():
                with torch.no_grad():
                    hs = m(torch.tensor([r["input_ids"]], device="cuda"), output_hidden_states=True).hidden_states
                ref = torch.stack([m.prenorm[0] if k == "prenorm" else hs[k][0] for k in LAYERS]).float()
                _record(worst, f"vs HF {ref_dtype}", case, got, ref)
            if u is not None:
                _record(worst, f"vs corecap {dtype} unquantized", case, got,
                        u.get(r["id"]).hidden_states.float().cuda())
    return worst


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--case", nargs=5, help=argparse.SUPPRESS)
    ap.add_argument("--cases", default=None,
                    help="default: bfloat16,float32,bfloat16:v1 at --tp 1, bfloat16,float32 otherwise")
    args = ap.parse_args()
    if args.case:
        model, data, store, dtype, variant = args.case
        one_case(model, data, store, dtype, variant, args.tp)
        return
    work = tempfile.mkdtemp(prefix="gpu-exact-")
    model = os.path.join(work, "model")
    build_model(model)
    data_rows = rows()
    data = write_rows(os.path.join(work, "data.jsonl"), data_rows)
    results = []
    cases = args.cases or ("bfloat16,float32,bfloat16:v1" if args.tp == 1 else "bfloat16,float32")
    for case in cases.split(","):
        dtype, _, variant = case.partition(":")
        v2 = "0" if variant == "v1" else "1"
        store = os.path.join(work, f"store-{dtype}-{variant or 'v2'}")
        env = child_env({"VLLM_USE_V2_MODEL_RUNNER": v2, **VARIANT_ENV.get(variant, {})})
        t = time.time()
        proc = subprocess.run([sys.executable, "-m", __spec__.name, "--tp", str(args.tp), "--case", model, data, store,
                               dtype, variant],
                              env=env, capture_output=True, text=True, timeout=420)
        rec = {"dtype": dtype, "variant": variant, "v2_runner": v2 == "1", "tp": args.tp, "rc": proc.returncode,
               "seconds": round(time.time() - t, 1)}
        if proc.returncode == 0:
            rec["summary"] = proc.stdout.strip().splitlines()[-1]
            log = (proc.stdout + proc.stderr).splitlines()
            rec["runner_log"] = [line[-200:] for line in log if any(w in line.lower() for w in RUNNER_WORDS)][:8]
            try:
                plain = os.path.join(work, f"store-{dtype}-v2")
                unquantized = plain if variant == "fp8q" and os.path.isdir(plain) else None
                rec["worst"] = compare(model, data_rows, store, dtype, unquantized)
            except Exception as e:  # report and go on to the next case
                rec["compare_error"] = repr(e)
        else:
            rec["stderr_tail"] = proc.stderr[-4000:]
        print("RESULT", json.dumps(rec), flush=True)
        results.append(rec)
    with open(os.path.join(args.out, f"gpu_exact_tp{args.tp}.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
