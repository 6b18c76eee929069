"""Quantized checkpoints on the GPU (issue 34 item 5): corecap's capture rate against plain vLLM on
the same quantized model, the quantization coming from config.json's `quantization_config` as the
checkpoints ship it, with dummy weights at public shapes (tools/gpu/shapes.py's runs, one process
per mode, the same clocks):

- dsv2lite-w4a16: DeepSeek-V2-Lite's shape, compressed-tensors W4A16 pack-quantized INT4 groups of
  32 on the MoE experts only (Kimi-K2.5's layout and `ignore` list);
- dsv2lite-fp8: the same shape (its dense MLP 11,008 wide: see QUANTIZED), FP8 128x128 blocks
  (`quant_method: fp8`, DeepSeek-V3's own);
- 8b-fp8: Llama-3-8B's shape, FP8 blocks;
- 8b-nvfp4: Llama-3-8B's shape, compressed-tensors NVFP4 (W4A4; on Hopper vLLM falls back to its
  weight-only Marlin FP4 kernel).

    VLLM_USE_FLASHINFER_SAMPLER=0 python3 -m tools.gpu.quantized \
        --runs dsv2lite-w4a16:plain,dsv2lite-w4a16:corecap,dsv2lite-fp8:plain,dsv2lite-fp8:corecap,\
8b-fp8:plain,8b-fp8:corecap,8b-nvfp4:plain,8b-nvfp4:corecap [--out DIR] [--dir DIR]
    python3 -m tools.gpu.quantized --dry-run      # on a CPU: writes the configs and builds the tiny
                                                  # checkpoints with real packed weights, runs nothing

The quantization configs and the tiny real checkpoints come from tests/support/quantized.py, run as
a script (tools do not import tests), so both are the layouts the CPU suite checks. Results: one
JSON line per run in OUT/bench_quantized.jsonl (shapes.py's fields).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from tools.common.child import ROOT
from tools.gpu import shapes

BUILDER = os.path.join(ROOT, "tests", "support", "quantized.py")
# NAME: (base shape, scheme, config overrides). dsv2lite-fp8's dense MLP is 11,008 wide, not
# DeepSeek-V2-Lite's 10,944: FP8 blocks quantize each activation in groups of 128 along its last
# dimension, and plain vLLM 0.26 failed on the 10,944-wide shape in `per_token_group_quant_fp8`'s
# assert that the last dimension divides by 128 (H200, 2026-12-05; the log cut the assert's own
# message). 10,944 (85.5 x 128) is the shape's only quantized input width that does not divide;
# DeepSeek-V3's own 18,432 is 144 x 128.
QUANTIZED = {"dsv2lite-w4a16": ("dsv2lite", "w4a16-experts", {}),
             "dsv2lite-fp8": ("dsv2lite", "fp8-block", {"intermediate_size": 11008}),
             "8b-fp8": ("8b", "fp8-block", {}), "8b-nvfp4": ("8b", "nvfp4", {})}
# corecap flags a run needs beyond the mode's. NVFP4's dummy weights (random packed values, FP8
# group scales and global scales) make non-finite states: corecap refused them on an H100
# (2026-12-05, "NaN/Inf in the captured states at layers [2, 16, 29, 32]") where plain vLLM, which
# checks nothing, ran; `--nonfinite store` keeps and flags them, so the run does the same work.
CORECAP_FLAGS = {"8b-nvfp4": ["--nonfinite", "store"]}
# The tiny real checkpoints of --dry-run, widened as tools/gpu/archs.py widens them (head_dim 64,
# the GPU's smallest) and to hidden 128: one FP8 block across, four INT4 groups, eight NVFP4 groups.
DRY = {"w4a16-experts": ("deepseek_v3", {}), "fp8-block": ("mixtral", {"hidden_size": 128, "head_dim": 64}),
       "nvfp4": ("mixtral", {"hidden_size": 128, "head_dim": 64})}


def quantization_config(scheme: str) -> dict:
    out = subprocess.run([sys.executable, BUILDER, "config", scheme], check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


def register() -> None:
    """Each quantized run's shape in shapes.SHAPES: the base shape's config with the quantization."""
    for name, (base, scheme, overrides) in QUANTIZED.items():
        shape = shapes.SHAPES[base]
        config = {**shape["config"], **overrides, "quantization_config": quantization_config(scheme)}
        shapes.SHAPES[name] = dict(shape, config=config, corecap_flags=CORECAP_FLAGS.get(name, []))


def build_tiny(scheme: str, arch: str, path: str, overrides: dict) -> tuple[str, str]:
    """tests/support/quantized.py's tiny `arch` quantized by `scheme` under `path`, run as a script:
    (the quantized checkpoint, the checkpoint of its dequantized weights)."""
    subprocess.run([sys.executable, BUILDER, scheme, arch, path, json.dumps(overrides)], check=True,
                   capture_output=True, timeout=600)
    return os.path.join(path, "quantized"), os.path.join(path, "dequantized")


def dry_run(out: str) -> None:
    register()
    with tempfile.TemporaryDirectory() as work:
        for name in QUANTIZED:
            with open(os.path.join(shapes.model_dir(work, name), "config.json")) as f:
                print(f"{name}: config.json quantization_config {json.load(f)['quantization_config']}")
        for scheme, (arch, overrides) in DRY.items():
            quantized, _ = build_tiny(scheme, arch, os.path.join(work, f"tiny-{scheme}"), overrides)
            files = sorted(os.listdir(quantized))
            print(f"tiny {arch} {scheme} {overrides}: built {quantized} ({', '.join(files)}) "
                  "and its dequantized twin")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", default="", help=f"comma-separated NAME:MODE[@PROMPTS], NAME in {','.join(QUANTIZED)}")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--timeout", type=int, default=560)
    ap.add_argument("--dir", default=shapes.ROOT, help="models' configs, prompts, store (default: %(default)s)")
    ap.add_argument("--dry-run", action="store_true", help="on a CPU: configs and tiny checkpoints only")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.dry_run:
        return dry_run(args.out)
    os.makedirs(args.dir, exist_ok=True)
    out = os.path.join(args.out, "bench_quantized.jsonl")
    if args.one:
        register()
        shapes.answer_one(args, out)
        return
    shapes.run_each("tools.gpu.quantized", args, out)


if __name__ == "__main__":
    main()
