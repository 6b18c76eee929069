"""`corecap serve --store` without an engine (tests/test_serve.py reads a live server's store
back): the sink's copy of each delivered sample (each key once, a full disk ends the copy and
gives back all it held, never the server), the keys requests name, the store's last request
name, what the server logs of it, and the refusals that come before any model loads (a store
another process writes, a store of other layers, the store as --hidden-states-path)."""

from __future__ import annotations

import errno
import os
import socket
import time

import numpy as np
import pytest
import torch

from corecap.errors import CorecapError
from corecap.serve import specforge
from corecap.serve.config import ServeConfig
from corecap.serve.requests import BadRequest, completion
from corecap.serve.store_copy import StoreReport, last_number
from corecap.sink.buffers import BufferPool
from corecap.sink.messages import Kept
from corecap.sink.store_copy import StoreCopy
from corecap.store import FORMAT_VERSION, LAYER_MEANING, ModelIdentity, Store, StoreMeta
from corecap.store.generated import Generation
from support.cli import corecap

LAYERS = (2, 4, "prenorm")
HIDDEN = 16
LIVENESS = 60  # seconds: fails a hang, not a slow machine


def _meta(layers=LAYERS, model: ModelIdentity | None = None) -> StoreMeta:
    model = model or ModelIdentity(path="/m", architecture="LlamaForCausalLM", config_hash="c" * 32,
                                   weights_fingerprint="w" * 32, num_layers=8, hidden_size=HIDDEN, vocab_size=100)
    return StoreMeta(format_version=FORMAT_VERSION, model=model, layers=layers, layer_meaning=LAYER_MEANING,
                     dtype="float32", hidden_size=model.hidden_size, corecap_version="0", vllm_version="0",
                     codec="zstd-planes")


class _Pending:
    """What the sink's collector hands on (collect.py's _Pending), as far as the copy reads it."""

    def __init__(self, pool: BufferPool, ids: list[int], generation: Generation | None = None, mask=None):
        self.token_ids = np.asarray(ids, np.int32)
        self.states = pool.take((len(LAYERS), len(ids), HIDDEN), torch.float32)
        self.states.copy_(torch.randn(self.states.shape))
        self.loss_mask = None if mask is None else np.asarray(mask, np.uint8)
        self.generation, self.reserved = generation, 1000 + len(ids)

    def stored_states(self) -> torch.Tensor:
        return self.states


@pytest.fixture
def copy(tmp_path):
    path = str(tmp_path / "store")
    Store.create_or_open(path, _meta()).close()
    pool, released = BufferPool(1 << 22), []
    c = StoreCopy(path, num_threads=2, buffer_bytes=1 << 22, buffers=pool, release=released.append)
    yield c, pool, released, path
    c.close()


def _wait(condition, what: str) -> None:
    deadline = time.monotonic() + LIVENESS
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_each_delivered_sample_is_committed_as_a_run_stores_it_and_its_memory_goes_back(copy):
    c, pool, released, path = copy
    prompt = _Pending(pool, [5, 6, 7])
    answered = _Pending(pool, [5, 6, 7, 9, 9], Generation(num_prompt=3, num_generated=2, finish_reason="length",
                                                           seed=7, sampling={"temperature": 0.0}), [0, 0, 0, 1, 1])
    expected = {"a": prompt.states.clone(), "gen": answered.states.clone()}
    assert c.keep("a", prompt) and c.keep("gen", answered)
    c.close()
    assert sorted(released) == sorted([prompt.reserved, answered.reserved]) and not pool.lent
    kept = c.status()
    assert (kept.num_committed, kept.num_tokens, kept.failure) == (2, 8, "") and c.status() is None
    with Store.open(path) as store:
        assert sorted(store.keys()) == ["a", "gen"]
        a, gen = store.get("a"), store.get("gen")
        assert a.input_ids.tolist() == [5, 6, 7] and a.loss_mask is None and a.header.generation is None
        assert gen.input_ids.tolist() == [5, 6, 7, 9, 9] and gen.loss_mask.tolist() == [0, 0, 0, 1, 1]
        assert gen.header.generation.num_prompt == 3 and gen.header.generation.sampling == {"temperature": 0.0}
        for key, sample in (("a", a), ("gen", gen)):
            assert torch.equal(sample.hidden_states, expected[key]), key  # bit for bit, in its dtype


def test_a_key_is_stored_once_whatever_comes_later_under_it(copy):
    """The first copy stays, as a rerun of `corecap run` keeps a committed key; a later sample
    under the key is delivered, not stored, and counted by whether its input (a response's: its
    prompt) was the same."""
    c, pool, released, path = copy
    first = _Pending(pool, [5, 6, 7])
    expected = first.states.clone()
    assert c.keep("k", first)
    again = _Pending(pool, [5, 6, 7, 8], Generation(num_prompt=3, num_generated=1, finish_reason="length"))
    other = _Pending(pool, [1, 2])
    assert not c.keep("k", again) and not c.keep("k", other)  # the caller gives both back
    _wait(lambda: c.writer.num_committed == 1, "the first sample's commit")
    assert not c.keep("k", _Pending(pool, [9]))  # once committed, too
    kept = c.status()
    assert (kept.num_same, kept.num_other, kept.first_other) == (1, 2, "k")
    c.close()
    with Store.open(path) as store:
        assert list(store.keys()) == ["k"] and torch.equal(store.get("k").hidden_states, expected)
    # a server started again on the store knows its keys
    pool2 = BufferPool(1 << 20)
    c2 = StoreCopy(path, num_threads=1, buffer_bytes=1 << 20, buffers=pool2, release=lambda n: None)
    try:
        assert not c2.keep("k", _Pending(pool2, [5, 6, 7])) and c2.status().num_same == 1
    finally:
        c2.close()


