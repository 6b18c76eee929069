"""`corecap serve`'s sink writes each sample's file on threads of its own (corecap/sink/deliver.py
`Deliveries`) and hears of each write back on its own thread: no engine here (the files
themselves, read by each trainer's reader, are tests/test_serve.py's)."""

from __future__ import annotations

import select
import threading

import pytest

from corecap.sink.deliver import Deliveries


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
