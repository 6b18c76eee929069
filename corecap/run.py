"""A capture run: validate the input → open the store → start the sink and the engine → step →
finish. `run(cfg)` is the library entry (corecap/api.py and the CLI call it).

The step loop keeps the engine fed (about twice the sequences in flight queued), steps it, and leaves the data path to
the sink process (corecap/sink/: ZeroMQ → reassembled samples → encoded, durable commits). Keys already in the store are
skipped (after checking that their inputs did not change), so rerunning after any interruption completes the store.

`run` changes no process-wide state for good: it installs no signal handler (a caller asks it to stop through `Stop`,
which the CLI sets from SIGTERM and Ctrl-C) and runs from any thread."""

from __future__ import annotations

import contextlib
import signal
import sys
import time

import msgspec

from corecap import __version__
from corecap.errors import CorecapError
from corecap.config import FP8_ENCODE_THREADS, RunConfig
from corecap.generation import Response, Responses, request_seed
from corecap.summary import RunSummary
from corecap.plan import Plan, conversations, prepare, token_bytes
from corecap.progress import Heartbeat, Progress
from corecap.sink import Done, Failed, Sink
from corecap.sink.budget import StatesBudget
from corecap import writer_lock as lock
from corecap.store import FP8
from corecap.trace.analysis import workers_line
from corecap.trace.timeline import write_trace
from corecap.transport import shm


class Interrupted(CorecapError):
    """A stop was requested (SIGTERM, Ctrl-C): the run stopped early after committing every complete sample.
    `exit_status`: the shell's for the signal that asked, 128 + its number (130 for Ctrl-C, 143 for SIGTERM)."""

    def __init__(self, message: str, exit_status: int = 128 + signal.SIGINT):
        super().__init__(message)
        self.exit_status = exit_status


class Stop:
    """A request to stop a run, from any thread or a signal handler: `request("SIGTERM")`."""

    def __init__(self):
        self.reason: str | None = None
        self.num_late = 0  # requests that came once the capture was over

    def request(self, reason: str) -> None:
        if self.reason is None:
            self.reason = reason
        else:
            self.num_late += 1


def run(cfg: RunConfig, log=print, stop: Stop | None = None, terminal=None) -> RunSummary:
    from corecap._vllm import environment

    stop = stop or Stop()
    with lock.held(cfg.store):  # the one writer from the start: a second run is refused before any work
        removed = shm.remove_left_behind()  # a killed run's RAM, before this run needs its own
        if removed.num_files:
            log(removed.line())
        with environment():
            plan = prepare(cfg, log)
            with contextlib.closing(plan.samples):
                if plan.todo == 0:
                    n = plan.total
                    return RunSummary(store=cfg.store, num_samples=n, num_committed=0, num_skipped=n, num_tokens=0,
                                      nbytes=0, seconds=0.0, outcomes=plan.dataset.outcomes())
                capture = _Capture(plan, log, stop, terminal or sys.stderr)
                done = capture.run()
    if stop.reason is not None:
        log(f"{stop.reason} came after the capture had finished: every sample is committed")
    if capture.conversations.line():
        log(capture.conversations.line())
    if capture.budget.line(done.buffers_peak):
        log(capture.budget.line(done.buffers_peak))
    if done.flagged:
        log(f"stored {len(done.flagged)} samples with NaN/Inf, flagged: {done.flagged[:10]}")
    return RunSummary(
        store=cfg.store, num_samples=plan.total, num_committed=done.num_committed, num_skipped=plan.total - plan.todo,
        num_tokens=done.num_tokens, nbytes=done.nbytes, seconds=capture.end - capture.start,
        raw_bytes=done.raw_bytes, outcomes=plan.dataset.outcomes(), num_referring=done.num_referring,
        referred_bytes=done.referred_bytes, num_stored_whole=done.num_stored_whole,
        generated=capture.responses.line(), num_streamed=done.num_streamed, sink_rss_start=done.rss_start,
        sink_rss_peak=done.rss_peak, buffer_bytes=plan.buffer_bytes, sink_buffers_peak=done.buffers_peak,
    )


