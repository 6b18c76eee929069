"""The engine: vLLM's EngineCore, Scheduler and multiproc executor, built and stepped by hand.

We bypass vLLM's LLM frontend: requests are vLLM `Request`s built here (with the engine's block
hasher), and `step()` is our own schedule → execute_model → sample_tokens → update_from_output.
The next step is scheduled and queued at the workers before the current one's output is back
(`_fill`). Every step's capture belongs to exactly that step, with vLLM's async scheduling too
(`AsyncScheduler`, vLLM's default with a GPU): the next step then runs a generating request
again with a placeholder for the token being sampled, which the runner fills in on the device;
the worker's tap reads the token ids and positions the model ran on (corecap/_vllm/worker.py).
"""

from __future__ import annotations

import dataclasses
import re
import shutil
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from corecap.errors import CorecapError
from corecap.config import Layer
from corecap._vllm import prefix_tracker, worker_deaths, worker_errors
from corecap._vllm.executor import capture_executor_class

# Engine steps scheduled and sent to the workers ahead of their outputs. Two keep a GPU's steps
# at the pace of vLLM's own loop; one (strictly a step at a time) is slower (docs/benchmarks.md,
# "Capture").
STEPS_IN_FLIGHT = 2
_DEAD_WORKER_GRACE_S = 10  # how long a failed step waits for vLLM's monitor to name a dead worker


@dataclass(frozen=True, kw_only=True)
class CaptureSpec:
    """What every worker's capture is told (corecap/_vllm/worker.py, `corecap_install`)."""

    layers: tuple[Layer, ...]
    ipc_path: str  # the sink's socket
    ring: bool = True  # states through a shared-memory ring, else inside the messages
    private_network: bool = True
    replica: int = 0  # which data-parallel replica these workers belong to
    sender_rank: int = 0  # the rank that sends the states: TP rank 0 of the last pipeline stage
    remote_address: str = ""  # tcp:// address of the sink, for a sender on another node
    pause_at_step: int = 0  # config.TestHooks
    pause_file: str = ""
    prefix_blocks: int | None = None  # with prefix caching on: the most blocks a hit may name (None: the KV cache's)
    fp8: bool = False  # `--store-dtype fp8`: the sending rank quantises each step (corecap/store/fp8rows.py)


@dataclass(kw_only=True)
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
    replica: int = 0  # the data-parallel replica that ran it
    finished: list[str] = field(default_factory=list)
    num_responses: int = 0  # of those, the responses written (`Engine.take_responses`)


@dataclass
class _Batch:
    scheduler_output: object
    exec_future: object
    output_future: object


def output_rank(vllm_config) -> int:
    """The rank whose output the executor reads (vLLM's `_get_output_rank`): TP rank 0 of the
    last pipeline stage, which with pipeline parallelism also holds every stage's aux states."""
    parallel = vllm_config.parallel_config
    return parallel.world_size - parallel.tensor_parallel_size * getattr(parallel, "prefill_context_parallel_size", 1)


def worker_error(e: BaseException) -> str:
    """The cause in vLLM's report of a worker's failure ("Worker failed with error '...', please
    check the stack trace above"), else its first line."""
    text = str(e)
    m = re.search(r"Worker failed with error '(.*)', please check", text, re.S)
    first = (m.group(1) if m else text).strip().splitlines()
    return (first[0] if first else type(e).__name__)[:500]


