"""`corecap run`: validate the input, open the store, start the engine, capture, commit.

The step loop keeps the engine fed (about twice --batch requests queued), steps it, and leaves
the data path to two threads: the collector (ZeroMQ → reassembled samples) and the writer
(samples → durable LMDB commits). Keys already in the store are skipped (after checking that
their inputs did not change), so rerunning after any interruption completes the store.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass

from corecap import CorecapError, __version__, data, demo
from corecap.collect import Collector
from corecap.config import RunConfig, resolve_layers
from corecap.model import load_tokenizer, model_identity
from corecap.store import FORMAT_VERSION, LAYER_MEANING, Store, StoreMeta, input_fingerprint
from corecap.writer import Writer

TRACE_FILE = "trace.json"


@dataclass(frozen=True)
class RunSummary:
    store: str
    num_samples: int
    num_committed: int
    num_skipped: int
    num_tokens: int
    nbytes: int
    seconds: float

    def line(self) -> str:
        rate = self.num_tokens / self.seconds if self.seconds else 0.0
        per_token = self.nbytes / self.num_tokens if self.num_tokens else 0
        return (
            f"{self.store}: committed {self.num_committed} samples ({self.num_tokens} tokens), "
            f"skipped {self.num_skipped} already stored, {self.nbytes / 1e6:.1f} MB "
            f"({per_token:.0f} B/token) in {self.seconds:.1f}s ({rate:.0f} tokens/s)"
        )


def run(cfg: RunConfig, log=print) -> RunSummary:
    from corecap._vllm import Engine, EngineSpec, vllm_version

    model_dir = cfg.model or demo.demo_model_dir()
    data_path = cfg.data or demo.demo_data_path()
    identity = model_identity(model_dir, cfg.load_format)
    layers = resolve_layers(cfg.layers, identity.num_layers)
    tokenizer = load_tokenizer(model_dir)
    read = dict(tokenizer=tokenizer, vocab_size=identity.vocab_size, max_len=cfg.max_len)
    dataset = data.validate(data_path, **read)

    collector = None
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
    )
    store = Store.create_or_open(cfg.store, meta)
    engine = writer = None
    try:
        committed = store.fingerprints()
        todo = _check_resume(data_path, read, committed)
        log(
            f"{data_path}: {dataset.num_samples} samples, {dataset.num_tokens} tokens; "
            f"{dataset.num_samples - todo} already in {cfg.store}; layers {list(layers)}"
        )
        if todo == 0:
            return RunSummary(cfg.store, dataset.num_samples, 0, dataset.num_samples, 0, 0, 0.0)
        writer = Writer(store)
        collector = Collector(layers, writer.put)
        engine = Engine(EngineSpec(ipc_path=collector.ipc_path, **spec_args), vllm_config)
        start = time.time()
        steps: list = []
        try:
            _capture(engine, collector, writer, data_path, read, committed, cfg, steps)
            collector.wait_idle(cfg.stall_timeout, engine.problem)
            writer.close()
        finally:
            write_trace(cfg.store, start, steps, collector.timings, writer.commits)
        seconds = time.time() - start
        return RunSummary(
            cfg.store, dataset.num_samples, writer.num_committed, dataset.num_samples - todo,
            writer.num_tokens, writer.nbytes, seconds,
        )
    finally:
        if engine is not None:
            engine.shutdown()
        if collector is not None:
            collector.close()
        if writer is not None and writer.thread.is_alive():
            writer.close()
        store.close()


def _check_resume(data_path: str, read: dict, committed: dict[str, str]) -> int:
    """Count samples still to do; a stored key whose input changed is an error."""
    todo = 0
    for sample in data.read_samples(data_path, **read):
        stored = committed.get(sample.key)
        if stored is None:
            todo += 1
        elif stored != input_fingerprint(sample.token_ids):
            raise CorecapError(
                f"{data_path}:{sample.line}: sample {sample.key!r} is already stored with input "
                f"fingerprint {stored}, but its input now has {input_fingerprint(sample.token_ids)}"
            )
    return todo


def write_trace(store_path: str, start: float, steps, chunks, commits) -> None:
    """The run's timeline, next to the data: <store>/trace.json (read by `corecap trace`)."""
    import msgspec

    record = {
        "version": 1,
        "start": start,
        "end": time.time(),
        "steps": [dataclasses.asdict(s) for s in steps],
        "chunks": [dataclasses.asdict(c) for c in chunks],
        "commits": [dataclasses.asdict(c) for c in commits],
    }
    tmp = os.path.join(store_path, "trace.json.tmp")
    with open(tmp, "wb") as f:
        f.write(msgspec.json.encode(record))
    os.replace(tmp, os.path.join(store_path, TRACE_FILE))


def _capture(engine, collector: Collector, writer: Writer, data_path: str, read: dict, committed, cfg, steps: list) -> None:
    samples = (s for s in data.read_samples(data_path, **read) if s.key not in committed)
    queued = 2 * cfg.batch  # keep the scheduler fed without holding the whole dataset
    last_progress = time.monotonic()
    exhausted = False
    while True:
        while not exhausted and engine.num_unfinished < queued:
            sample = next(samples, None)
            if sample is None:
                exhausted = True
                break
            req_id = str(sample.line)
            collector.expect(req_id, sample.key, sample.token_ids)
            engine.add(req_id, sample.token_ids.tolist())
        if engine.num_unfinished == 0:
            return
        timing = engine.step()
        steps.append(timing)
        collector.raise_if_failed()
        writer.raise_if_failed()
        if timing.num_tokens:
            last_progress = time.monotonic()
        elif time.monotonic() - last_progress > cfg.stall_timeout:
            raise CorecapError(f"no progress for {cfg.stall_timeout:.0f}s: the engine schedules nothing")
