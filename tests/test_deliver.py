"""`corecap serve`'s sink writes each sample's file on threads of its own (corecap/sink/deliver.py
`Deliveries`) and hears of each write back on its own thread; a Mooncake store without room says
so apart from other failures. No engine here (the files themselves, read by each trainer's reader,
are tests/test_serve.py's)."""

from __future__ import annotations

import select
import threading

import numpy as np
import pytest
import torch

from corecap.sink.deliver import Deliverer, Deliveries, DeliverSpec
from support.machine import in_ci


def test_files_are_written_side_by_side_and_reported_on_the_sinks_thread():
    deliveries = Deliveries(2)
    both = threading.Barrier(2, timeout=10)  # broken (an error) unless two writes run at once
    writers, reported = set(), []

    def write(name: str):
        def run() -> tuple[int, str]:
            writers.add(threading.get_ident())
            both.wait()
            return len(name), ""
        return run

    def then(nbytes: int, error: str) -> None:
        reported.append((nbytes, error, threading.get_ident()))

    deliveries.submit(write("a"), then)
    deliveries.submit(write("bb"), then)
    assert deliveries.num_running == 2
    deliveries.close()
    assert sorted(r[:2] for r in reported) == [(1, ""), (2, "")]
    assert {r[2] for r in reported} == {threading.get_ident()}
    assert threading.get_ident() not in writers and len(writers) == 2
    assert deliveries.num_running == 0


def test_a_write_that_raises_is_raised_on_the_sinks_thread():
    deliveries = Deliveries(1)

    def write() -> tuple[int, str]:
        raise ValueError("bad states")

    deliveries.submit(write, lambda nbytes, error: pytest.fail("reported as written"))
    with pytest.raises(ValueError, match="bad states"):
        deliveries.close()


def test_a_write_done_wakes_the_sinks_poller_at_once():
    """The sink's loop waits on its poller with a long timeout; a write done makes the pipe it
    watches readable then, not at the next timeout, and `finished()` empties it again. No timing is
    asserted: only when the pipe is readable (select's 10 s is a bound for a hung write)."""
    deliveries = Deliveries(1)
    go, reported = threading.Event(), []
    deliveries.submit(lambda: (go.wait(10), (3, ""))[1], lambda nbytes, error: reported.append(nbytes))
    assert select.select([deliveries], [], [], 0)[0] == []  # still writing: nothing to wake for
    go.set()
    assert select.select([deliveries], [], [], 10)[0] == [deliveries]
    deliveries.finished()
    assert reported == [3] and deliveries.num_running == 0
    assert select.select([deliveries], [], [], 0)[0] == []  # reported: nothing left to wake for
    deliveries.close()


def test_a_full_mooncake_store_is_told_apart_and_leaves_nothing_behind(tmp_path):
    """A store of 16 MiB (a `mooncake_master` started here): samples of 1.2 MB go in until one
    finds no room, which the deliverer reports as the store being full (the server answers it 503,
    with Retry-After) and leaves no object, not even an error marker, under its handle. None put
    before is evicted for it (hard-pinned: a reader may still be waiting for each). Once the trainer
    takes one (as speculators' reader removes it), or the server discards one whose client went
    away, the next goes in."""
    try:
        from corecap.sink.mooncake import ERROR_SUFFIX, MooncakeOptions
        from mooncake.store import MooncakeDistributedStore  # noqa: F401
    except ImportError as e:
        message = f"Mooncake ({e}): pip install --no-deps mooncake-transfer-engine-non-cuda==0.3.13.post1"
        if in_ci():
            pytest.fail(f"{message} (CI=true: mandatory)", pytrace=False)
        pytest.skip(message)
    from support.server import MooncakeMaster

    master = MooncakeMaster(str(tmp_path / "master.log"))
    try:
        options = MooncakeOptions(master=master.address, global_segment_bytes=16 << 20, local_buffer_bytes=32 << 20)
        deliverer = Deliverer(DeliverSpec(str(tmp_path), positions=(0, 1, 2, 3), mooncake=options))
        states = torch.randn(4, 300, 256)  # [L, T, H] float32: 1.2 MB a sample
        outcomes = [deliverer.deliver(f"s{i}", np.arange(300), states) for i in range(20)]
        first_full = next(i for i, (_, error, _) in enumerate(outcomes) if error)
        assert 0 < first_full < 20 and all(n == outcomes[0][0] > 300 * 4 * 256 * 4 for n, _, _ in outcomes[:first_full])
        nbytes, error, full = outcomes[first_full]
        assert nbytes == 0 and full and error.startswith("the Mooncake store has no room for "), error
        store = deliverer.mooncake.store
        assert [store.is_exist(f"s{i}") for i in range(first_full)] == [1] * first_full  # none evicted
        assert store.is_exist(f"s{first_full}") != 1 and store.is_exist(f"s{first_full}{ERROR_SUFFIX}") != 1
        assert deliverer.deliver("again", np.arange(300), states)[2]  # still full
        store.remove("s0", force=True)  # the trainer takes one, as hs_connectors' reader does
        assert deliverer.deliver("again", np.arange(300), states)[1:] == ("", False)
        assert deliverer.deliver("more", np.arange(300), states)[2]
        deliverer.discard(["s1"])  # a client that went away
        assert store.is_exist("s1") != 1
        assert deliverer.deliver("more", np.arange(300), states)[1:] == ("", False)
        del deliverer, store
    finally:
        master.stop()
