"""The one door to vLLM internals: everything that imports `vllm.*` lives in this package.

It offers a handful of things: the engine configuration from corecap's EngineOptions
(options.py), the engine with the capture installed, requests and steps (engine.py), the capture
inside each worker (worker.py) and the workers' network namespace (network.py). Every version
difference between vLLM releases is handled here; contract.py checks the assumptions on vLLM's
source without importing it (vllm_source.py), live.py the few that need vLLM imported (`corecap
doctor`, the start of every run, tests/test_adapter.py); versions.py names the releases they
were tested on.

The names below load on first use: `corecap doctor` imports this package without torch or vLLM.
"""

_WHERE = {
    "checked_vllm_config": "corecap._vllm.doctor",
    "CaptureSpec": "corecap._vllm.engine", "Engine": "corecap._vllm.engine", "StepTiming": "corecap._vllm.engine",
    "build_vllm_config": "corecap._vllm.options", "effective_settings": "corecap._vllm.options",
    "environment": "corecap._vllm.options", "max_prompt_len": "corecap._vllm.options",
    "check_pipeline": "corecap._vllm.parallel", "placement": "corecap._vllm.parallel",
    "Replicas": "corecap._vllm.replicas",
}


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'corecap._vllm' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_WHERE[name]), name)


def vllm_version() -> str:
    from corecap._vllm.versions import import_vllm

    return import_vllm().__version__


__all__ = [
    "CaptureSpec", "Engine", "Replicas", "StepTiming", "build_vllm_config", "check_pipeline", "checked_vllm_config",
    "effective_settings", "environment", "max_prompt_len", "placement", "vllm_version",
]