def test_a_full_disk_ends_the_copy_not_the_server_and_gives_back_all_it_held(copy, monkeypatch):
    """The disk fills after a first commit: the samples queued are never written but their buffers
    and reservations go back (else the server would wait for room forever), the copy says why
    once, later samples are not taken, and the store keeps what it had committed, whole."""
    c, pool, released, path = copy
    first = _Pending(pool, [5, 6, 7])
    assert c.keep("first", first)
    _wait(lambda: c.writer.num_committed == 1, "the first sample's commit")

    def no_space(self, records):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Store, "append", no_space)
    queued = [_Pending(pool, list(range(3, 3 + n))) for n in range(1, 6)]
    taken = [c.keep(f"k{i}", p) for i, p in enumerate(queued)]
    _wait(lambda: c.writer.error is not None, "the failed write")
    c.check()
    assert "the disk is full" in c.failure
    later = _Pending(pool, [4, 4])
    assert not c.keep("later", later)
    pool.give(later.states)  # as the sink does with a sample not taken
    for p, was_taken in zip(queued, taken):
        if not was_taken:
            pool.give(p.states)
    assert not pool.lent and pool.held_bytes == 0
    assert sorted(released) == sorted([first.reserved] + [p.reserved for p, t in zip(queued, taken) if t])
    kept = c.status()
    assert kept.num_committed == 1 and "the disk is full" in kept.failure
    monkeypatch.undo()
    c.close()
    with Store.open(path) as store:
        assert list(store.keys()) == ["first"] and store.get("first").input_ids.tolist() == [5, 6, 7]


def test_only_a_sample_delivered_whole_is_stored(tmp_path):
    """The sink's own path (process.py, `_deliver`): a sample whose delivery failed (a 500 for its
    client) is not stored, one delivered is; both give back their buffer and their reservation."""
    import types

    import zmq

    from corecap.sink.deliver import DeliverSpec
    from corecap.sink.process import SinkSpec, _Loop

    path = str(tmp_path / "store")
    Store.create_or_open(path, _meta()).close()
    os.makedirs(tmp_path / "ipc")
    spec = SinkSpec(store=path, ipc_dir=str(tmp_path / "ipc"), codec="raw", nonfinite="stop", num_threads=1,
                    buffer_bytes=1 << 22, parent_pid=os.getpid(), deliver=DeliverSpec(str(tmp_path), (0, 1, 2)),
                    layers=LAYERS)
    ctx = zmq.Context()
    loop = _Loop(ctx, spec)
    try:
        sent = []
        loop.notify = sent.append
        outcomes = {"written": (100, "", False), "failed": (0, "the Mooncake store has no room for 100 bytes", True)}
        loop.deliverer = types.SimpleNamespace(deliver=lambda key, *args: outcomes[key])
        for key in outcomes:
            p = _Pending(loop.buffers, [5, 6])
            p.key = key
            loop.store_keys[key] = f"k-{key}"
            loop._deliver(p)
        loop.deliveries.close()  # the files are written on threads of their own, reported here
        loop.copy.close()
        assert sorted((d.req_id, d.error, d.full) for d in sent) == [
            ("failed", "the Mooncake store has no room for 100 bytes", True), ("written", "", False)]
        assert loop.released.num_samples == 2 and not loop.buffers.lent
        with Store.open(path) as store:
            assert list(store.keys()) == ["k-written"]
        # a server runs for as long as it is needed: nothing kept per chunk, sample or commit
        w = loop.copy.writer
        assert not loop.collector.timed and not (w.encodes or w.writes or w.commits)
    finally:
        loop.control.close(linger=0)
        loop.data.close(linger=0)
        ctx.destroy(linger=0)


def test_the_server_names_requests_on_past_the_store_s_last(tmp_path):
    path = str(tmp_path / "store")
    Store.create_or_open(path, _meta()).close()
    pool = BufferPool(1 << 20)
    c = StoreCopy(path, num_threads=1, buffer_bytes=1 << 20, buffers=pool, release=lambda n: None)
    for key in ("corecap-000000000007", "corecap-000000000012", "corecap-12", "corecap-00000000001x", "zz", "a"):
        assert c.keep(key, _Pending(pool, [5]))
    c.close()
    with Store.open(path) as store:
        assert last_number(store) == 12
    Store.create_or_open(str(tmp_path / "empty"), _meta()).close()
    with Store.open(str(tmp_path / "empty")) as store:
        assert last_number(store) == 0


