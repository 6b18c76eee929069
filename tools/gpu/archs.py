"""The architectures of tests/test_architectures.py on the GPU: corecap's bf16 capture on vLLM's
default path (torch.compile + CUDA graphs) against HF transformers float32, tiny models built
from a seed by tests/support/tiny_models.py (random norm weights), every layer 0..N and prenorm, over
that test's dataset (batching, chunked prefill at 64 tokens, shared prefixes, duplicates, a
1-token sample). DeepSeek-V3 has its own tool (tools/gpu/deepseek_exact.py: its routing flips).

    VLLM_USE_FLASHINFER_SAMPLER=0 python3 -m tools.gpu.archs \
        [--archs gemma3,mixtral,qwen2_moe,gpt_oss,qwen3_next] [--out DIR]
    ... python3 -m tools.gpu.archs --archs mixtral@w4a16-experts,mixtral@fp8-block,mixtral@nvfp4

`ARCH@SCHEME` runs a quantized checkpoint as it ships (tests/support/quantized.py's SCHEMES, built
from that tiny model): corecap captures the quantized checkpoint, and HF runs the checkpoint of
its dequantized weights (what the quantized one represents, as tests/test_quantized.py compares
on a CPU that has the kernels). The GPU's kernels compute in bf16 (INT4 and FP4 weight-only
Marlin on Hopper; FP8 blocks also quantize the activations, per token group of 128).

The models are those of the CPU suite, widened to head_dim 64 (hidden 128, 2 heads) because
the GPU's attention kernels are built for head sizes from 64 up. For each architecture the
report has the worst relative error per sample and layer and per token against HF float32,
per layer, and the same for HF's own bf16 run (what bf16 alone does to that model: the band);
for `@fp8-block` also HF float32 with its linear layers' inputs quantized as the GPU's FP8 kernels
quantize them (tests/support/quantized.py `fp8_activations`: what FP8 activations alone do).
`--hf-only` computes those bands alone, without corecap or a GPU (any machine).

Writes gpu_archs.json to --out; one line per architecture on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import importlib.util
import subprocess
import sys
import tempfile
import time

from tools.common.child import ROOT
from tools.gpu import quantized

# The tests' tiny models, run here as a file: tests/support/ holds what tests share (tests/ before).
_PLACES = (os.path.join(ROOT, "tests", "support", "tiny_models.py"), os.path.join(ROOT, "tests", "tiny_models.py"))
TINY_MODELS = next(p for p in _PLACES if os.path.exists(p))
_spec = importlib.util.spec_from_file_location("tiny_models", TINY_MODELS)
tiny_models = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tiny_models)

ARCHS = ("gemma3", "mixtral", "qwen2_moe", "gpt_oss", "qwen3_next")
WIDER = {"hidden_size": 128, "head_dim": 64}
# vLLM engine arguments an architecture needs where flashinfer is not installed, which vLLM 0.26's
# gated-DeltaNet prefill picks by default on Hopper: without this the worker's forward fails with
# "No module named 'flashinfer'"
ENGINE_ARGS = {"qwen3_next": ["--gdn-prefill-backend", "triton"]}


def checkpoints(arch: str, scheme: str, work: str) -> tuple[str, str]:
    """(the checkpoint corecap captures, the one HF is run on): the tiny `arch`, or its `scheme`
    quantization and the checkpoint of its dequantized weights."""
    if not scheme:
        model = tiny_models.build(arch, os.path.join(work, "model"), overrides=WIDER)
        return model, model
    return quantized.build_tiny(scheme, arch, os.path.join(work, "model"), WIDER)


def one_arch(name: str, work: str, hf_only: bool = False) -> dict:
    import torch

    from corecap.store import Store

    arch, _, scheme = name.partition("@")
    model, reference = checkpoints(arch, scheme, work)
    rows = tiny_models.rows()
    data = os.path.join(work, "data.jsonl")
    with open(data, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    layers = (*range(tiny_models.NUM_LAYERS + 1), "prenorm")
    refs = {}
    for dtype in ("float32", "bfloat16"):
        out = os.path.join(work, f"refs-{dtype}.pt")
        subprocess.run([sys.executable, TINY_MODELS, "reference", reference, data, out, dtype],
                       check=True, timeout=600, capture_output=True)
        refs[dtype] = torch.load(out)
    bands = {"HF bf16 vs HF float32": refs["bfloat16"]}
    if scheme == "fp8-block":  # the GPU's FP8 kernels quantize activations too: that alone, in float32
        out = os.path.join(work, "refs-fp8-activations.pt")
        subprocess.run([sys.executable, quantized.BUILDER, "reference-fp8-activations", reference, data, out],
                       check=True, timeout=600, capture_output=True)
        bands["HF float32 with FP8 activations vs HF float32"] = torch.load(out)
    rec = {"arch": name, "hf_weights": "dequantized" if scheme else "the same",
           "layers": [str(k) for k in layers]}
    if hf_only:
        rec["worst"] = worst_errors(rows, layers, refs["float32"], bands)
        return rec
    store = os.path.join(work, "store")
    cmd = [sys.executable, "-m", "corecap.cli", "run", "--model", model, "--data", data, "--store", store,
           "--layers", ",".join(map(str, layers)), "--dtype", "bfloat16", "--batch", "4", "--max-batched-tokens", "64",
           *ENGINE_ARGS.get(arch, ())]
    t = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=420)
    rec.update(rc=proc.returncode, seconds=round(time.time() - t, 1))
    lines = (proc.stdout + proc.stderr).splitlines()
    rec["engine_line"] = next((line for line in lines if line.startswith("engine:")), "")
    if proc.returncode != 0:
        rec["error"] = [line for line in lines if line.startswith("corecap: error")][-1:] or lines[-5:]
        try:  # the traceback an internal error names
            with open(os.path.join(store, "corecap.log"), errors="replace") as f:
                rec["log_tail"] = f.read()[-6000:]
        except OSError:
            pass
        return rec
    rec["summary"] = proc.stdout.strip().splitlines()[-1]
    with Store.open(store) as s:
        assert sorted(s.keys()) == sorted(r["id"] for r in rows), "keys differ"
        captured = {}
        for r in rows:
            sample = s.get(r["id"])
            assert sample.input_ids.tolist() == r["input_ids"], r["id"]
            captured[r["id"]] = sample.hidden_states
    rec["worst"] = worst_errors(rows, layers, refs["float32"], {"corecap bf16 vs HF float32": captured, **bands})
    return rec


def worst_errors(rows, layers, ref, runs: dict) -> dict:
    """For each run (its states by sample id: a stored sample's [layers, T, H], or a reference as
    tiny_models.reference writes it), the worst relative error per sample and layer and per token
    against `ref`, per layer."""
    worst = {}
    for key, states in runs.items():
        w = worst[key] = {"per_sample_layer": [0.0] * len(layers), "per_token": [0.0] * len(layers)}
        for r in rows:
            got = states[r["id"]]
            got = tiny_models.stacked(got, layers) if isinstance(got, dict) else got
            per_sample, per_token = tiny_models.relative_errors(got, tiny_models.stacked(ref[r["id"]], layers))
            w["per_sample_layer"] = [max(a, float(b)) for a, b in zip(w["per_sample_layer"], per_sample)]
            w["per_token"] = [max(a, float(b)) for a, b in zip(w["per_token"], per_token)]
    return worst


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--archs", default=",".join(ARCHS))
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--hf-only", action="store_true",
                    help="HF's own bands alone (bf16, and FP8 activations for @fp8-block), no corecap run: any machine")
    args = ap.parse_args()
    results = []
    for name in args.archs.split(","):
        work = tempfile.mkdtemp(prefix=f"gpu-arch-{name}-")
        try:
            rec = one_arch(name, work, args.hf_only)
        except Exception as e:  # report and go on to the next architecture
            rec = {"arch": name, "exception": repr(e)[-2000:]}
        print("RESULT", json.dumps(rec), flush=True)
        results.append(rec)
        with open(os.path.join(args.out, "gpu_archs.json"), "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
