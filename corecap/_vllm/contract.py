"""vLLM's contract: what corecap relies on in vLLM's internals, checked in seconds without an
engine, weights or a GPU (`corecap doctor`, and the start of every `corecap run`).

corecap builds EngineCore, its Scheduler and the multiproc executor itself, hand-builds
`Request`s and taps the model runner inside the workers: internals that change between vLLM
releases. Each check below is a small function that looks at signatures, attributes and source
(inspect, ast) and returns None or one sentence saying what moved; `check_contract` runs them.
What changed from release to release, and so why each check exists: docs/versions.md.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import importlib.metadata as md
import inspect
import textwrap
from dataclasses import dataclass

from corecap._vllm.versions import installed_vllm


@dataclass(frozen=True)
class Result:
    name: str  # what was checked
    problem: str | None = None  # what moved, one sentence; None: it holds
    note: str = ""  # what the check learned, when it holds (which runner, ...)


class Note(str):
    """A check's return value when the contract holds but there is something to say."""


class _Gone(Exception):
    """A method corecap calls is no longer there."""


CHECKS: list = []  # (name, fn()): no engine configuration needed
CONFIGURED_CHECKS: list = []  # (name, fn(vllm_config)): about what a run's configuration makes vLLM build


def _check(name: str, configured: bool = False):
    def register(fn):
        (CONFIGURED_CHECKS if configured else CHECKS).append((name, fn))
        return fn

    return register


def run_check(name: str, fn, *args) -> Result:
    try:
        out = fn(*args)
    except _Gone as e:
        return Result(name, str(e))
    except Exception as e:  # an import or attribute that moved: say which
        return Result(name, f"{type(e).__name__}: {e}")
    return Result(name, None, str(out)) if isinstance(out, Note) else Result(name, out)


def check_contract(vllm_config=None) -> list[Result]:
    """Without `vllm_config`: every check that needs no engine configuration. With it: the
    checks of what that configuration makes vLLM build (the worker, the runner, the model)."""
    if vllm_config is None:
        return [run_check(name, fn) for name, fn in CHECKS]
    return [run_check(name, fn, vllm_config) for name, fn in CONFIGURED_CHECKS]


