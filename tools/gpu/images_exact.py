"""Kimi-K2.5 conversations with images on the GPU: corecap's bf16 capture (`corecap run`, vLLM's
default path: torch.compile + CUDA graphs, its multimodal input path) of conversations with one
and two images of different sizes, every stored token at every layer 0..N and `prenorm`, against
HF transformers' Kimi_K25ForConditionalGeneration given the same expanded ids and the pixel values
vLLM's own image processor makes of the same files. The yardstick is what bf16 alone does to this
model: HF's bf16 run against HF's float32 on the same inputs.

    VLLM_USE_FLASHINFER_SAMPLER=0 python3 -m tools.gpu.images_exact [--out DIR] [--enforce-eager]
    python3 -m tools.gpu.images_exact --device cpu --dtype float32   # on a CPU: float32, ~1e-6

The checkpoint is tests/support/kimi_k25_vision.py's (tokenizer, chat template, processor config;
its images too), with tools/gpu/deepseek_exact.py's language model (real MLA shapes, 6 layers) and
its vision tower widened to heads of 64, the smallest the GPU's attention kernels are built for.
The routing biases are so wide (std 10, against sigmoid scores in 0..1) that the experts each
token picks are the bias's, the same for every token: no near tie where bf16 may pick other
experts than float32 (such a token moves legitimately far from HF, and the tokens after it with
it: tools/gpu/deepseek_exact.py measures that); the images are what this checks. Layer 0 is the merged
embeddings (the vision features in place), which vLLM's V2 model runner does not keep: the capture
runs on the V1 runner.

Three rows share a prompt's head (text, an image: 120 tokens for Kimi-K2.5, 16 for Qwen2.5-VL,
then text): two with the same image, whose second takes the first's full blocks from vLLM's
prefix cache (on, in 64-token blocks), and one with another image of the same size (the same
ids), which may take only the blocks before its image. The JSON has the run's "prefix cache:"
line beside the hits an unbounded cache would give the rows in order.

`--arch qwen2.5-vl` runs the same conversations on a tiny random Qwen2.5-VL (tools/gpu/qwen25_vl.py:
M-RoPE, a windowed vision tower, heads of 64; one token per 28 x 28 px) against HF's
Qwen2_5_VLForConditionalGeneration. Its processor needs torchvision: where that is missing the arm
stops at once, saying so. `--runner v2` runs vLLM's V2 model runner instead, layer 0 left out.

    VLLM_USE_FLASHINFER_SAMPLER=0 python3 -m tools.gpu.images_exact --arch qwen2.5-vl [--runner v2]

Writes gpu_images_exact_ARCH_RUNNER.json to --out: per layer, over every stored token (and over the image
tokens alone), the worst absolute error and the worst per-token relative error (|diff| / |ref|)
of corecap against HF float32, of HF bf16 against HF float32, their ratio (corecap's error in
units of HF's own bf16 error: ~1 is the bf16 band), and corecap against HF bf16; and per sample,
per layer, corecap's worst per-token relative error against HF float32 (the text row apart from
the rows with images).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time

from tools.common.child import ROOT, child_env
from tools.common.models import write_rows
from tools.gpu import qwen25_vl
from tools.gpu.deepseek_exact import KIMI_VISION, NUM_LAYERS, SEED, WEIGHT_STD, text_config

# The tests' Kimi-K2.5 with images, loaded from its file as the tests' script (tests/support/ on the path).
_SUPPORT = os.path.join(ROOT, "tests", "support")
sys.path.insert(0, _SUPPORT)
_spec = importlib.util.spec_from_file_location("kimi_k25_vision", os.path.join(_SUPPORT, "kimi_k25_vision.py"))
kimi_k25_vision = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(kimi_k25_vision)

LAYERS = (*range(NUM_LAYERS + 1), "prenorm")
BIAS_STD = 10.0  # the routing fixed by the bias (docstring)
VISION = {**KIMI_VISION, "num_hidden_layers": 2}
# (width, height) in px: 6, 20, 4, 48, 120 and 120 image tokens (kimi_k25_vision: one token per 4 x 4 px);
# the last two the same size, other pixels (the same ids, other images)
SIZES = [(12, 8), (16, 20), (8, 8), (32, 24), (48, 40), (48, 40)]
# Qwen2.5-VL: 2, 6, 1, 12, 16 and 16 image tokens (one per 28 x 28 px)
QWEN_SIZES = [(56, 28), (56, 84), (28, 28), (112, 84), (112, 112), (112, 112)]
BLOCK = 64  # the prefix cache's block (FlashMLA's; vLLM's CPU attention takes multiples of 32)
ENGINE = ["--batch", "4", "--max-batched-tokens", "32", "--max-len", "1024", "--block-size", str(BLOCK)]
# Text before the shared rows' image, so that even the row with another image shares full blocks
SHARED_TEXT = "the quick brown fox jumps over the lazy dog and " * 6


def conversations(directory: str, sizes=SIZES) -> tuple[list[dict], dict[str, list[str]]]:
    """The rows (OpenAI content parts, one LLaVA row, one text row, three rows that share a prompt's
    head: two with the same image, one with another of the same size) and each one's image files."""
    a, b, c, d, e, f = kimi_k25_vision.images(directory, sizes, seed=SEED)
    name = os.path.basename

    def user(*parts):
        return {"role": "user", "content": [{"type": "text", "text": p} if isinstance(p, str)
                                            else {"type": "image_url", "image_url": {"url": name(p[0])}}
                                            for p in parts]}

    def answer(text):
        return {"role": "assistant", "content": text}

    rows = [
        {"id": "one-small", "messages": [user("describe the image", (a,)), answer("a red square")]},
        {"id": "one-large", "messages": [user("what is in this picture", (d,), "describe the image"),
                                         answer("the quick brown fox jumps over the lazy dog")]},
        {"id": "two", "messages": [user((b,), "and", (c,)), answer("two pictures of different sizes")]},
        {"id": "two-turns", "messages": [user("describe the image", (d,)), answer("a circle"),
                                         user("and this one", (b,)), answer("a red square and a circle")]},
        {"id": "llava", "image": name(b), "conversations": [{"from": "human", "value": "<image>\ndescribe the image"},
                                                            {"from": "gpt", "value": "a circle"}]},
        {"id": "text", "messages": [{"role": "user", "content": "what is in this picture"},
                                    answer("the lazy dog")]},
        # after the rows above (batched 4 at a time): the first's blocks cached before the others run
        {"id": "share-1", "messages": [user(SHARED_TEXT, (e,), "describe the image"), answer("a red square")]},
        {"id": "share-2", "messages": [user(SHARED_TEXT, (e,), "describe the image"), answer("the lazy dog")]},
        {"id": "other-image", "messages": [user(SHARED_TEXT, (f,), "describe the image"), answer("a red square")]},
    ]
    images = {"one-small": [a], "one-large": [d], "two": [b, c], "two-turns": [d, b], "llava": [b], "text": [],
              "share-1": [e], "share-2": [e], "other-image": [f]}
    return rows, images


