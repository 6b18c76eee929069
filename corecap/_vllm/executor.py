"""vLLM's multiproc executor with the capture: it installs the capture in every worker once the
weights are loaded (before vLLM profiles, compiles or captures CUDA graphs), tells the driver
as each phase of the engine's start begins, and notes the workers that died by themselves
(corecap/_vllm/worker_deaths.py). Used by corecap/_vllm/engine.py."""

from __future__ import annotations

import dataclasses

from corecap._vllm import worker_deaths


def capture_executor_class(model: str, capture, made: list, errors: str, on_phase=None):
    """`capture`: engine.CaptureSpec. `made` gets the executor once made, for `Engine` to shut
    down should the engine's start fail; `errors`: the directory its workers record their errors
    in (corecap/_vllm/worker_errors.py);
    `on_phase(words)`: called as each phase of the engine's start begins (EngineCore calls these
    methods in this order), the driver's only view of what its workers are doing meanwhile."""
    phase = on_phase or (lambda words: None)
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    from corecap._vllm.worker_errors import recording

    class CaptureExecutor(MultiprocExecutor):
        """Installs the capture in every worker after load_model, before profiling/compiling."""

        def _init_executor(self) -> None:
            from corecap._vllm.network import private_network

            made.append(self)
            phase("starting vLLM's workers, loading the weights")
            with private_network(model, capture.private_network) as status, recording(errors):
                super()._init_executor()  # the workers start here
            self.corecap_network = status
            self.corecap_workers = self.collective_rpc("corecap_install", args=(dataclasses.asdict(capture),))

        def determine_available_memory(self):
            phase("profiling the memory (compiling the model, unless cached)")
            return super().determine_available_memory()

        def initialize_from_config(self, kv_cache_configs) -> None:
            phase("allocating the KV cache")
            super().initialize_from_config(kv_cache_configs)

        def compile_or_warm_up_model(self):
            phase("warming up (CUDA graphs where used)")
            return super().compile_or_warm_up_model()

        def _ensure_worker_termination(self, worker_procs) -> None:
            """vLLM ends its workers here when their start fails and when it shuts down (after a
            worker's death too): first note those that had died by themselves, whose exit
            status names the signal that killed them (corecap/_vllm/worker_deaths.py)."""
            failing = getattr(self, "workers", None) is None or self.is_failed  # a failed start, or a death
            dead = worker_deaths.dead_on_their_own(worker_procs, worker_deaths.SETTLE_S if failing else 0.0)
            self.corecap_deaths = getattr(self, "corecap_deaths", []) + dead
            MultiprocExecutor._ensure_worker_termination(worker_procs)

    return CaptureExecutor
