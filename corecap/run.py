"""A capture run: validate the input → open the store → start the sink and the engine → step →
finish. `run(cfg)` is the library entry (corecap/api.py and the CLI call it).

The step loop keeps the engine fed (about twice the sequences in flight queued), steps it, and leaves the data path to
the sink process (corecap/sink/: ZeroMQ → reassembled samples → encoded, durable commits). Keys already in the store are
skipped (after checking that their inputs did not change), so rerunning after any interruption completes the store.

`run` changes no process-wide state for good: it installs no signal handler (a caller asks it to stop through `Stop`,
which the CLI sets from SIGTERM and Ctrl-C) and runs from any thread."""

from __future__ import annotations

import contextlib
import sys
import time
from dataclasses import dataclass

import msgspec
import psutil

from corecap import __version__, data, demo
from corecap.errors import CorecapError
from corecap.config import FP8_ENCODE_THREADS, RunConfig, resolve_layers
from corecap.generation import Conversations, Response, ResponseBudget, Responses, StopRule, buffer_bytes, request_seed
from corecap.resume import ResumeCheck, committed_fingerprints
from corecap.summary import RunSummary
from corecap.model import load_tokenizer, model_identity, resolve_model_dir
from corecap.progress import Progress
from corecap.sink import Done, Failed, Sink
from corecap.store import FORMAT_VERSION, FP8, LAYER_MEANING, Store, StoreMeta
from corecap.trace.analysis import workers_line
from corecap.trace.timeline import write_trace
from corecap.transport import shm


class Interrupted(CorecapError):
    """A stop was requested (SIGTERM, Ctrl-C): the run stopped early after committing every complete sample."""


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


@dataclass(frozen=True)
class _Plan:
    """What a run knows before its engine starts."""

    cfg: RunConfig
    model_dir: str
    data_path: str
    read: dict  # data.read_samples' options
    committed: dict  # key → input fingerprint, already in the store
    dataset: data.DatasetSummary
    todo: int
    vllm_config: object
    layers: tuple
    identity: object  # store.ModelIdentity
    devices: list  # per replica: the environment its workers start with (_vllm.placement)
    sampling: dict | None = None  # --max-tokens: the sampling settings in effect (vLLM's names)
    stop_rule: StopRule | None = None  # --max-tokens: when a response ends
    total: int = 0  # the input's samples (a rewritten conversation: one a turn)
    buffer_bytes: int = 0  # the sink's memory bound (generation.buffer_bytes)


def run(cfg: RunConfig, log=print, stop: Stop | None = None, terminal=None) -> RunSummary:
    from corecap._vllm import environment

    stop = stop or Stop()
    removed = shm.remove_left_behind()  # a killed run's RAM, before this run needs its own
    if removed.num_files:
        log(removed.line())
    with environment():
        plan = _prepare(cfg, log)
        if plan.todo == 0:
            n = plan.total
            return RunSummary(cfg.store, n, 0, n, 0, 0, 0.0, 0, plan.dataset.outcomes())
        capture = _Capture(plan, log, stop, terminal or sys.stderr)
        done = capture.run()
    if stop.reason is not None:
        log(f"{stop.reason} came after the capture had finished: every sample is committed")
    if capture.conversations.line():
        log(capture.conversations.line())
    if capture.budget.line():
        log(capture.budget.line())
    if done.flagged:
        log(f"stored {len(done.flagged)} samples with NaN/Inf, flagged: {done.flagged[:10]}")
    return RunSummary(
        cfg.store, plan.total, done.num_committed, plan.total - plan.todo,
        done.num_tokens, done.nbytes, capture.end - capture.start, done.raw_bytes, plan.dataset.outcomes(),
        done.num_referring, done.referred_bytes, done.num_stored_whole, capture.responses.line(),
    )