class _Capture:
    """The engine, the sink and the shared-memory record of one run, and the step loop."""

    def __init__(self, plan: Plan, log, stop: Stop, terminal):
        self.plan, self.cfg, self.log, self.stop, self.terminal = plan, plan.cfg, log, stop, terminal
        self.steps: list | None = [] if self.cfg.trace else None
        self.workers: list[dict] = []
        self.start = self.end = time.time()
        self.engine = None
        self.progress: Progress | None = None  # while the loop runs: a failure ends its line first
        self.responses = Responses()
        self.budget: StatesBudget | None = None  # with the sink
        self.conversations = conversations(plan)
        from corecap._vllm import nodes

        self.nodes = None  # the other nodes of an engine across nodes (_vllm.nodes.Leader)
        self.cluster = nodes.cluster(plan.vllm_config)  # (nnodes, master_addr, master_port) or None

    def run(self) -> Done:
        """Capture every sample still to do; on any failure or stop, commit what is complete,
        shut everything down and raise one CorecapError saying how many samples were kept."""
        from corecap._vllm import nodes, prefix_tracker
        from corecap._vllm.engine import output_rank

        cfg = self.cfg
        tcp = nodes.states_address(self.plan.vllm_config, output_rank(self.plan.vllm_config)) if self.cluster else ""
        block_size = prefix_tracker.block_size(self.plan.vllm_config)
        threads = sink_encode_threads(cfg)
        delay = cfg.test_hooks.commit_delay if cfg.test_hooks else 0.0
        sink = Sink(cfg.store, cfg.codec, cfg.nonfinite, threads, self.plan.buffer_bytes, tcp, block_size, delay)
        self.budget = StatesBudget(self.plan.buffer_bytes, token_bytes(self.plan), sink.released)
        record = shm.ShmRecord()
        try:
            with contextlib.ExitStack() as cleanup:
                cleanup.callback(record.close)
                cleanup.callback(sink.close)
                cleanup.callback(self._close_nodes)  # after the engine: the other nodes' workers go last
                cleanup.callback(self._shutdown_engine)
                try:
                    return self._run(sink, record)
                except BaseException as e:
                    raise self._failed(e, sink) from None
        finally:
            result = sink.result
            if self.steps is not None and isinstance(result, Done):
                sink_memory = {"buffer_bytes": self.plan.buffer_bytes, "buffers_peak": result.buffers_peak,
                               "rss_start": result.rss_start, "rss_peak": result.rss_peak}
                write_trace(cfg.store, self.start, self.end, self.steps, result.chunks, result.commits,
                            result.encodes, result.writes, self.workers, sink_memory)

    def _run(self, sink: Sink, record: shm.ShmRecord) -> Done:
        from corecap._vllm import CaptureSpec, Replicas

        plan, cfg = self.plan, self.cfg
        hooks = cfg.test_hooks
        capture = CaptureSpec(
            layers=plan.layers, ipc_path=sink.capture_path, ring=cfg.ring,
            private_network=cfg.private_network and self.cluster is None,  # other nodes must reach them
            pause_at_step=hooks.pause_at_step if hooks else 0, pause_file=hooks.pause_file if hooks else "",
            remote_address=sink.tcp_address,
            prefix_blocks=cfg.prefix_blocks, fp8=cfg.codec == FP8,
        )
        if self.cluster:
            self._join_nodes()
            self.nodes.watch(on_death=self._node_died)
        record.watch()
        first = plan.vllm_config if len(plan.devices) == 1 else None
        with Heartbeat("engine starting", self.log) as heartbeat:  # vLLM's own log goes to the run's log only
            self.engine = Replicas(cfg.engine, plan.model_dir, capture, plan.devices, first, heartbeat.phase,
                                   first_media=plan.media if first is not None else None)
        record.stop_watching()
        sink.watch(on_death=self.engine.interrupt)
        self.log(f"states to the store: shared-memory ring {self.engine.ring_status()}")
        network = f"off: the engine spans {self.cluster[0]} nodes" if self.cluster else self.engine.network_status()
        self.log(f"vLLM's workers in a private network namespace: {network}")
        for line in self.engine.rotary_lines():
            self.log(f"vLLM's rotary position table differed from its definition: {line}")
        self.log(f"capturing {plan.todo} samples")
        self.start = time.time()
        progress = self.progress = Progress(plan.todo, cfg.progress, self.terminal)
        self._loop(sink, progress)
        self.progress = None
        progress.close()
        if self.engine.prefix_line():
            self.log(self.engine.prefix_line())
        self.workers = self.engine.worker_stats()
        self.log(workers_line(self.workers))
        done = sink.finish(cfg.stall_timeout, self._problem)
        sink.unwatch()
        self.end = time.time()
        return done

    def _loop(self, sink: Sink, progress: Progress) -> None:
        """Feed and step the engine until every sample still to do has been captured."""
        plan, engine, turns = self.plan, self.engine, self.conversations
        samples = iter(plan.samples)  # as the validation pass read and tokenized them, still to do
        queued = 2 * engine.max_num_seqs  # fed, without holding the whole dataset
        # Reading, announcing and adding requests happens between steps, while the batch in flight
        # runs: a little at a time, enough for the batches the next step schedules.
        feed_tokens = (engine.steps_in_flight + 1) * engine.token_budget
        last_progress = time.monotonic()
        exhausted = False
        waiting = None  # a request held back until the sink has room for its response
        while True:
            added = 0
            while (waiting or not exhausted or turns.ready) and engine.num_unfinished < queued and added < feed_tokens:
                if waiting:
                    request, waiting = waiting, None
                elif turns.ready:  # a conversation's next answer, given the model's earlier ones
                    turn = turns.ready.popleft()
                    req_id = f"{turn.conversation.line}.{turn.index}"
                    turns.asked[req_id] = turn
                    request = (req_id, turn.key, turn.token_ids, None, turn.max_tokens, turn if turn.images else None)
                else:
                    sample = next(samples, None)
                    if sample is None:
                        exhausted = True
                        continue
                    if sample.points:  # every turn rewritten: its answers come through `turns`
                        turns.start(sample)
                        continue
                    request = (str(sample.line), sample.key, sample.token_ids, sample.loss_mask, sample.max_tokens,
                               sample if sample.images else None)
                req_id, key, ids, mask, max_tokens, with_images = request
                cost = self.budget.cost(len(ids) + max_tokens, final=not max_tokens)
                if not self.budget.fits(cost):  # the sink's buffers are full: wait for commits
                    waiting = request
                    self.budget.num_waits += 1
                    break
                self.budget.reserve(cost)
                response = None
                if max_tokens:
                    response = Response(
                        num_prompt=len(ids), max_tokens=max_tokens, rule=plan.stop_rule,
                        seed=request_seed(self.cfg.engine.seed, key),
                    )
                images = None
                if with_images is not None:  # the prompt before its expansion, and the images
                    images = (with_images.media.unexpanded.tolist(), [i.source for i in with_images.images])
                block_hashes = engine.add(req_id, ids.tolist(), response, plan.sampling, images)  # scheduled in step()
                sink.expect(req_id, key, ids, mask, block_hashes, max_tokens, cost,
                            media=with_images.media if with_images is not None else None)
                added += len(ids) + max_tokens
            if engine.num_unfinished == 0:
                if waiting is None:
                    return
                self._await_commits(sink, waiting)  # every sample held is written: only their commits free room
                continue
            timing = engine.step()
            sink.prefix(engine.take_prefix_actions())  # before any response: a block hash first, then the sample whole
            for req_id, response in engine.take_responses():
                sink.generated(req_id, response.token_ids, self.responses.record(response, plan.sampling))
                turns.answered(req_id, response)
            if self.steps is not None:
                self.steps.append(timing)
            progress.update(len(timing.finished), timing.num_tokens)
            sink.check()
            problem = self._problem()
            if problem:
                raise CorecapError(problem)
            if timing.num_tokens:
                last_progress = time.monotonic()
            elif time.monotonic() - last_progress > self.cfg.stall_timeout:
                raise CorecapError(f"no progress for {self.cfg.stall_timeout:.0f}s: the engine schedules nothing")

    def _await_commits(self, sink: Sink, request: tuple) -> None:
        """Wait until the sink has committed enough for `request` to fit in --buffer-gb."""
        _, _, ids, _, max_tokens, _ = request
        cost = self.budget.cost(len(ids) + max_tokens, final=not max_tokens)
        deadline = time.monotonic() + self.cfg.stall_timeout
        while not self.budget.fits(cost):
            sink.check()
            problem = self._problem()
            if problem:
                raise CorecapError(problem)
            if time.monotonic() > deadline:
                raise CorecapError(f"no progress for {self.cfg.stall_timeout:.0f}s: the sink committed nothing "
                                   f"while {self.budget.num_held} samples held all of --buffer-gb")
            time.sleep(0.002)

    def _join_nodes(self) -> None:
        """Wait for every other node's `corecap worker`, each checked against this node's
        versions and model, and given this run's engine options (before any weights load)."""
        from corecap._vllm import nodes, vllm_version

        nnodes, address, port = self.cluster
        identity = self.plan.identity
        plan = nodes.Plan(options=msgspec.to_builtins(self.cfg.engine), model=identity.path,
                          config_hash=identity.config_hash, weights_fingerprint=identity.weights_fingerprint,
                          layers=list(self.plan.layers))
        self.nodes = nodes.Leader(nnodes, address, port, plan, (__version__, vllm_version()), self.cfg.stall_timeout,
                                  self.log)

    def _node_died(self, why: str) -> None:
        """Another node's worker died, or its `corecap worker` is gone: end the engine's wait.
        While the engine starts, its workers wait for the missing ranks: end them instead."""
        if self.engine is not None:
            self.engine.interrupt(why)
            return
        import multiprocessing

        for child in multiprocessing.active_children():
            if child.name != "corecap-sink":
                child.kill()

    def _close_nodes(self) -> None:
        if self.nodes is not None:
            self.nodes.close()

    def _problem(self) -> str | None:
        if self.stop.reason is not None:
            raise Interrupted(self.stop.reason)
        return self.engine.problem() or (self.nodes.problem() if self.nodes is not None else None)

    def _failed(self, e: BaseException, sink: Sink) -> BaseException:
        """The one error a failed run raises, once the sink has committed what is complete."""
        sink.unwatch()
        if self.progress is not None:  # the one line that follows is on a line of its own
            self.progress.close()
            self.progress = None
        result = sink.abort()  # whatever went wrong, keep every complete sample
        # A stop requested is the cause, whatever it broke on its way (SIGTERM to the whole process
        # group, or Ctrl-C while vLLM's workers start, ends them as well).
        if isinstance(e, (KeyboardInterrupt, Interrupted)) or self.stop.reason is not None:
            kept = result.num_committed if result is not None else "an unknown number of"
            reason = self.stop.reason or "Ctrl-C"
            number = signal.SIGINT if reason == "Ctrl-C" else getattr(signal, reason, signal.SIGTERM)
            return Interrupted(
                f"interrupted: kept {kept} complete samples committed to {self.cfg.store} this run; "
                "rerun the same command to resume", 128 + number,
            )
        if not isinstance(e, CorecapError):
            return e
        # The sink's own report names the cause best (a worker's error reaches it first).
        node = self.nodes.problem() if self.nodes is not None else None
        reason = result.message if isinstance(result, Failed) else node or str(e)
        kept = result.num_committed if result is not None else 0
        return CorecapError(f"{reason} (kept {kept} complete samples committed this run; rerun to resume)")

    def _shutdown_engine(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()


def sink_encode_threads(cfg: RunConfig) -> int:
    """The sink's encode threads for the run's codec: fp8's at most FP8_ENCODE_THREADS."""
    return min(cfg.encode_threads, FP8_ENCODE_THREADS) if cfg.codec == FP8 else cfg.encode_threads
