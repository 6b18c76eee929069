"""The server's engine: one thread that owns vLLM's engine and the sink and steps them, fed by
the HTTP handlers' requests from any thread. Requests that arrive while others run join the
next step (continuous batching, as `corecap run` batches a file); each is answered once the sink
has written its file (corecap/sink/deliver.py).

Every request's name is the server's own (`corecap-NNNNNNNNNNNN`: its file under
--hidden-states-path, or its key in the Mooncake store): nothing a client sends becomes a path."""

from __future__ import annotations

import collections
import os
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

from corecap.errors import CorecapError
from corecap.generation import Response, Responses, StopRule, request_seed
from corecap.progress import Heartbeat
from corecap.serve.metrics import Metrics
from corecap.serve.prepare import ServePlan
from corecap.serve.quota import Quota
from corecap.serve.requests import BadRequest, CaptureRequest
from corecap.sink import Sink
from corecap.sink.budget import StatesBudget
from corecap.sink.deliver import SUFFIX, DeliverSpec
from corecap.sink.mooncake import SpecCapture, manifest

_IDLE_WAIT_S = 0.05  # how long an idle engine thread waits for a request before checking the sink
_STORE_FULL_S = 1.0  # after the Mooncake store had no room for a sample: new requests answered 503 that long


class ServerFull(CorecapError):
    """No room for another request's states now (HTTP 503, with Retry-After)."""


@dataclass(eq=False)  # one ticket equals only itself (`abandon` finds it in the queue)
class Ticket:
    """One request on its way: its name, and the future its handler awaits (its kv_transfer_params)."""

    name: str
    request: CaptureRequest
    spec_capture: SpecCapture | None = None  # SpecForge's layout (/generate), not speculators'
    settings: dict | None = None  # with request.max_tokens: the sampling settings in effect (vLLM's names)
    response: Response | None = None  # the response the model writes, once admitted
    future: Future = field(default_factory=Future)
    abandoned: bool = False  # its client went away: aborted, or its file removed once written
    nixl: bool = False  # ModelOpt's reader's: its states to NIXL's pool (corecap/serve/nixl.py), not a file
    key: str = ""  # with --store: the key it is committed under once delivered (serve/store_copy.py)