def _prepare(cfg: RunConfig, log) -> _Plan:
    """Everything that can fail before the engine starts: the model's identity, the layers, the
    engine configuration (no weights), the whole dataset, the store's metadata."""
    from corecap._vllm import (Engine, checked_vllm_config, check_pipeline, effective_settings, max_prompt_len, nodes,
                               placement, vllm_version)

    model_dir = resolve_model_dir(cfg.model) if cfg.model else demo.demo_model_dir()
    data_path = cfg.data or demo.demo_data_path()
    identity = model_identity(model_dir, cfg.engine.load_format)
    layers = resolve_layers(cfg.layers, identity.num_layers)
    # vLLM's contract (its source first), the preflight
    vllm_config = checked_vllm_config(cfg.engine, model_dir, log, layers)
    version = vllm_version()  # vLLM is imported by now, not before its source was checked
    check_pipeline(vllm_config, version)
    devices = placement(vllm_config, cfg.engine.data_parallel_size)
    nodes.cluster(vllm_config)  # node 0 only
    tokenizer = load_tokenizer(model_dir)
    settings, stop_rule, generation_line = _generation(cfg, vllm_config, tokenizer)
    sink_bytes = buffer_bytes(cfg.buffer_bytes, cfg.sampling.generate, psutil.virtual_memory().available)
    if cfg.sampling.generate:  # it bounds the responses in flight, and so the decode batch
        generation_line += f", sink buffers {sink_bytes / 2**20:,.0f} MiB (--buffer-gb)"
    log(effective_settings(vllm_config) + (f", {len(devices)} replicas" if len(devices) > 1 else "") + generation_line)
    max_len = max_prompt_len(vllm_config)
    read = dict(
        tokenizer=tokenizer, vocab_size=identity.vocab_size, max_len=max_len,
        overflow=cfg.overflow, invalid=cfg.invalid, shard=cfg.shard,
        max_tokens=cfg.sampling.max_tokens, template_kwargs=dict(cfg.chat_template_kwargs),
        all_turns=cfg.sampling.generate and cfg.sampling.rewrite_turns == "all",
    )
    # Keys already committed, read before validating so that the same pass checks their inputs;
    # the store itself is created (and its metadata checked) only once the input is known good.
    committed = committed_fingerprints(cfg.store)
    resume = ResumeCheck(committed)
    dataset = data.validate(data_path, **read, on_sample=resume)
    for message in dataset.skip_examples:
        log(f"skipped: {message}")
    meta = StoreMeta(
        format_version=FORMAT_VERSION, model=identity, layers=layers, layer_meaning=LAYER_MEANING,
        dtype=Engine.dtype_of(vllm_config), hidden_size=identity.hidden_size,
        corecap_version=__version__, vllm_version=version, codec=cfg.codec,
    )
    Store.create_or_open(cfg.store, meta).close()
    log(
        f"{data_path}: {dataset.outcomes()}; {dataset.num_tokens} tokens; "
        f"{resume.total - resume.todo} already in {cfg.store}; layers {list(layers)}"
    )
    return _Plan(
        cfg, model_dir, data_path, read, committed, dataset, resume.todo, vllm_config, layers, identity, devices,
        settings, stop_rule, resume.total, sink_bytes,
    )


def _generation(cfg: RunConfig, vllm_config, tokenizer) -> tuple[dict | None, StopRule | None, str]:
    """With --max-tokens: the sampling settings in effect (checked by vLLM), when a response
    ends, and the run's first line's part that says both."""
    from corecap._vllm import sampling

    options = cfg.sampling
    if not options.generate:
        return None, None, ""
    settings, source = sampling.effective_sampling(options, vllm_config)
    sampling.check_sampling(settings, options)
    eos = frozenset() if options.ignore_eos else sampling.eos_token_ids(vllm_config, tokenizer)
    if options.stop and tokenizer is None:
        raise CorecapError("--stop needs the model's tokenizer to read the responses, and the model directory has none")
    decode = None if tokenizer is None else (lambda ids: tokenizer.decode(ids, skip_special_tokens=False))
    return settings, StopRule(eos, options.stop, decode), "; " + sampling.describe(options, settings, source, eos)


def _conversations(plan: _Plan) -> Conversations:
    """--rewrite-turns all: where each conversation's later answers come from."""
    from corecap.data.chat import ChatRenderer

    tokenizer, cfg = plan.read["tokenizer"], plan.cfg
    renderer = (ChatRenderer(tokenizer, plan.data_path, "messages", plan.read["template_kwargs"])
                if plan.read["all_turns"] else None)

    def stored_answer(key: str) -> str:
        with Store.open(cfg.store) as store:
            sample = store.get(key)
        return tokenizer.decode(sample.input_ids[sample.header.generation.num_prompt :].tolist(),
                                skip_special_tokens=True)

    return Conversations(
        renderer, lambda ids: tokenizer.decode(ids, skip_special_tokens=True), cfg.sampling.max_tokens,
        plan.read["max_len"], cfg.overflow, plan.committed, stored_answer,
    )