def _signature_problem(label: str, fn, passed: set[str]) -> str | None:
    """What a call of `fn` with keywords `passed` would trip on: a name it no longer accepts, or a
    parameter it now requires that corecap does not pass."""
    params = inspect.signature(fn).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return None
    gone = sorted(passed - set(params))
    if gone:
        return f"{label}() no longer accepts {', '.join(gone)}"
    new = [n for n, p in params.items() if n not in passed and p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    return f"{label}() now requires {', '.join(new)}" if new else None


def _method(cls, name: str, label: str | None = None):
    fn = getattr(cls, name, None)
    if not callable(fn):
        raise _Gone(f"{label or cls.__name__}.{name} is gone")
    return fn


def _tree(obj) -> ast.AST:
    return ast.parse(textwrap.dedent(inspect.getsource(obj)))


def _self_attributes(obj) -> set[str]:
    """Names X of every `self.X = ...` in `obj`'s source."""
    return {
        n.attr for n in ast.walk(_tree(obj))
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self" and isinstance(n.ctx, ast.Store)
    }


def _fields(cls) -> set[str]:
    """Field names of a dataclass, NamedTuple or msgspec Struct."""
    if dataclasses.is_dataclass(cls):
        return {f.name for f in dataclasses.fields(cls)}
    return set(getattr(cls, "_fields", None) or getattr(cls, "__struct_fields__", ()))


def _lacks(label: str, wanted: set[str], have: set[str]) -> str | None:
    """'LABEL X, Y' for the names in `wanted` missing from `have`, else None."""
    gone = sorted(wanted - have)
    return f"{label} {', '.join(gone)}" if gone else None


def _first(*problems) -> str | None:
    return next((p for p in problems if p), None)


def _import(qualname: str):
    module, _, name = qualname.rpartition(".")
    return getattr(importlib.import_module(module), name)


def _using(cls, name: str) -> list:
    """The functions of `cls`'s vLLM worker classes whose code names `name` (no source parsed)."""

    def names(code) -> set:
        return set(code.co_names).union(*(names(c) for c in code.co_consts if inspect.iscode(c)))

    return [
        f for c in cls.__mro__ if c.__module__.startswith("vllm.v1.worker")
        for f in map(inspect.unwrap, (f for f in vars(c).values() if inspect.isfunction(f))) if name in names(f.__code__)
    ]


def _reads_aux_flag(cls) -> str | None:
    if [f for f in _using(cls, "use_aux_hidden_state_outputs") if f.__name__ != "__init__"]:
        return None
    return f"{cls.__name__} no longer reads use_aux_hidden_state_outputs (how corecap asks for the aux hidden states)"


# --- the install, the engine's arguments, EngineCore, Request, the scheduler -------------------


@_check("torch is the build vLLM pins")
def _torch_pin():
    from packaging.requirements import Requirement

    dist, version = installed_vllm()
    torch_version = md.version("torch")
    for req in map(Requirement, md.requires(dist) or []):
        if req.name == "torch" and (req.marker is None or req.marker.evaluate({"extra": ""})):
            if not req.specifier.contains(torch_version, prereleases=True):
                return f"torch {torch_version} is installed, but {dist} {version} pins torch{req.specifier}"
    return None


@_check("EngineArgs: the fields corecap sets, create_engine_config(usage_context)")
def _engine_args():
    from vllm.engine.arg_utils import EngineArgs
    from vllm.usage.usage_lib import UsageContext

    from corecap._vllm.options import engine_arg_values
    from corecap.config import EngineOptions

    names = set(engine_arg_values(EngineOptions(gpu_memory_utilization=0.5), "model"))
    return _first(
        _lacks("EngineArgs no longer has", names, _fields(EngineArgs)),
        None if hasattr(UsageContext, "LLM_CLASS") else "UsageContext.LLM_CLASS is gone (corecap takes the LLM class's defaults)",
        _signature_problem("EngineArgs.create_engine_config", _method(EngineArgs, "create_engine_config"), {"self", "usage_context"}),
    )


@_check("EngineCore(vllm_config, executor_class, log_stats), its scheduler, model_executor, request_block_hasher")
def _engine_core():
    from vllm.v1.engine.core import EngineCore

    for name in ("add_request", "shutdown"):
        _method(EngineCore, name)
    return _first(
        _lacks("EngineCore.__init__ no longer sets", {"scheduler", "model_executor", "request_block_hasher"}, _self_attributes(EngineCore.__init__)),
        _signature_problem("EngineCore", EngineCore.__init__, {"self", "vllm_config", "executor_class", "log_stats"}),
    )


@_check("Request(request_id, prompt_token_ids, sampling_params, pooling_params, arrival_time, block_hasher), SamplingParams")
def _request():
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    try:
        SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    except TypeError as e:
        return f"SamplingParams(max_tokens=1, temperature=0.0, detokenize=False) fails: {e}"
    passed = {"self", "request_id", "prompt_token_ids", "sampling_params", "pooling_params", "arrival_time", "block_hasher"}
    return _signature_problem("Request", Request.__init__, passed)


@_check("Scheduler: schedule, get_grammar_bitmask, update_from_output; SchedulerOutput, EngineCoreOutput")
def _scheduler():
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs

    _method(Scheduler, "has_requests")
    return _first(
        _signature_problem("Scheduler.schedule", _method(Scheduler, "schedule"), {"self"}),
        _signature_problem("Scheduler.get_grammar_bitmask", _method(Scheduler, "get_grammar_bitmask"), {"self", "scheduler_output"}),
        _signature_problem("Scheduler.update_from_output", _method(Scheduler, "update_from_output"), {"self", "scheduler_output", "model_runner_output"}),
        _lacks("SchedulerOutput has no field", {"num_scheduled_tokens", "total_num_scheduled_tokens"}, _fields(SchedulerOutput)),
        _lacks("EngineCoreOutputs has no field", {"outputs"}, _fields(EngineCoreOutputs)),
        _lacks("EngineCoreOutput has no field", {"request_id", "finish_reason"}, _fields(EngineCoreOutput)),
    )


# --- the executor and the workers --------------------------------------------------------------


@_check("two-phase step: execute_model(non_block), sample_tokens(grammar_output, non_block); get_output() before the reply")
def _two_phase():
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor, WorkerProc
    from vllm.v1.outputs import AsyncModelRunnerOutput

    execute = _method(MultiprocExecutor, "execute_model")
    try:
        sample = _method(MultiprocExecutor, "sample_tokens")
    except _Gone as e:
        return f"{e}: the two-phase execute_model → sample_tokens step protocol moved"
    _method(AsyncModelRunnerOutput, "get_output")
    return _first(
        _signature_problem("MultiprocExecutor.execute_model", execute, {"self", "scheduler_output", "non_block"}),
        _signature_problem("MultiprocExecutor.sample_tokens", sample, {"self", "grammar_output", "non_block"}),
        None if ".get_output()" in inspect.getsource(_method(WorkerProc, "enqueue_output"))
        else "WorkerProc.enqueue_output no longer calls get_output() (corecap's tap copies the states from there)",
    )


@_check("MultiprocExecutor: workers start in _init_executor; collective_rpc, is_failed")
def _executor():
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    if "_init_executor" not in vars(MultiprocExecutor):
        return "MultiprocExecutor no longer defines _init_executor (corecap starts the workers by wrapping it)"
    source = inspect.getsource(MultiprocExecutor._init_executor)
    if "make_worker_process" not in source:
        return "MultiprocExecutor._init_executor no longer starts the workers (WorkerProc.make_worker_process)"
    if "is_failed" not in _self_attributes(MultiprocExecutor.__init__) | _self_attributes(MultiprocExecutor._init_executor):
        return "MultiprocExecutor no longer sets is_failed (how corecap tells a dead worker)"
    _method(MultiprocExecutor, "shutdown")
    problem = _signature_problem("MultiprocExecutor.collective_rpc", _method(MultiprocExecutor, "collective_rpc"), {"self", "method", "args"})
    pool = getattr(MultiprocExecutor, "_start_workers_concurrently", None)
    if problem or (pool is None and "ThreadPoolExecutor" not in source):
        return problem
    if pool is None or "ThreadPoolExecutor(" not in inspect.getsource(pool):  # threads made before the unshare
        return "MultiprocExecutor starts the workers from a thread pool it did not make in _init_executor: they may escape the private network"
    return Note("GPU workers may start from a thread pool made in _init_executor (vLLM 0.33+): its threads, "
                "and so the workers, inherit the driver thread's network namespace")


@_check("worker extension hook: worker_extension_cls mixed in by init_worker")
def _worker_extension():
    from vllm.config import ParallelConfig
    from vllm.v1.worker.worker_base import WorkerWrapperBase

    if "worker_extension_cls" not in _fields(ParallelConfig):
        return "ParallelConfig has no worker_extension_cls (corecap's capture is a worker extension)"
    if "worker_extension_cls" not in inspect.getsource(_method(WorkerWrapperBase, "init_worker")):
        return "WorkerWrapperBase.init_worker no longer mixes in worker_extension_cls"
    hooks = [h for h in ("init_worker_extension", "destroy_worker_extension") if h in inspect.getsource(WorkerWrapperBase)]
    return Note(f"optional extension hooks {', '.join(hooks)} (vLLM 0.33+; corecap defines none)") if hooks else None


@_check("EAGLE-3 aux states: index k = HF hidden_states[k], layers kept in order")
def _aux_semantics():
    import torch

    from vllm.model_executor.models.interfaces import EagleModelMixin

    holder = EagleModelMixin()
    holder._set_aux_hidden_state_layers((0, 3))
    if tuple(holder.aux_hidden_state_layers) != (0, 3):
        return f"EagleModelMixin._set_aux_hidden_state_layers((0, 3)) stores {holder.aux_hidden_state_layers} (corecap zips the aux outputs with its sorted layers)"
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


# --- what a run's configuration makes vLLM build -----------------------------------------------


@_check("engine configuration: chunked prefill on, async scheduling off, mp, the extension", configured=True)
def _configuration(vllm_config):
    from corecap._vllm.options import WORKER_EXTENSION

    sched, parallel, model = vllm_config.scheduler_config, vllm_config.parallel_config, vllm_config.model_config
    changed = [name for name, ok in (
        ("async_scheduling", sched.async_scheduling is False),
        ("enable_chunked_prefill", sched.enable_chunked_prefill is True),
        ("distributed_executor_backend", parallel.distributed_executor_backend == "mp"),
        ("worker_extension_cls", parallel.worker_extension_cls == WORKER_EXTENSION),
    ) if not ok]
    return _first(
        _lacks("vLLM changed what corecap set in the engine configuration:", set(changed), set()),
        _lacks("ModelConfig has no", {"get_hidden_size", "dtype", "max_model_len"}, set(dir(model))),
    )


@_check("worker class: execute_model, sample_tokens; model_runner, rank, vllm_config", configured=True)
def _worker(vllm_config):
    cls = _import(vllm_config.parallel_config.worker_cls)
    stored = set().union(*(_self_attributes(c) for c in cls.__mro__ if c.__module__.startswith("vllm.")))
    return _first(
        _lacks(f"{cls.__name__} no longer sets", {"model_runner", "rank", "vllm_config"}, stored),
        _signature_problem(f"{cls.__name__}.execute_model", _method(cls, "execute_model"), {"self", "scheduler_output"}),
        _signature_problem(f"{cls.__name__}.sample_tokens", _method(cls, "sample_tokens"), {"self", "grammar_output"}),
    )


_RUNNERS = {  # (CPU platform, V2) → the class the worker builds
    (False, False): "vllm.v1.worker.gpu_model_runner.GPUModelRunner",
    (False, True): "vllm.v1.worker.gpu.model_runner.GPUModelRunner",
    (True, False): "vllm.v1.worker.cpu_model_runner.CPUModelRunner",
    (True, True): "vllm.v1.worker.cpu.model_runner.CPUModelRunner",
}


@_check("model runner: its generation and what the tap reads", configured=True)
def _runner(vllm_config):
    from corecap._vllm.options import cpu_platform

    if not hasattr(type(vllm_config), "use_v2_model_runner"):
        return "VllmConfig.use_v2_model_runner is gone: corecap cannot tell which model runner the workers build"
    v2, cpu = bool(vllm_config.use_v2_model_runner), cpu_platform()
    qualname = _RUNNERS[(cpu, v2)]
    problem = (runner_v2_problem if v2 else runner_v1_problem)(_import(qualname))
    untested = " (V2 on a CPU: a path corecap's tests never ran)" if v2 and cpu else ""
    return problem or Note(f"{'V2' if v2 else 'V1'} runner {qualname}{untested}")


def runner_v1_problem(cls) -> str | None:
    """The V1 tap (corecap/_vllm/worker.py) wraps `_model_forward`, reads its `input_ids` and
    `positions` keywords and `input_batch.req_ids`, and sets `use_aux_hidden_state_outputs`."""
    from vllm.v1.worker.gpu_input_batch import InputBatch

    name = cls.__name__
    for method in ("_model_forward", "execute_model", "sample_tokens", "get_model"):
        _method(cls, method)
    calls = [
        n for f in _using(cls, "_model_forward") for n in ast.walk(_tree(f))
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "_model_forward"
    ]
    if not calls:
        return f"{name} no longer calls self._model_forward (the V1 tap wraps it)"
    if not all({"input_ids", "positions"} <= {k.arg for k in call.keywords} for call in calls):
        return f"{name} no longer passes input_ids= and positions= to _model_forward (the V1 tap reads them)"
    has_req_ids = isinstance(inspect.getattr_static(InputBatch, "req_ids", None), property) or "req_ids" in _fields(InputBatch)
    return _first(
        _reads_aux_flag(cls),
        None if has_req_ids else "the V1 InputBatch has no req_ids (the V1 tap orders the step's requests by it)",
        _signature_problem(f"{name}.sample_tokens", cls.sample_tokens, {"self", "grammar_output"}),
    )


def runner_v2_problem(cls) -> str | None:
    """The V2 tap wraps `execute_model` and reads the `execute_model_state` it leaves behind."""
    from vllm.v1.worker.gpu import model_runner as v2
    from vllm.v1.worker.gpu.input_batch import InputBatch

    name = f"{cls.__name__} (V2)"
    if hasattr(cls, "_model_forward"):
        return f"{name} now has _model_forward: corecap's tap would take it for a V1 runner"
    if "dummy_run" not in inspect.signature(_method(cls, "execute_model", name)).parameters:
        return f"{name}.execute_model() no longer accepts dummy_run (the V2 tap skips dummy runs by it)"
    if not any("self.execute_model_state = ExecuteModelState(" in inspect.getsource(f) for f in _using(cls, "ExecuteModelState")):
        return f"{name}.execute_model no longer leaves self.execute_model_state (the V2 tap reads it)"
    return _first(
        _reads_aux_flag(cls),
        _lacks("ExecuteModelState has no field", {"input_batch", "hidden_states", "aux_hidden_states"}, _fields(v2.ExecuteModelState)),
        _lacks("the V2 InputBatch has no field", {"req_ids", "num_scheduled_tokens", "input_ids", "positions"}, _fields(InputBatch)),
    )


@_check("model class: aux hidden states, the model's own (SupportsEagle3) or corecap's override", configured=True)
def _model(vllm_config):
    from corecap._vllm.preflight import plan_capture
    from corecap.errors import CorecapError

    try:
        plan = plan_capture(vllm_config, None)  # the preflight's own resolution of the class
    except CorecapError as e:
        return str(e)
    return Note(plan.line())
