"""The one door to vLLM internals: everything that imports `vllm.*` lives in this package.

It offers a handful of things: the engine configuration from corecap's EngineOptions
(options.py), the engine with the capture installed, requests and steps (engine.py), the capture
inside each worker (worker.py) and the workers' network namespace (network.py). Every version
difference between vLLM releases is handled here; contract.py checks the assumptions without
loading weights (`corecap doctor`, the start of every run, tests/test_adapter.py), versions.py
names the releases they were tested on.
"""

from corecap._vllm.doctor import checked_vllm_config
from corecap._vllm.engine import CaptureSpec, Engine, StepTiming
from corecap._vllm.options import build_vllm_config, effective_settings, environment, max_prompt_len
from corecap._vllm.parallel import check_pipeline, placement
from corecap._vllm.replicas import Replicas


def vllm_version() -> str:
    from corecap._vllm.versions import import_vllm

    return import_vllm().__version__


__all__ = [
    "CaptureSpec", "Engine", "Replicas", "StepTiming", "build_vllm_config", "check_pipeline", "checked_vllm_config",
    "effective_settings", "environment", "max_prompt_len", "placement", "vllm_version",
]