class _Capture:
    """The engine, the sink and the shared-memory record of one run, and the step loop."""

    def __init__(self, plan: _Plan, log, stop: Stop, terminal):
        self.plan, self.cfg, self.log, self.stop, self.terminal = plan, plan.cfg, log, stop, terminal
        self.steps: list | None = [] if self.cfg.trace else None
        self.workers: list[dict] = []
        self.start = self.end = time.time()
        self.engine = None
        self.responses = Responses()
        self.budget = ResponseBudget(plan.buffer_bytes, _token_bytes(plan))
        self.conversations = _conversations(plan)
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
        sink = Sink(cfg.store, cfg.codec, cfg.nonfinite, sink_encode_threads(cfg), self.plan.buffer_bytes, tcp, block_size)
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
                write_trace(cfg.store, self.start, self.end, self.steps, result.chunks, result.commits,
                            result.encodes, result.writes, self.workers)

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
        self.engine = Replicas(cfg.engine, plan.model_dir, capture, plan.devices, first)
        record.stop_watching()
        sink.watch(on_death=self.engine.interrupt)
        self.log(f"states to the store: shared-memory ring {self.engine.ring_status()}")
        network = f"off: the engine spans {self.cluster[0]} nodes" if self.cluster else self.engine.network_status()
        self.log(f"vLLM's workers in a private network namespace: {network}")
        self.log(f"capturing {plan.todo} samples")
        self.start = time.time()
        progress = Progress(plan.todo, cfg.progress, self.terminal)
        self._loop(sink, progress)
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
        samples = (s for s in data.read_samples(plan.data_path, **plan.read) if s.points or s.key not in plan.committed)
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
                    request = (req_id, turn.key, turn.token_ids, None, turn.max_tokens)
                else:
                    sample = next(samples, None)
                    if sample is None:
                        exhausted = True
                        continue
                    if sample.points:  # every turn rewritten: its answers come through `turns`
                        turns.start(sample)
                        continue
                    request = (str(sample.line), sample.key, sample.token_ids, sample.loss_mask, sample.max_tokens)
                req_id, key, ids, mask, max_tokens = request
                response = None
                if max_tokens:
                    if not self.budget.fits(len(ids) + max_tokens):
                        waiting = request
                        self.budget.num_waits += 1
                        break
                    self.budget.reserve(req_id, len(ids) + max_tokens)
                    response = Response(len(ids), max_tokens, plan.stop_rule, request_seed(self.cfg.engine.seed, key))
                block_hashes = engine.add(req_id, ids.tolist(), response, plan.sampling)  # scheduled only in step()
                sink.expect(req_id, key, ids, mask, block_hashes, max_tokens)
                added += len(ids) + max_tokens
            if engine.num_unfinished == 0:
                return
            timing = engine.step()
            sink.prefix(engine.take_prefix_actions())  # before any response: a block hash first, then the sample whole
            for req_id, response in engine.take_responses():
                sink.generated(req_id, response.token_ids, self.responses.record(response, plan.sampling))
                self.budget.release(req_id)
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

    def _join_nodes(self) -> None:
        """Wait for every other node's `corecap worker`, each checked against this node's
        versions and model, and given this run's engine options (before any weights load)."""
        from corecap._vllm import nodes, vllm_version

        nnodes, address, port = self.cluster
        identity = self.plan.identity
        plan = nodes.Plan(msgspec.to_builtins(self.cfg.engine), identity.path, identity.config_hash,
                          identity.weights_fingerprint, list(self.plan.layers))
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
        result = sink.abort()  # whatever went wrong, keep every complete sample
        if isinstance(e, (KeyboardInterrupt, Interrupted)):
            kept = result.num_committed if result is not None else "an unknown number of"
            return Interrupted(
                f"interrupted: kept {kept} complete samples committed to {self.cfg.store} this run; "
                "rerun the same command to resume"
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


def _token_bytes(plan: _Plan) -> int:
    """A token's bytes in the sink's buffers: a row of each layer (fp8: its codes and scale)."""
    from corecap._vllm import Engine
    from corecap.store.codec import DTYPES
    from corecap.store.fp8rows import ROW_EXTRA

    hidden = plan.identity.hidden_size
    row = hidden + ROW_EXTRA if plan.cfg.codec == FP8 else hidden * DTYPES[Engine.dtype_of(plan.vllm_config)].itemsize
    return len(plan.layers) * row


def sink_encode_threads(cfg: RunConfig) -> int:
    """The sink's encode threads for the run's codec: fp8's at most FP8_ENCODE_THREADS."""
    return min(cfg.encode_threads, FP8_ENCODE_THREADS) if cfg.codec == FP8 else cfg.encode_threads