def capture(model: str, data: str, store: str, dtype: str, eager: bool, gpu: bool, layers: tuple,
            runner: str = "v1") -> dict:
    """`corecap run` through its CLI, in a process of its own (on a GPU, beside HF's references
    later: 0.3 of its memory)."""
    layers = ",".join(map(str, layers))
    cmd = [sys.executable, "-m", "corecap.cli", "run", "--model", model, "--data", data, "--store", store,
           "--layers", layers, "--dtype", dtype, *ENGINE, "--no-progress"]
    if eager:
        cmd.append("--enforce-eager")
    if gpu:
        cmd += ["--memory-utilization", "0.3"]
    t = time.time()
    # V1 by default: the V2 runner keeps no input embeddings, which layer 0 is with images (corecap/_vllm/worker.py)
    proc = subprocess.run(cmd, env=child_env({"VLLM_USE_V2_MODEL_RUNNER": "1" if runner == "v2" else "0"}),
                          capture_output=True, text=True, timeout=900)
    out = (proc.stdout + proc.stderr).strip().splitlines()
    return {"rc": proc.returncode, "seconds": round(time.time() - t, 1), "command": " ".join(cmd[1:]),
            "engine": next((x for x in out if x.startswith("engine: ")), None),
            "prefix cache": next((x for x in out if x.startswith("prefix cache: ")), None),
            "tail": out[-6:] if proc.returncode == 0 else out[-30:]}


def _errors(got, ref, image_tokens, layers: tuple) -> dict:
    """Per layer: worst |got - ref| and worst per-token |diff| / |ref|, over all tokens and over
    the image tokens (got, ref: [L, T, H] float32; image_tokens: [T] bools)."""
    diff = got - ref
    abs_err = diff.abs().amax(dim=-1)  # [L, T]
    rel_err = diff.norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-30)
    out = {}
    for j, k in enumerate(layers):
        out[str(k)] = {"max_abs": float(abs_err[j].max()), "max_rel": float(rel_err[j].max())}
        if image_tokens.any():
            out[str(k)] |= {"image_max_abs": float(abs_err[j][image_tokens].max()),
                            "image_max_rel": float(rel_err[j][image_tokens].max())}
    return out


def _worst(into: dict, errors: dict) -> None:
    for layer, values in errors.items():
        w = into.setdefault(layer, {})
        for key, v in values.items():
            w[key] = max(w.get(key, 0.0), v)