class EngineLoop:
    def __init__(self, plan: ServePlan, log, metrics: Metrics):
        self.plan, self.log, self.metrics = plan, log, metrics
        self.directory = os.path.abspath(plan.cfg.hidden_states_path)
        self.quota = Quota(self.directory, plan.cfg.quota_bytes)
        self.mooncake = plan.cfg.backend == "mooncake"  # else files, counted by the quota
        self.store_full: tuple[float, str] | None = None  # (when, why) the Mooncake store last had no room
        self.waiting: collections.deque[Ticket] = collections.deque()
        self.abandoned: list[Ticket] = []  # admitted, their clients gone: the engine thread aborts them
        self.running: dict[str, Ticket] = {}
        self.wake = threading.Condition()
        self.stopping = False
        self.failure: str | None = None  # why the engine stopped serving
        self.num_requests = 0
        self.responses = Responses()  # the responses written, each one's record
        self.started = 0.0  # when it began serving (time.time())
        self.engine = self.sink = self.budget = None
        self.held_back = None  # the request waiting for room in --buffer-gb, if any
        self.thread: threading.Thread | None = None
        self.nixl = None  # NixlStates, with --nixl-sidecar-port
        self.store = None  # StoreReport, with --store (serve/store_copy.py); `serve` sets it and num_requests

    def start(self) -> None:
        """Start the sink and the engine (the weights load here), then the stepping thread."""
        from corecap._vllm import CaptureSpec, Engine, Replicas
        from corecap.dtypes import DTYPES

        plan, run = self.plan, self.plan.cfg.run
        spec = DeliverSpec(self.directory, plan.positions, fp8=plan.cfg.backend == "fp8",
                           mooncake=plan.cfg.mooncake if self.mooncake else None, spec_positions=plan.spec_positions)
        store = plan.cfg.store or ""  # each sample delivered also committed there, in its codec (sink/store_copy.py)
        self.sink = Sink(store, "raw", "stop", run.encode_threads if store else 1, plan.buffer_bytes,
                         block_size=plan.block_size, deliver=spec,
                         layers=plan.layers)
        self.hidden_size = plan.vllm_config.model_config.get_hidden_size()
        self.dtype = DTYPES[Engine.dtype_of(plan.vllm_config)]
        capture = CaptureSpec(layers=plan.layers, ipc_path=self.sink.capture_path, ring=run.ring,
                              private_network=run.private_network, prefix_blocks=plan.prefix_blocks or None)
        try:
            first = plan.vllm_config if len(plan.devices) == 1 else None
            with Heartbeat("engine starting", self.log) as heartbeat:
                self.engine = Replicas(run.engine, plan.model_dir, capture, plan.devices, first, heartbeat.phase)
        except BaseException:
            self.sink.close()
            raise
        self.sink.watch(on_death=self.engine.interrupt)
        # The samples in flight get the sink's memory less the copies of the cached blocks' states
        # (corecap/sink/prefix_cache.py): as many as the engines may keep cached (each engine's bound,
        # no more than its KV cache holds).
        cached = sum(self.engine.prefix_bounds()) * plan.block_bytes
        token_bytes = len(plan.layers) * self.hidden_size * self.dtype.itemsize
        bound = (f"{(plan.buffer_bytes - cached) / 2**30:.3g} GiB, --buffer-gb {plan.buffer_bytes / 2**30:g} "
                 "less the prefix cache's copies") if cached else None
        self.budget = StatesBudget(plan.buffer_bytes - cached, token_bytes, self.sink.released, bound)
        line = prefix_line(plan, self.engine.prefix_bounds())
        if line:
            self.log(line)
        self.thread = threading.Thread(target=self._serve, name="corecap-engine", daemon=True)
        self.thread.start()

    def sampling(self, request: CaptureRequest) -> dict:
        """The settings a response is sampled with: the request's, then the model's generation
        config; a value vLLM refuses is the request's fault (BadRequest, naming the settings)."""
        from corecap._vllm import sampling

        settings, _ = sampling.effective_sampling(request.sampling, self.plan.vllm_config)
        try:
            sampling.check_sampling(settings, request.sampling)
        except CorecapError as e:
            raise BadRequest("sampling", str(e)) from None
        return settings

    def submit(self, request: CaptureRequest, spec_capture: SpecCapture | None = None,
               settings: dict | None = None, nixl: bool = False) -> Ticket:
        """Queue a request (any thread); raises ServerFull when its states would not fit.
        `settings`: `sampling(request)`'s, for a request that has the model write a response."""
        if self.failure is not None:
            raise CorecapError(self.failure)
        if self.stopping:
            raise ServerFull("the server is shutting down")
        if not self.mooncake and not self.quota.fits():
            raise ServerFull(f"--hidden-states-path {self.directory}: {self.quota.line()}; "
                             "the trainer has not taken the files written so far")
        if self.store_full is not None and time.monotonic() - self.store_full[0] < _STORE_FULL_S:
            raise ServerFull(self.store_full[1])
        with self.wake:
            self.num_requests += 1
            name = f"corecap-{self.num_requests:012d}"
            key = (request.request_id or name) if self.store is not None else ""
            ticket = Ticket(name, request, spec_capture, settings, nixl=nixl, key=key)
            if nixl:
                self._reserve_nixl(ticket)
            self.waiting.append(ticket)
            self.metrics.queued = len(self.waiting)
            self.wake.notify()
        return ticket

    def abandon(self, ticket: Ticket) -> None:
        """Its client went away: nobody will read its states. A request still waiting is dropped, one
        in the engine aborted (its KV blocks and the states captured so far freed), one answered
        has its file or its Mooncake objects removed; a ModelOpt reader's range of NIXL's pool is
        freed in every case."""
        with self.wake:
            ticket.abandoned = True
            if ticket.nixl:
                self.nixl.release(ticket.name)
            if ticket in self.waiting:
                self.waiting.remove(ticket)
                self.metrics.queued = len(self.waiting)
                self.metrics.aborted()
                ticket.future.cancel()
                return
            if not ticket.future.done() or (self.mooncake and not ticket.nixl):
                self.abandoned.append(ticket)  # the engine thread's to abort, or to remove its objects
                self.wake.notify()
                return
        if not ticket.nixl:
            self.quota.remove(ticket.name + SUFFIX)

    def stop(self, timeout: float) -> None:
        """Answer what is in flight (within `timeout` seconds), then shut the engine and sink down."""
        with self.wake:
            self.stopping = True
            for ticket in self.waiting:
                ticket.future.set_exception(ServerFull("the server is shutting down"))
            self.waiting.clear()
            self.wake.notify()
        if self.thread is not None:
            self.thread.join(timeout)
        if self.engine is not None:
            if self.engine.prefix_line():
                self.log(self.engine.prefix_line())
            if self.budget is not None and self.budget.line():
                self.log(self.budget.line())
            self.engine.shutdown()
        if self.sink is not None:
            self.sink.unwatch()
            self.sink.abort(timeout=60 if self.store is not None else 10)  # --store: its last commits
            self.sink.close()
            if self.store is not None:
                self.store.update(self.sink.kept)
        for ticket in self.running.values():  # not answered in time: no file is left half-written
            if not ticket.future.done():
                ticket.future.set_exception(CorecapError("the server shut down before this request's states"))
        self.quota.remove_partial()

    def _serve(self) -> None:
        try:
            while not (self.stopping and not self.running):
                self._abort()
                self._admit()
                if self.engine.num_unfinished:
                    timing = self.engine.step()
                    self.metrics.stepped(timing.num_tokens)
                    # before any response: a block's hash first, then the sample whole (as `corecap run`)
                    self.sink.prefix(self.engine.take_prefix_actions())
                    self.metrics.prefix = self.engine.prefix_counts()
                    for name, response in self.engine.take_responses():  # written: the sink completes its sample
                        self.sink.generated(name, response.token_ids,
                                            self.responses.record(response, self.running[name].settings))
                else:
                    with self.wake:
                        if not self.waiting and not self.stopping:
                            self.wake.wait(_IDLE_WAIT_S)
                self.sink.check()
                if self.store is not None:
                    self.store.update(self.sink.kept)
                self._answer()
                problem = self.engine.problem()
                if problem:
                    raise CorecapError(problem)
        except BaseException as e:
            self._fail(str(e) if isinstance(e, CorecapError) else f"internal error: {type(e).__name__}: {e}")

    def _abort(self) -> None:
        """End the requests whose clients went away: out of the engine, their samples out of the
        sink. One the engine already finished is still being written: its file goes once written."""
        with self.wake:
            abandoned, self.abandoned = self.abandoned, []
        for ticket in abandoned:
            if ticket.future.done():  # answered: what it put in the Mooncake store goes (`abandon`)
                if not ticket.future.cancelled() and ticket.future.exception() is None:
                    self.sink.discard(_keys(ticket))
                continue
            until = self.engine.abort(ticket.name) if ticket.name in self.running else None
            if until is None:  # not running, or its response already written: its file goes once written
                continue
            self.sink.forget(ticket.name, until)
            del self.running[ticket.name]
            self.metrics.running = len(self.running)
            self.metrics.aborted()
            ticket.future.cancel()

    def _admit(self) -> None:
        """Give the engine the waiting requests, about twice what it runs at once, within --buffer-gb."""
        queued = 2 * self.engine.max_num_seqs
        while self.waiting and self.engine.num_unfinished < queued:
            ticket = self.waiting[0]
            ids, max_tokens = ticket.request.token_ids, ticket.request.max_tokens
            cost = self.budget.cost(len(ids) + max_tokens, final=False)  # held whole: a file is one buffer
            if not self.budget.fits(cost):
                if ticket is not self.held_back:  # counted once a request, however long it waits
                    self.held_back = ticket
                    self.budget.num_waits += 1
                return
            with self.wake:
                self.waiting.popleft()
                self.metrics.queued = len(self.waiting)
            self.budget.reserve(cost)
            if max_tokens:
                seed = ticket.request.seed if ticket.request.seed is not None else request_seed(0, ticket.name)
                ticket.response = Response(num_prompt=len(ids), max_tokens=max_tokens, rule=self._stop_rule(ticket),
                                           seed=seed)
            block_hashes = self.engine.add(ticket.name, ids.tolist(), ticket.response, ticket.settings)
            self.sink.expect(ticket.name, ticket.name, ids, ticket.request.loss_mask, block_hashes, max_tokens, cost,
                             ticket.spec_capture, lossless=ticket.nixl, store_key=ticket.key)
            self.running[ticket.name] = ticket
            self.metrics.running = len(self.running)

    def _answer(self) -> None:
        for delivered in self.sink.take_delivered():
            ticket = self.running.pop(delivered.req_id, None)
            if ticket is None:  # aborted after the sink had written it: nobody will read it
                if self.mooncake and not delivered.error:
                    # speculators' object (a SpecForge request's tensors, named by its own keys, stay)
                    self.sink.discard([delivered.req_id])
                elif not delivered.error:
                    self.quota.remove(delivered.req_id + SUFFIX)
                continue
            self.metrics.running = len(self.running)
            if delivered.error:
                if ticket.nixl:
                    self.nixl.release(ticket.name)
                if delivered.full:  # the trainer has yet to take objects: this request and the next second's wait
                    why = f"{delivered.error} (--mooncake-global-segment-gib)"
                    self.store_full = (time.monotonic(), why)
                    ticket.future.set_exception(ServerFull(why))
                else:
                    ticket.future.set_exception(CorecapError(f"writing the states failed: {delivered.error}"))
                continue
            num_tokens = len(ticket.request.token_ids) + (len(ticket.response.token_ids) if ticket.response else 0)
            self.metrics.delivered(num_tokens, delivered.nbytes)
            if ticket.spec_capture is not None:  # the answer names the tensors (serve/specforge.py)
                params = {}
            elif ticket.nixl:
                params = self._to_nixl(ticket)
            elif self.mooncake:
                params = manifest(ticket.name, num_tokens, len(self.plan.positions), self.hidden_size, self.dtype,
                                  with_response=ticket.response is not None)
            else:
                self.quota.add(ticket.name + SUFFIX, delivered.nbytes)
                if ticket.abandoned:
                    self.quota.remove(ticket.name + SUFFIX)
                params = {"hidden_states_path": os.path.join(self.directory, ticket.name + SUFFIX)}
            if self.mooncake and not ticket.nixl and ticket.abandoned:  # its client went away meanwhile
                self.sink.discard(_keys(ticket))
            ticket.future.set_result(params)

    def _reserve_nixl(self, ticket: Ticket) -> None:
        """Its range of NIXL's pool: every token it may have, at every layer of the file."""
        from corecap.serve.nixl import PoolFull

        num_tokens = len(ticket.request.token_ids) + ticket.request.max_tokens
        token_bytes = len(self.plan.positions) * self.hidden_size * self.dtype.itemsize
        try:
            self.nixl.reserve(ticket.name, num_tokens * token_bytes)
        except PoolFull as e:
            raise ServerFull(str(e)) from None

    def _to_nixl(self, ticket: Ticket) -> dict:
        """The file the sink wrote into NIXL's pool (then removed): ModelOpt's reader's answer."""
        from safetensors import safe_open

        path = os.path.join(self.directory, ticket.name + SUFFIX)
        try:
            with safe_open(path, "pt") as f:
                states, token_ids = f.get_tensor("hidden_states"), f.get_tensor("token_ids").tolist()
            self.nixl.hold(ticket.name, states, token_ids)
        finally:
            self.quota.remove(ticket.name + SUFFIX)
        return self.nixl.params(ticket.name)

    def _stop_rule(self, ticket: Ticket) -> StopRule:
        options, tokenizer = ticket.request.sampling, self.plan.tokenizer
        decode = None if tokenizer is None else (lambda ids: tokenizer.decode(ids, skip_special_tokens=False))
        return StopRule(frozenset() if options.ignore_eos else self.plan.eos_token_ids, options.stop, decode)

    def _fail(self, why: str) -> None:
        """The engine cannot go on: every request still here gets the error, and so does the server."""
        self.failure = why
        with self.wake:
            tickets = list(self.waiting) + list(self.running.values())
            self.waiting.clear()
        for ticket in tickets:
            if not ticket.future.done():
                ticket.future.set_exception(CorecapError(why))
        self.on_failure()

    def on_failure(self) -> None:
        """Set by the server: stop serving (the engine failed)."""


def prefix_line(plan: ServePlan, bounds: list[int]) -> str:
    """What the server says of vLLM's prefix caching once its engines started ('' : off)."""
    if not plan.block_size or not bounds:
        return ""
    each = f"{bounds[0]} blocks" if len(set(bounds)) == 1 else f"{', '.join(map(str, bounds))} blocks"
    engines = f" in each of {len(bounds)} engines" if len(bounds) > 1 else ""
    return (f"prefix caching: at most {each} of {plan.block_size} tokens kept cached{engines} "
            f"({sum(bounds) * plan.block_bytes / 2**20:,.1f} MiB of the sink's --buffer-gb "
            f"{plan.buffer_bytes / 2**30:g} for a copy of their states; --prefix-blocks sets it)")


def _keys(ticket: Ticket) -> list[str]:
    """The Mooncake objects a request's sample was put under."""
    return ticket.spec_capture.keys() if ticket.spec_capture is not None else [ticket.name]


def retry_after(loop: EngineLoop) -> int:
    """Seconds a client told 503 should wait before asking again."""
    return 1 if loop.quota.fits() else 5