class Engine:
    """One in-process EngineCore with capture installed; `add` samples, `step` until idle."""

    def __init__(self, vllm_config, model: str, capture: CaptureSpec, on_phase=None, media=None):
        from vllm.sampling_params import SamplingParams
        from vllm.v1.engine.core import EngineCore

        self.vllm_config = vllm_config
        self.replica = capture.replica
        capture = dataclasses.replace(capture, sender_rank=output_rank(vllm_config))
        made: list = []
        errors = tempfile.mkdtemp(prefix="corecap-worker-errors-")
        try:
            self.core = EngineCore(vllm_config, capture_executor_class(model, capture, made, errors, on_phase),
                                   log_stats=False)
            self.executor = self.core.model_executor
            self.executor.collective_rpc("corecap_arm")
        except BaseException as e:
            # EngineCore leaves a failed start's workers running until the interpreter exits: they
            # would write to the terminal after corecap's error, and hold the run log's pipe open.
            for executor in made:
                executor.shutdown()
            if isinstance(e, CorecapError) or not isinstance(e, Exception):
                raise
            # A worker killed by a signal (it recorded nothing: it is the cause), else the worker's
            # own error, one line (else vLLM's words); its traceback is in the run's log.
            killed = worker_deaths.first_killed(worker_deaths.noted(made))
            cause = killed or worker_errors.first_error(errors) or worker_error(e)
            raise CorecapError(f"vLLM's engine failed to start: {cause}") from None
        finally:
            shutil.rmtree(errors, ignore_errors=True)
        self.sampling_params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
        self.num_unfinished = 0
        self.tokens: dict[str, int] = {}  # unfinished request → its prompt's length (+ its response's most)
        self.responses: dict = {}  # generating request → its generation.Response
        self.written: list[tuple[str, object]] = []  # (req_id, Response) done, not yet taken
        self.num_outstanding_tokens = 0
        # Pipeline parallelism needs a batch per stage in flight to keep every stage busy.
        self.steps_in_flight = max(STEPS_IN_FLIGHT, vllm_config.parallel_config.pipeline_parallel_size)
        self.in_flight: deque[_Batch] = deque()  # oldest first
        self._interrupted: str | None = None
        self._lock = threading.Lock()
        self.prefix = None  # with vLLM's prefix caching on: corecap/_vllm/prefix_tracker.py
        # vLLM's input processor for requests with images (media.py): `media`, one already made on
        # `vllm_config` (the validation pass's), else made on first use
        self.media = media
        if prefix_tracker.block_size(vllm_config):
            problem = prefix_tracker.contract_problem()
            if problem:
                raise CorecapError(f"--enable-prefix-caching: {problem} in this vLLM (corecap/_vllm/prefix_tracker.py)")
            self.prefix = prefix_tracker.PrefixTracker(self.core.scheduler, capture.prefix_blocks)

    @staticmethod
    def dtype_of(vllm_config) -> str:
        from corecap.transport.wire import DTYPE_NAMES

        return DTYPE_NAMES[vllm_config.model_config.dtype]

    @property
    def token_budget(self) -> int:
        """The most tokens one engine step schedules (vLLM's max_num_batched_tokens)."""
        return self.vllm_config.scheduler_config.max_num_batched_tokens

    def network_status(self) -> str:
        """Whether the workers run in a network namespace of their own (corecap/_vllm/network.py)."""
        return self.executor.corecap_network

    def ring_status(self) -> str:
        """How the states travel from the workers to the sink (corecap/transport/ring.py)."""
        return next(w["ring"] for w in self.executor.corecap_workers if w["ring"] is not None)

    def rotary_lines(self) -> list[str]:
        """The rotary position tables a worker rebuilt (corecap/_vllm/rotary_tables.py), each
        with its rank."""
        return [f"rank {w['rank']}: {line}" for w in self.executor.corecap_workers for line in w["rotary"]]

    def worker_stats(self) -> list[dict]:
        """Per worker: steps captured, ring waits, CUDA allocator retries (`corecap_stats`)."""
        return self.executor.collective_rpc("corecap_stats")

    def worker_pids(self) -> list[tuple[int, int]]:
        """(rank, pid) of every worker process on this node (another node's `corecap worker`
        watches its own: corecap/_vllm/nodes.py)."""
        return [(w["rank"], w["pid"]) for w in self.executor.corecap_workers if not w.get("node_rank")]

    def problem(self, during: str = "") -> str | None:
        """A sentence naming a dead worker (the signal that killed it, if one did), or None while
        all are alive. `during`: what it was doing, said after its name."""
        for rank, pid in self.worker_pids():
            if not worker_deaths.alive(pid):
                return worker_deaths.describe(rank, pid, self._exit_code(pid), during)
        if getattr(self.executor, "is_failed", False):
            return "the vLLM executor failed (a worker died)"
        return None

    def _exit_code(self, pid: int) -> int | None:
        """A dead worker's exit status (None: not known within worker_deaths.SETTLE_S): from vLLM's
        handle on its process, else from what `_ensure_worker_termination` noted (vLLM's monitor
        may have reaped it and dropped the handles). A killed worker looks dead in /proc a
        moment before its status is readable (worker_deaths.py), hence the wait."""
        deadline = time.monotonic() + worker_deaths.SETTLE_S
        while True:
            for worker in getattr(self.executor, "workers", None) or []:
                if worker.proc.pid == pid and worker.proc.exitcode is not None:
                    return worker.proc.exitcode
            for _, dead_pid, exitcode in getattr(self.executor, "corecap_deaths", []):
                if dead_pid == pid:
                    return exitcode
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.01)

    def interrupt(self, reason: str) -> None:
        """From another thread: end a step that waits on the workers with CorecapError(reason),
        by shutting the executor down, as vLLM's own monitor does when a worker dies."""
        with self._lock:
            if self._interrupted is None:
                self._interrupted = reason
                self.executor.shutdown()

    def add(self, req_id: str, token_ids: list[int], response=None, settings: dict | None = None,
            images: tuple | None = None) -> list[bytes] | None:
        """Queue a sample; with prefix caching on, returns vLLM's hashes of its full blocks.
        `response` (a generation.Response): the model writes one, sampled with `settings`.
        `images`: (the prompt before its expansion, the images' sources), and `token_ids` the
        expanded prompt: the request goes through vLLM's multimodal input path (media.py)."""
        from vllm.v1.request import Request

        from corecap._vllm.sampling import sampling_params

        params = self.sampling_params
        if response is not None:
            params = sampling_params(settings or {}, response.max_tokens, response.seed)
        if images:
            request = self._media_request(req_id, token_ids, images, params)
        else:
            request = Request(
                request_id=req_id,
                prompt_token_ids=token_ids,
                sampling_params=params,
                pooling_params=None,
                arrival_time=time.time(),
                block_hasher=self.core.request_block_hasher,
            )
        self.core.add_request(request)
        self.num_unfinished += 1
        self.tokens[req_id] = len(token_ids) + (response.max_tokens if response is not None else 0)
        self.num_outstanding_tokens += self.tokens[req_id]
        if response is not None:
            self.responses[req_id] = response
        if self.prefix is None:
            return None
        if response is not None:  # the blocks its response completes are told as they are
            self.prefix.told(req_id, len(request.block_hashes))
        return list(request.block_hashes)

    def _media_request(self, req_id: str, token_ids: list[int], images: tuple, params):
        from corecap._vllm.media import MediaInputs, media_request

        if self.media is None:
            self.media = MediaInputs(self.vllm_config)
        return media_request(self.core, self.media, req_id, token_ids, images, params)

    def abort(self, req_id: str) -> int | None:
        """End an unfinished request now (its client went away): vLLM frees its KV blocks, and a
        batch of it still at the workers is skipped when its output comes back (the scheduler's
        update_from_output passes over finished requests). None: not here, or already finished;
        else, with prefix caching on, how many of its leading positions the steps scheduled for it
        compute (their states still reach the sink, which needs the blocks they complete:
        prefix_tracker.py `abandon`), 0 with it off."""
        from vllm.v1.request import RequestStatus

        if req_id not in self.tokens:
            return None
        self.core.scheduler.finish_requests([req_id], RequestStatus.FINISHED_ABORTED)
        self.responses.pop(req_id, None)
        self.num_unfinished -= 1
        self.num_outstanding_tokens -= self.tokens.pop(req_id)
        return self.prefix.abandon(req_id) if self.prefix is not None else 0

    def take_prefix_actions(self) -> list[tuple]:
        """What the sink must do for the prefix cache since the last call (corecap/_vllm/prefix_tracker.py)."""
        return self.prefix.take_actions() if self.prefix is not None else []

    def take_responses(self) -> list[tuple[str, object]]:
        """(req_id, generation.Response) of every response written since the last call."""
        written, self.written = self.written, []
        return written

    def step(self) -> StepTiming:
        try:
            return self._step()
        except CorecapError:  # ours: at once
            raise
        except Exception as e:
            if self._interrupted:
                raise CorecapError(self._interrupted) from None
            if "Worker failed with error" in str(e):  # a worker raised: vLLM passes its message on
                raise CorecapError(self._step_failure(worker_error(e))) from None
            # vLLM reports a dead worker as whatever its RPC saw ("cancelled", a timeout...):
            # name the worker instead, once vLLM's monitor has noticed.
            deadline = time.monotonic() + _DEAD_WORKER_GRACE_S
            while time.monotonic() < deadline:
                problem = self.problem(" during an engine step")
                if problem:
                    raise CorecapError(problem) from None
                time.sleep(0.1)
            raise

    def _step_failure(self, cause: str) -> str:
        """One line naming the rank: corecap's tap says whose error it is; for vLLM's own, it is
        the rank vLLM reads step results from (its `output_rank`)."""
        if cause.startswith("worker rank "):
            return f"{cause} (during an engine step)"
        return f"worker rank {getattr(self.executor, 'output_rank', 0)} failed during an engine step: {cause}"

    def _step(self) -> StepTiming:
        """Fill the pipeline, then wait for the oldest batch's output and update the scheduler."""
        timing = StepTiming(start=time.time())
        self._fill(timing)
        batch = self.in_flight.popleft()
        model_output = batch.output_future.result()
        # The forward pass's own result first: when it raised in a worker, vLLM's runner answers
        # sample_tokens with an empty output (no state to sample from), which update_from_output
        # would fail on with a KeyError for the batch's first request, hiding the worker's error.
        batch.exec_future.result()
        if model_output is None:
            raise RuntimeError("the workers returned no output for an engine step")
        timing.sample = time.time()
        outputs = self.core.scheduler.update_from_output(batch.scheduler_output, model_output)
        timing.update = timing.end = time.time()
        timing.num_tokens = batch.scheduler_output.total_num_scheduled_tokens
        timing.num_reqs = len(batch.scheduler_output.num_scheduled_tokens)
        for eo in outputs.values():
            for o in eo.outputs:
                response = self.responses.get(o.request_id)
                if response is None:
                    if o.finish_reason is not None:
                        timing.finished.append(o.request_id)
                elif response.take(o.new_token_ids) or o.finish_reason is not None:
                    response.capped()  # where vLLM ended it first (a no-op otherwise)
                    self.written.append((o.request_id, self.responses.pop(o.request_id)))
                    timing.num_responses += 1
                elif response.finish_reason is not None:
                    self._one_step_more(o.request_id)
        if timing.num_responses:  # their final tokens' states are computed: nothing more to run
            from vllm.v1.request import RequestStatus

            done = [req_id for req_id, _ in self.written[-timing.num_responses :]]
            self.core.scheduler.finish_requests(done, RequestStatus.FINISHED_ABORTED)
            timing.finished += done
        if self.prefix is not None:
            self.prefix.forget(timing.finished)
            self.prefix.after_update()
        self.num_unfinished -= len(timing.finished)
        for req_id in timing.finished:
            self.num_outstanding_tokens -= self.tokens.pop(req_id, 0)
        timing.replica = self.replica
        return timing

    def _one_step_more(self, req_id: str) -> None:
        """A response's final token was sampled: the step that feeds it (its states) is the
        request's last. With async scheduling that step may already be at the workers, and vLLM
        would schedule one more after it, feeding the token it samples, whose states no sample
        holds. Lowering the request's max_tokens to that token makes vLLM's scheduler skip that
        step (its check for a request whose step in flight reaches max_tokens) and end the
        request itself there; `Response.take` ends it at the same output."""
        request = self.core.scheduler.requests.get(req_id)
        if request is not None:
            request.max_tokens = min(request.max_tokens, request.num_output_tokens + 1)

    def _fill(self, timing: StepTiming) -> None:
        """Schedule and send batches until `steps_in_flight` are at the workers.

        With two in flight, batch N+1 is scheduled and queued at the workers while batch N runs,
        so the driver's bookkeeping no longer sits between two forward passes. vLLM's scheduler
        supports this without async scheduling (it is how pipeline parallelism runs): a request
        whose scheduled tokens are still in flight gets no new tokens until its output arrives.
        Every scheduled batch is sent, empty ones too: they carry finished request ids."""
        scheduler = self.core.scheduler
        t_schedule = t_submit = 0.0
        while len(self.in_flight) < self.steps_in_flight and (scheduler.has_requests() or not self.in_flight):
            t = time.time()
            scheduler_output = scheduler.schedule()
            if self.prefix is not None:  # before the next schedule(): see prefix_tracker.py
                self.prefix.after_schedule(scheduler_output)
            t_schedule += time.time() - t
            t = time.time()
            exec_future = self.executor.execute_model(scheduler_output, non_block=True)
            output_future = exec_future  # nothing to sample: the runner answers execute_model itself
            if scheduler_output.total_num_scheduled_tokens:
                output_future = self.executor.sample_tokens(scheduler.get_grammar_bitmask(scheduler_output),
                                                            non_block=True)
            self.in_flight.append(_Batch(scheduler_output, exec_future, output_future))
            t_submit += time.time() - t
            if not scheduler_output.total_num_scheduled_tokens:
                break  # everything schedulable is in flight: wait for an output first
        timing.schedule = timing.start + t_schedule
        timing.execute = timing.schedule + t_submit
        timing.in_flight = len(self.in_flight)

    def shutdown(self) -> None:
        self.core.shutdown()
