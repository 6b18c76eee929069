"""A checkpoint's quantization, read from its config.json as vLLM reads it (there is no corecap
flag: vLLM picks the kernels from `quantization_config`), described in one line for the store's
metadata and for the errors that refuse a quantization the device cannot run.

The states are stored in the compute dtype whatever the weights are: the quantization tells a
reader which weights produced them (an INT4 checkpoint's states are not its bf16 parent's).
"""

from __future__ import annotations


def quantization_config(config: dict) -> dict | None:
    """The checkpoint's `quantization_config` (top level, or under `text_config` for a wrapper)."""
    found = config.get("quantization_config") or config.get("text_config", {}).get("quantization_config")
    return found if isinstance(found, dict) else None


def describe(config: dict) -> str | None:
    """One line: the method, its format, and each group's weights (and activations), e.g.
    `compressed-tensors pack-quantized: weights int4 group 32 symmetric`; None: not quantized."""
    q = quantization_config(config)
    if q is None:
        return None
    method = str(q.get("quant_method", "?"))
    if method == "fp8":
        blocks = q.get("weight_block_size")
        shape = f"blocks {blocks[0]}x{blocks[1]}" if isinstance(blocks, list) and len(blocks) == 2 else "per tensor"
        return f"fp8 {q.get('fmt', 'e4m3')}: weights {shape}, activations {q.get('activation_scheme', '?')}"
    if method == "compressed-tensors":
        groups = [_group(g) for g in (q.get("config_groups") or {}).values() if isinstance(g, dict)]
        return f"compressed-tensors {q.get('format', '?')}: " + "; ".join(groups or ["no groups"])
    if method == "modelopt":
        algo = q.get("quant_algo") or (q.get("quantization") or {}).get("quant_algo", "?")
        return f"modelopt {algo}"
    return method


def _group(group: dict) -> str:
    parts = []
    for role in ("weights", "input_activations"):
        args = group.get(role)
        if not isinstance(args, dict):
            continue
        kind = f"{args.get('type', '?')}{args.get('num_bits', '?')}"
        size = f" {args.get('strategy', '?')}"
        if args.get("group_size"):
            size += f" {args['group_size']}"
        sym = " symmetric" if args.get("symmetric") else ""
        parts.append(f"{role.split('_')[0]} {kind}{size}{sym}")
    return ", ".join(parts)
