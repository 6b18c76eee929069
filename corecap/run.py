"""`corecap run`: validate the input, open the store, start the engine, capture, commit.

The step loop keeps the engine fed (about twice --batch requests queued), steps it, and leaves
the data path to the sink process (corecap/sink.py: ZeroMQ → reassembled samples → encoded,
durable LMDB commits). Keys already in the store are skipped (after checking that
their inputs did not change), so rerunning after any interruption completes the store.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass

from corecap import CorecapError, __version__, data, demo, shm
from corecap.config import RunConfig, resolve_layers
from corecap.model import load_tokenizer, model_identity
from corecap.store import FORMAT_VERSION, LAYER_MEANING, Store, StoreMeta, input_fingerprint
from corecap.sink import Done, Sink
from corecap.trace import TRACE_FILE, TRACE_VERSION, workers_line


@dataclass(frozen=True)
class RunSummary:
    store: str
    num_samples: int
    num_committed: int
    num_skipped: int
    num_tokens: int
    nbytes: int
    seconds: float
    raw_bytes: int = 0  # the states' size before the codec
    outcomes: str = ""  # the dataset's outcome counts (truncated, skipped, ...)

    def line(self) -> str:
        rate = self.num_tokens / self.seconds if self.seconds else 0.0
        per_token = self.nbytes / self.num_tokens if self.num_tokens else 0
        ratio = f", codec ratio {self.raw_bytes / self.nbytes:.2f}x" if self.nbytes and self.raw_bytes else ""
        return (
            f"{self.store}: committed {self.num_committed} samples ({self.num_tokens} tokens), "
            f"skipped {self.num_skipped} already stored, {self.nbytes / 1e6:.1f} MB "
            f"({per_token:.0f} B/token{ratio}) in {self.seconds:.1f}s ({rate:.0f} tokens/s)"
            + (f"; input: {self.outcomes}" if self.outcomes else "")
        )


class Interrupted(CorecapError):
    """Ctrl-C or SIGTERM: the run stopped early after committing every complete sample."""


def run(cfg: RunConfig, log=print) -> RunSummary:
    from corecap._vllm import Engine, EngineSpec, vllm_version

    removed = shm.remove_left_behind()  # a killed run's RAM, before this run needs its own
    if removed.num_files:
        log(removed.line())
    model_dir = cfg.model or demo.demo_model_dir()
    data_path = cfg.data or demo.demo_data_path()
    identity = model_identity(model_dir, cfg.load_format)
    layers = resolve_layers(cfg.layers, identity.num_layers)
    tokenizer = load_tokenizer(model_dir)
    read = dict(
        tokenizer=tokenizer, vocab_size=identity.vocab_size, max_len=cfg.max_len,
        overflow=cfg.overflow, invalid=cfg.invalid, shard=cfg.shard,
    )
    # Keys already committed, read before validating so that the same pass checks their inputs;
    # the store itself is created (and its metadata checked) only once the input is known good.
    committed = _committed_fingerprints(cfg.store)
    resume = _ResumeCheck(committed)
    dataset = data.validate(data_path, **read, on_sample=resume)
    todo = resume.todo
    for message in dataset.skip_examples:
        log(f"skipped: {message}")

    spec_args = dict(
        model=model_dir,
        layers=layers,
        tensor_parallel_size=cfg.tp,
        max_num_seqs=cfg.batch,
        max_model_len=cfg.max_len,
        max_num_batched_tokens=cfg.max_batched_tokens,
        dtype=cfg.dtype,
        load_format=cfg.load_format,
        enforce_eager=cfg.enforce_eager,
        memory_utilization=cfg.memory_utilization,
    )
    vllm_config = Engine.configure(EngineSpec(ipc_path="", **spec_args))
    meta = StoreMeta(
        format_version=FORMAT_VERSION,
        model=identity,
        layers=layers,
        layer_meaning=LAYER_MEANING,
        dtype=Engine.dtype_of(vllm_config),
        hidden_size=identity.hidden_size,
        corecap_version=__version__,
        vllm_version=vllm_version(),
        codec=cfg.codec,
    )
    Store.create_or_open(cfg.store, meta).close()
    log(
        f"{data_path}: {dataset.outcomes()}; {dataset.num_tokens} tokens; "
        f"{dataset.num_samples - todo} already in {cfg.store}; layers {list(layers)}"
    )
    if todo == 0:
        return RunSummary(cfg.store, dataset.num_samples, 0, dataset.num_samples, 0, 0, 0.0, 0, dataset.outcomes())

    engine = None
    workers: list[dict] = []
    sink = Sink(cfg.store, cfg.codec, cfg.nonfinite, cfg.encode_threads, cfg.buffer_bytes)
    steps: list | None = None if os.environ.get("CORECAP_NO_TRACE") else []
    start = end = time.time()
    record = shm.ShmRecord()
    termination = _Termination()
    previous_sigterm = signal.signal(signal.SIGTERM, termination)
    try:
        sink.watch()
        record.watch()
        engine = Engine(EngineSpec(ipc_path=sink.capture_path, **spec_args), vllm_config)
        record.stop_watching()
        log(f"states to the store: shared-memory ring {engine.ring_status()}")
        log(f"vLLM's workers in a private network namespace: {engine.network_status()}")
        log(f"capturing {todo} samples")
        start = time.time()
        progress = Progress(todo, cfg.progress)
        _capture(engine, sink, data_path, read, committed, cfg, steps, progress)
        progress.close()
        workers = engine.worker_stats()
        log(workers_line(workers))
        done = sink.finish(cfg.stall_timeout, engine.problem)
        sink.unwatch()
        end = time.time()
    except (KeyboardInterrupt, Interrupted):
        termination.winding_down = True
        sink.unwatch()
        if sink.died:
            raise CorecapError(f"{sink.failure()} (committed samples are kept; rerun to resume)") from None
        result = sink.abort()
        kept = result.num_committed if result is not None else "an unknown number of"
        raise Interrupted(f"interrupted: kept {kept} complete samples committed to {cfg.store} this run; rerun the same command to resume") from None
    except BaseException as e:
        termination.winding_down = True
        sink.unwatch()
        result = sink.abort()  # whatever went wrong, keep every complete sample
        if not isinstance(e, CorecapError):
            raise
        kept = result.num_committed if result is not None else 0
        raise CorecapError(f"{e} (kept {kept} complete samples committed this run; rerun to resume)") from None
    finally:
        termination.winding_down = True
        if engine is not None:
            engine.shutdown()
        sink.close()
        record.close()
        signal.signal(signal.SIGTERM, previous_sigterm)
        result = sink.result
        if steps is not None and isinstance(result, Done):
            write_trace(cfg.store, start, end, steps, result.chunks, result.commits, result.encodes, result.writes, workers)
    if termination.ignored:
        log("SIGTERM came after the capture had finished: every sample is committed")
    if done.flagged:
        log(f"stored {len(done.flagged)} samples with NaN/Inf, flagged: {done.flagged[:10]}")
    return RunSummary(
        cfg.store, dataset.num_samples, done.num_committed, dataset.num_samples - todo,
        done.num_tokens, done.nbytes, end - start, done.raw_bytes, dataset.outcomes(),
    )


class _Termination:
    """A run's SIGTERM handler. While the run captures, SIGTERM raises Interrupted: the run stops
    and keeps every complete sample. Once it winds down (finished, failed or interrupted), a
    SIGTERM is only counted: raised there, it would cut the cleanup short and leave the engine's
    processes, IPC files and shared memory behind (a SIGTERM during the shutdown used to)."""

    def __init__(self):
        self.winding_down = False
        self.ignored = 0

    def __call__(self, signum, frame):
        if self.winding_down:
            self.ignored += 1
            return
        self.winding_down = True
        raise Interrupted("terminated")


def _committed_fingerprints(store_path: str) -> dict[str, str]:
    """key → input fingerprint of every sample already in the store (empty for a new store)."""
    if not os.path.exists(os.path.join(store_path, "data.mdb")):
        return {}
    with Store.open(store_path) as store:
        return store.fingerprints()


class _ResumeCheck:
    """Counts the samples still to do; a stored key whose input changed is an error."""

    def __init__(self, committed: dict[str, str]):
        self.committed = committed
        self.todo = 0

    def __call__(self, sample) -> None:
        stored = self.committed.get(sample.key)
        if stored is None:
            self.todo += 1
        elif stored != input_fingerprint(sample.token_ids):
            raise CorecapError(
                f"{sample.where}: sample {sample.key!r} is already stored with input "
                f"fingerprint {stored}, but its input now has {input_fingerprint(sample.token_ids)}"
            )


def write_trace(store_path: str, start: float, end: float, steps, chunks, commits, encodes=(), writes=(), workers=()) -> None:
    """The run's timeline, next to the data: <store>/trace.json (read by `corecap trace`)."""
    import msgspec

    record = {
        "version": TRACE_VERSION,
        "start": start,
        "end": end,
        "steps": steps,
        "chunks": chunks,
        "commits": commits,
        "encodes": list(encodes),
        "writes": list(writes),
        "workers": list(workers),
    }
    tmp = os.path.join(store_path, "trace.json.tmp")
    with open(tmp, "wb") as f:
        f.write(msgspec.json.encode(record))
    os.replace(tmp, os.path.join(store_path, TRACE_FILE))


