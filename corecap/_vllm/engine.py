"""The engine: vLLM's EngineCore, Scheduler and multiproc executor, built and stepped by hand.

We bypass vLLM's LLM frontend: requests are vLLM `Request`s built here (with the engine's block
hasher), and `step()` is our own schedule → execute_model → sample_tokens → update_from_output,
with async scheduling off so every step's capture belongs to exactly that step. The next step is
scheduled and queued at the workers before the current one's output is back (`_step`).
"""

from __future__ import annotations

import atexit
import os
import shutil
import time
from collections import deque
from dataclasses import dataclass, field

from corecap import CorecapError
from corecap.wire import private_ipc_dir

WORKER_EXTENSION = "corecap._vllm.worker.CaptureExtension"


@dataclass(frozen=True)
class EngineSpec:
    model: str
    layers: tuple[int, ...]
    ipc_path: str
    tensor_parallel_size: int = 1
    max_num_seqs: int = 4
    max_model_len: int = 2048
    max_num_batched_tokens: int | None = None
    dtype: str = "auto"
    load_format: str = "auto"
    enforce_eager: bool = False
    memory_utilization: float | None = None
    seed: int = 0
    # Engine steps scheduled and sent to the workers ahead of their outputs (`Engine._step`);
    # None: $CORECAP_STEPS_IN_FLIGHT, else 2 (1: strictly one step at a time).
    steps_in_flight: int | None = None


@dataclass
class StepTiming:
    """Wall-clock phases of one engine step (time.time() seconds)."""

    start: float
    schedule: float = 0.0
    execute: float = 0.0
    sample: float = 0.0
    update: float = 0.0
    end: float = 0.0
    num_tokens: int = 0
    num_reqs: int = 0
    in_flight: int = 0  # batches at the workers while this one's output was awaited, itself included
    finished: list[str] = field(default_factory=list)


