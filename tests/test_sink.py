"""The driver's handle on the sink process: a sink that is gone is an error, never a hang."""

from __future__ import annotations

import os
import signal
import threading

import numpy as np
import pytest

from corecap.errors import CorecapError
from corecap.sink import Sink
from corecap.store import FORMAT_VERSION, LAYER_MEANING, ModelIdentity, Store, StoreMeta

LIVENESS = 60  # seconds: fails a hang, not a slow machine


@pytest.fixture
def sink(tmp_path):
    path = str(tmp_path / "store")
    meta = StoreMeta(format_version=FORMAT_VERSION, model=ModelIdentity(
        path="/m", architecture="L", config_hash="c", weights_fingerprint="w", num_layers=8, hidden_size=16,
        vocab_size=100,
    ), layers=(2,), layer_meaning=LAYER_MEANING, dtype="float32", hidden_size=16, corecap_version="0", vllm_version="0")
    Store.create_or_open(path, meta).close()
    s = Sink(path, "raw", "stop", 1, 1 << 20)
    yield s
    s.abort()  # a run's end: otherwise close() waits out its 30 s join for a sink that serves on
    s.close()


def test_sending_to_a_dead_sink_raises_instead_of_blocking(sink):
    """A ZeroMQ PUSH socket without a peer blocks forever inside C, where the watchdog's
    interrupt cannot reach: seen as a run that hung when a full disk stopped the sink."""
    os.kill(sink.proc.pid, signal.SIGKILL)
    sink.proc.join(LIVENESS)
    outcome: list = []

    def feed() -> None:
        try:
            for i in range(2000):  # past ZeroMQ's default high-water mark of 1000
                sink.expect(str(i), f"k{i}", np.arange(3), None)
            outcome.append("all sent")
        except CorecapError as e:
            outcome.append(e)

    t = threading.Thread(target=feed, daemon=True)
    t.start()
    t.join(LIVENESS)
    assert not t.is_alive(), "expect() blocked on a dead sink"
    assert isinstance(outcome[0], CorecapError) and "died (exit code -9)" in str(outcome[0])
    assert sink.abort() is None  # nothing to abort, and no hang either


def test_the_sink_holds_the_writer_lock_from_its_start(sink, tmp_path):
    """A second run on a store being written is refused at its start (Store.create_or_open),
    before it loads a model, not at the first run's first commit (when both have run engines)."""
    import time

    store = str(tmp_path / "store")
    meta = StoreMeta(format_version=FORMAT_VERSION, model=ModelIdentity(
        path="/m", architecture="L", config_hash="c", weights_fingerprint="w", num_layers=8, hidden_size=16,
        vocab_size=100,
    ), layers=(2,), layer_meaning=LAYER_MEANING, dtype="float32", hidden_size=16, corecap_version="0", vllm_version="0")
    deadline = time.monotonic() + LIVENESS
    while time.monotonic() < deadline:
        try:
            Store.create_or_open(store, meta).close()
        except CorecapError as e:
            assert f"another process (pid {sink.proc.pid}) is writing this store" in str(e)
            return
        time.sleep(0.05)
    pytest.fail("the sink did not take the store's writer lock")