def _capture(engine, sink: Sink, data_path: str, read: dict, committed, cfg, steps: list | None, progress) -> None:
    samples = (s for s in data.read_samples(data_path, **read) if s.key not in committed)
    queued = 2 * cfg.batch  # keep the scheduler fed without holding the whole dataset
    # Reading, announcing and adding requests happens between steps, while the batch in flight
    # runs (Engine._step): a little at a time, enough for the batches the next step schedules,
    # rather than all `queued` before the first step with the GPU idle.
    feed_tokens = (engine.steps_in_flight + 1) * engine.token_budget
    last_progress = time.monotonic()
    exhausted = False
    while True:
        added = 0
        while not exhausted and engine.num_unfinished < queued and added < feed_tokens:
            sample = next(samples, None)
            if sample is None:
                exhausted = True
                break
            req_id = str(sample.line)
            sink.expect(req_id, sample.key, sample.token_ids, sample.loss_mask)
            engine.add(req_id, sample.token_ids.tolist())
            added += len(sample.token_ids)
        if engine.num_unfinished == 0:
            return
        timing = engine.step()
        if steps is not None:
            steps.append(timing)
        progress.update(len(timing.finished), timing.num_tokens)
        sink.check()
        if timing.num_tokens:
            last_progress = time.monotonic()
        elif time.monotonic() - last_progress > cfg.stall_timeout:
            raise CorecapError(f"no progress for {cfg.stall_timeout:.0f}s: the engine schedules nothing")
        problem = engine.problem()
        if problem:
            raise CorecapError(problem)


class Progress:
    """One self-rewriting line on a terminal (samples, tokens, tokens/s, ETA); silent in logs."""

    def __init__(self, num_samples: int, enabled: bool | None):
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self.total = num_samples
        self.samples = self.tokens = 0
        self.start = self.last = time.monotonic()

    def update(self, samples: int, tokens: int) -> None:
        self.samples += samples
        self.tokens += tokens
        now = time.monotonic()
        if self.enabled and now - self.last >= 0.5:
            self.last = now
            rate = self.tokens / (now - self.start)
            left = (now - self.start) / self.samples * (self.total - self.samples) if self.samples else float("nan")
            sys.stderr.write(
                f"\r{self.samples}/{self.total} samples, {self.tokens} tokens, {rate:,.0f} tokens/s, ETA {left:,.0f}s   "
            )
            sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")