def _cpu_platform() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def _split_cores(num_parts: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND value giving each TP rank its own cores, e.g. '0|1'."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < num_parts:
        raise CorecapError(f"--tp {num_parts} needs at least {num_parts} CPU cores, found {len(cores)}")
    per = len(cores) // num_parts
    groups = [cores[i * per : (i + 1) * per] for i in range(num_parts)]
    return "|".join(f"{g[0]}-{g[-1]}" if len(g) > 1 else str(g[0]) for g in groups)


def private_rpc_dir() -> str:
    """A 0700 directory for vLLM's own IPC sockets (VLLM_RPC_BASE_PATH, default: the shared temp
    dir), made once per process and removed at exit. One per process, not per run: vLLM caches
    its environment once an engine has started."""
    path = os.environ.get("VLLM_RPC_BASE_PATH")
    if not path:
        path = private_ipc_dir("corecap-vllm-")  # vLLM names its sockets by uuid4: 36 chars
        atexit.register(shutil.rmtree, path, True)
        os.environ["VLLM_RPC_BASE_PATH"] = path
    return path


def build_vllm_config(spec: EngineSpec):
    from vllm.engine.arg_utils import EngineArgs

    private_rpc_dir()

    if _cpu_platform() and spec.tensor_parallel_size > 1:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", _split_cores(spec.tensor_parallel_size))
    memory = spec.memory_utilization or (0.2 if _cpu_platform() else 0.9)
    args = EngineArgs(
        model=spec.model,
        tensor_parallel_size=spec.tensor_parallel_size,
        max_num_seqs=spec.max_num_seqs,
        # +1: a prompt of max_model_len tokens still needs room for its one sampled token.
        max_model_len=spec.max_model_len + 1,
        max_num_batched_tokens=spec.max_num_batched_tokens,
        enable_chunked_prefill=True,
        # Cached prefix tokens are never recomputed, so their hidden states would be missing:
        # see docs/design.md.
        enable_prefix_caching=False,
        async_scheduling=False,
        dtype=spec.dtype,
        load_format=spec.load_format,
        enforce_eager=spec.enforce_eager,
        gpu_memory_utilization=memory,
        seed=spec.seed,
        skip_tokenizer_init=True,
        disable_log_stats=True,
        distributed_executor_backend="mp",
        worker_extension_cls=WORKER_EXTENSION,
    )
    config = args.create_engine_config()
    _float32_without_tf32(config)
    return config


def _float32_without_tf32(vllm_config) -> None:
    """A float32 model on CUDA runs vLLM's Triton attention, whose `tl.dot`s take Triton's default
    float32 precision, TF32 (10-bit mantissa): ~1e-3 from HF's float32. Asking for float32
    means float32: make IEEE Triton's default for the workers (spawned later, they inherit it)
    unless the user chose otherwise. vLLM's own matmul setting is VLLM_FLOAT32_MATMUL_PRECISION."""
    import torch

    if vllm_config.model_config.dtype == torch.float32 and not _cpu_platform():
        os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")


def _capture_executor_class(spec: EngineSpec):
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    class CaptureExecutor(MultiprocExecutor):
        """Installs the capture in every worker after load_model, before profiling/compiling."""

        def _init_executor(self) -> None:
            from corecap._vllm.network import private_network

            with private_network(spec.model) as status:  # the workers start here
                super()._init_executor()
            self.corecap_network = status
            self.corecap_workers = self.collective_rpc(
                "corecap_install", args=({"layers": spec.layers, "ipc_path": spec.ipc_path},)
            )

    return CaptureExecutor


def _alive(pid: int) -> bool:
    """Whether the process runs. os.kill(pid, 0) alone succeeds on a zombie: a worker that died
    and that nobody reaped yet, which is how a dead worker of ours first looks."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")  # the state, after the name
    except FileNotFoundError:
        return False
    except (OSError, IndexError):  # no /proc here: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


class Engine:
    """One in-process EngineCore with capture installed; `add` samples, `step` until idle."""

    def __init__(self, spec: EngineSpec, vllm_config=None):
        from vllm.sampling_params import SamplingParams
        from vllm.v1.engine.core import EngineCore

        self.spec = spec
        self.vllm_config = vllm_config or build_vllm_config(spec)
        self.core = EngineCore(self.vllm_config, _capture_executor_class(spec), log_stats=False)
        self.executor = self.core.model_executor
        self.executor.collective_rpc("corecap_arm")
        self.sampling_params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
        self.num_unfinished = 0
        self.steps_in_flight = spec.steps_in_flight or int(os.environ.get("CORECAP_STEPS_IN_FLIGHT") or 2)
        if self.steps_in_flight < 1:
            raise CorecapError(f"CORECAP_STEPS_IN_FLIGHT={self.steps_in_flight}: expected 1 or more")
        self.in_flight: deque = deque()  # (scheduler output, execute future, output future), oldest first

    @staticmethod
    def configure(spec: EngineSpec):
        """vLLM's config for `spec` (cheap: loads no weights); pass it on to `Engine`."""
        return build_vllm_config(spec)

    @staticmethod
    def dtype_of(vllm_config) -> str:
        from corecap.wire import DTYPE_NAMES

        return DTYPE_NAMES[vllm_config.model_config.dtype]

    @property
    def token_budget(self) -> int:
        """The most tokens one engine step schedules (vLLM's max_num_batched_tokens)."""
        return self.vllm_config.scheduler_config.max_num_batched_tokens

    def network_status(self) -> str:
        """Whether the workers run in a network namespace of their own (corecap/_vllm/network.py)."""
        return self.executor.corecap_network

    def ring_status(self) -> str:
        """How the states travel from the workers to the sink (corecap/ring.py)."""
        return next(w["ring"] for w in self.executor.corecap_workers if w["rank"] == 0)

    def worker_stats(self) -> list[dict]:
        """Per worker: steps captured, ring waits, CUDA allocator retries (`corecap_stats`)."""
        return self.executor.collective_rpc("corecap_stats")

    def worker_pids(self) -> list[tuple[int, int]]:
        """(rank, pid) of every worker process."""
        return [(w["rank"], w["pid"]) for w in self.executor.corecap_workers]

    def problem(self) -> str | None:
        """A sentence naming a dead worker, or None while all are alive."""
        for rank, pid in self.worker_pids():
            if not _alive(pid):
                return f"worker rank {rank} (pid {pid}) died"
        if getattr(self.executor, "is_failed", False):
            return "the vLLM executor failed (a worker died)"
        return None

    def add(self, req_id: str, token_ids: list[int]) -> None:
        from vllm.v1.request import Request

        request = Request(
            request_id=req_id,
            prompt_token_ids=token_ids,
            sampling_params=self.sampling_params,
            pooling_params=None,
            arrival_time=time.time(),
            block_hasher=self.core.request_block_hasher,
        )
        self.core.add_request(request)
        self.num_unfinished += 1

    def step(self) -> StepTiming:
        try:
            return self._step()
        except CorecapError:  # ours, or Interrupted (SIGTERM) raised while waiting: at once
            raise
        except Exception:
            # vLLM reports a dead worker as whatever its RPC saw ("cancelled", a timeout...):
            # name the worker instead, once vLLM's monitor has noticed.
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                problem = self.problem()
                if problem:
                    raise CorecapError(f"{problem} during an engine step") from None
                time.sleep(0.1)
            raise

    def _step(self) -> StepTiming:
        """Fill the pipeline (up to `steps_in_flight` batches scheduled and sent to the workers),
        then wait for the oldest batch's output and update the scheduler with it.

        With two in flight, batch N+1 is scheduled and queued at the workers while batch N runs,
        so the driver's bookkeeping no longer sits between two forward passes. vLLM's scheduler
        supports this without async scheduling (it is how pipeline parallelism runs): a request
        whose scheduled tokens are still in flight gets no new tokens until its output arrives.
        Every scheduled batch is sent, empty ones too: they carry finished request ids."""
        scheduler = self.core.scheduler
        executor = self.executor
        timing = StepTiming(start=time.time())
        t_schedule = t_submit = 0.0
        while len(self.in_flight) < self.steps_in_flight and (scheduler.has_requests() or not self.in_flight):
            t = time.time()
            scheduler_output = scheduler.schedule()
            t_schedule += time.time() - t
            t = time.time()
            exec_future = executor.execute_model(scheduler_output, non_block=True)
            if scheduler_output.total_num_scheduled_tokens:
                grammar_output = scheduler.get_grammar_bitmask(scheduler_output)
                output_future = executor.sample_tokens(grammar_output, non_block=True)
            else:  # nothing to sample: the runner answers execute_model itself
                output_future = exec_future
            self.in_flight.append((scheduler_output, exec_future, output_future))
            t_submit += time.time() - t
            if not scheduler_output.total_num_scheduled_tokens:
                break  # everything schedulable is in flight: wait for an output first
        timing.schedule = timing.start + t_schedule
        timing.execute = timing.schedule + t_submit
        timing.in_flight = len(self.in_flight)
        scheduler_output, exec_future, output_future = self.in_flight.popleft()
        model_output = output_future.result()
        if model_output is None:  # sample_tokens found no forward pass: execute_model's error
            exec_future.result()
            raise RuntimeError("the workers returned no output for an engine step")
        timing.sample = time.time()
        outputs = scheduler.update_from_output(scheduler_output, model_output)
        timing.update = timing.end = time.time()
        timing.num_tokens = scheduler_output.total_num_scheduled_tokens
        timing.num_reqs = len(scheduler_output.num_scheduled_tokens)
        for engine_outputs in outputs.values():
            for out in engine_outputs.outputs:
                if out.finish_reason is not None:
                    timing.finished.append(out.request_id)
        self.num_unfinished -= len(timing.finished)
        return timing

    def shutdown(self) -> None:
        self.core.shutdown()
