"""The one door to vLLM internals: everything that imports `vllm.*` lives in this package.

It offers a handful of things: build the engine with capture installed (`Engine`), add a
request, step it, and report versions. Every version difference between vLLM releases is
handled here, and tests/test_adapter.py checks the assumptions without loading weights.
"""

from corecap._vllm.engine import Engine, EngineSpec, StepTiming


def vllm_version() -> str:
    import vllm

    return vllm.__version__


__all__ = ["Engine", "EngineSpec", "StepTiming", "vllm_version"]