def compare(model: str, store: str, images: dict, device: str, work: str, layers: tuple, arch: str) -> dict:
    """The worst errors per layer, over every stored sample."""
    import torch

    from corecap.store import Store

    with Store.open(store) as s:
        samples = {key: s.get(key) for key in images}
    rows = [{"id": k, "input_ids": v.input_ids.tolist(), "images": images[k]} for k, v in samples.items()]
    support = qwen25_vl if arch == "qwen2.5-vl" else kimi_k25_vision
    refs = {dt: support.reference_in_a_process(model, rows, work, dt, device) for dt in ("float32", "bfloat16")}
    worst: dict = {"corecap vs HF float32": {}, "HF bf16 vs HF float32": {}, "corecap vs HF bf16": {}}
    per_sample: dict = {}  # key → layer → corecap's worst per-token relative error against HF float32
    num_tokens = num_image_tokens = 0
    for key, sample in samples.items():
        got = sample.hidden_states.float()
        ref32, ref16 = (torch.stack([r[key]["prenorm"] if k == "prenorm" else r[key]["hidden_states"][k]
                                     for k in layers]) for r in (refs["float32"], refs["bfloat16"]))
        image_tokens = torch.zeros(len(sample.input_ids), dtype=torch.bool)
        media = sample.header.media
        for item in (media.items if media else ()):
            image_tokens[item.offset:item.offset + item.length] = True
        if len(media.items if media else ()) != len(images[key]):
            raise SystemExit(f"{key}: the store holds {len(media.items) if media else 0} images, the row has "
                             f"{len(images[key])}")
        num_tokens += len(sample.input_ids)
        num_image_tokens += int(image_tokens.sum())
        ours = _errors(got, ref32, image_tokens, layers)
        per_sample[key] = {layer: values["max_rel"] for layer, values in ours.items()}
        _worst(worst["corecap vs HF float32"], ours)
        _worst(worst["HF bf16 vs HF float32"], _errors(ref16, ref32, image_tokens, layers))
        _worst(worst["corecap vs HF bf16"], _errors(got, ref16, image_tokens, layers))
    ratio = {}
    for layer, ours in worst["corecap vs HF float32"].items():
        theirs = worst["HF bf16 vs HF float32"][layer]
        ratio[layer] = {k: (v / theirs[k] if theirs.get(k) else None) for k, v in ours.items()}
    # the prompt tokens an unbounded cache gives the samples in this order: what the run's
    # "prefix cache:" line should say where caching is on (a batch's rows may run side by side)
    hits = kimi_k25_vision.expected_prefix_hits(list(samples.items()), BLOCK)
    return {"samples": len(samples), "tokens": num_tokens, "image tokens": num_image_tokens,
            "prefix hits expected (unbounded cache, rows in order)": hits, **worst,
            "ratio (corecap vs HF float32) / (HF bf16 vs HF float32)": ratio,
            "corecap vs HF float32, max_rel per sample": per_sample}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"), help="corecap's run")
    ap.add_argument("--device", default="cuda", help="where HF's references run (cpu: on a CPU-only host)")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--arch", default="kimi-k2.5", choices=("kimi-k2.5", "qwen2.5-vl"))
    ap.add_argument("--runner", default="v1", choices=("v1", "v2"), help="vLLM's model runner (v2: no layer 0)")
    args = ap.parse_args()
    qwen = args.arch == "qwen2.5-vl"
    if qwen:
        qwen25_vl.require_torchvision()
    layers = (*range(qwen25_vl.NUM_LAYERS + 1), "prenorm") if qwen else LAYERS
    if args.runner == "v2":
        layers = layers[1:]
    work = tempfile.mkdtemp(prefix="gpu-images-exact-")
    model = os.path.join(work, "model")
    t = time.time()
    if qwen:
        qwen25_vl.build(model, seed=SEED)
    else:
        kimi_k25_vision.build(model, seed=SEED, text=text_config().to_dict(), vision=VISION, std=WEIGHT_STD,
                              bias_std=BIAS_STD)
    rows, images = conversations(os.path.join(work, "data"), QWEN_SIZES if qwen else SIZES)
    data = write_rows(os.path.join(work, "data", "rows.jsonl"), rows)
    result = {"arch": args.arch, "runner": args.runner, "dtype": args.dtype, "device": args.device,
              "enforce_eager": args.enforce_eager, "layers": list(map(str, layers)),
              "build_seconds": round(time.time() - t, 1)}
    result["capture"] = run = capture(model, data, os.path.join(work, "store"), args.dtype, args.enforce_eager,
                                        args.device != "cpu", layers, args.runner)
    print("STEP capture", json.dumps(run), flush=True)
    if run["rc"] == 0:
        t = time.time()
        result["errors"] = compare(model, os.path.join(work, "store"), images, args.device, work, layers, args.arch)
        result["compare_seconds"] = round(time.time() - t, 1)
    print("RESULT", json.dumps(result), flush=True)
    with open(os.path.join(args.out, f"gpu_images_exact_{args.arch}_{args.runner}.json"), "w") as f:
        json.dump(result, f, indent=1)
    if run["rc"] != 0:
        raise SystemExit(f"corecap run failed (exit {run['rc']}):\n" + "\n".join(run["tail"]))


if __name__ == "__main__":
    main()