def test_the_key_is_the_clients_name_where_it_gives_one():
    request = completion({"prompt": [1, 2], "request_id": "epoch1/row-7"}, "m", None, 100, 50)
    assert request.request_id == "epoch1/row-7"
    assert completion({"prompt": [1, 2]}, "m", None, 100, 50).request_id is None
    for bad in ("", "x" * 512, 5, "\ud800"):
        with pytest.raises(BadRequest) as refused:
            completion({"prompt": [1, 2], "request_id": bad}, "m", None, 100, 50)
        assert refused.value.field == "request_id"
    capture = {"store_id": "run1", "sample_id": "run1:t0", "gen": 2,
               "passthrough": [{"name": "loss_mask", "data": [0, 1, 1], "shape": [1, 3], "dtype": "int64"}]}
    [task] = specforge.tasks({"input_ids": [[5, 6, 7]], "spec_capture": [capture]}, "m", 100, 50)
    assert task.request.request_id == "run1/run1:t0/g2" and task.capture.prefix == "run1/run1:t0/g2/"
    assert task.request.loss_mask.tolist() == [0, 1, 1]  # SpecForge's own mask, kept in the store
    with pytest.raises(BadRequest) as refused:
        specforge.tasks({"input_ids": [[5]], "spec_capture": [dict(capture, sample_id="s" * 600)]}, "m", 100, 50)
    assert refused.value.field == "spec_capture[0].sample_id"


def test_the_log_says_each_event_of_the_copy_once():
    lines = []
    metrics = type("M", (), {})()
    report = StoreReport("/s", metrics, lines.append)
    assert metrics.kept.num_committed == 0
    report.update(Kept(num_committed=3, num_tokens=30, nbytes=300))
    report.update(Kept(num_committed=4, num_tokens=40, nbytes=400, num_other=1, first_other="k"))
    report.update(Kept(num_committed=4, num_tokens=40, nbytes=400, num_other=2, first_other="k",
                       failure="/s: writing the store failed: the disk is full (0 MiB free; ...)"))
    report.update(Kept(num_committed=4, num_tokens=40, nbytes=400, num_other=3, first_other="k", failure="x"))
    assert len(lines) == 2 and "'k' was stored already with another input" in lines[0]
    assert "no more samples are stored" in lines[1] and "serving goes on, 4 samples committed" in lines[1]
    assert metrics.kept.num_other == 3
    assert report.line().startswith("--store /s: 4 samples committed (40 tokens") and "3 not stored again" in \
        report.line()


def test_the_store_must_not_be_the_hidden_states_path(tmp_path):
    for store in (str(tmp_path), str(tmp_path) + "/", ""):
        with pytest.raises(CorecapError, match="--store"):
            ServeConfig(hidden_states_path=str(tmp_path), store=store)
    ServeConfig(hidden_states_path=str(tmp_path / "h"), store=str(tmp_path / "s"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_store_another_process_writes_is_refused_in_one_line_at_once(tmp_path):
    """Its writer lock is the server's first step (after its port): refused before the model is
    looked at, naming the process that writes the store."""
    import subprocess
    import sys

    from corecap.serve import serve

    path = tmp_path / "store"
    path.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from corecap import writer_lock; "
                               "writer_lock.take(sys.argv[1]); print('held', flush=True); time.sleep(120)", str(path)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        said = []
        with pytest.raises(CorecapError) as refused:
            serve(ServeConfig(store=str(path), port=_free_port(), hidden_states_path=str(tmp_path / "h")),
                  log=said.append)
    finally:
        holder.kill()
        holder.wait()
    message = str(refused.value)
    assert message.startswith(f"{path}: another process (pid {holder.pid}) is writing this store: ") and \
        "\n" not in message
    assert not said and not os.path.exists(path / "data.mdb")


@pytest.mark.full  # vLLM's configuration is built (no weights): ~15 s on 2 cores
def test_a_store_of_other_layers_is_refused_before_the_model_loads(tiny_model, tmp_path):
    """As `corecap run` refuses to resume a store of another configuration (StoreMeta.check_compatible:
    the layers, dtype, hidden size, model), the store left as it was."""
    from corecap.model import model_identity

    path = str(tmp_path / "store")
    Store.create_or_open(path, _meta(layers=(2, 4, "prenorm"), model=model_identity(tiny_model, "auto"))).close()
    before = os.path.getmtime(os.path.join(path, "data.mdb"))
    result = corecap("serve", "--model", tiny_model, "--dtype", "float32", "--layers", "2,4,6,prenorm", "--store",
                     path, "--port", str(_free_port()), "--hidden-states-path", str(tmp_path / "h"), cwd=tmp_path,
                     check=False)
    last = result.stderr.strip().splitlines()[-1]
    assert result.returncode == 2 and last.startswith(f"corecap: error: {path}: store has layers="), result.stderr
    assert "this run has (2, 4, 6, 'prenorm')" in last and "engine starting" not in result.stderr
    assert os.path.getmtime(os.path.join(path, "data.mdb")) == before

