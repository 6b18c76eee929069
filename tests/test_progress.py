"""corecap/progress.py: the heartbeat that keeps a long engine start from going silent."""

from __future__ import annotations

import re
import threading
import time

from corecap.progress import Heartbeat


def test_heartbeat_says_each_phase_and_the_time_between():
    lines: list[str] = []
    lock = threading.Lock()

    def log(line: str) -> None:
        with lock:
            lines.append(line)

    def taken() -> list[str]:
        with lock:
            out = lines[:]
            lines.clear()
            return out

    with Heartbeat("engine starting", log, interval=0.3) as beat:
        time.sleep(0.5)  # silent past an interval, before any phase: the time alone
        before = taken()
        beat.phase("loading the weights")
        (line,) = taken()
        assert re.fullmatch(r"engine starting: loading the weights \(\d+ s\)", line), line
        time.sleep(0.8)
        during = taken()
    assert before and all(re.fullmatch(r"engine starting: \d+ s", line) for line in before), before
    assert during and all(re.fullmatch(r"engine starting: \d+ s, loading the weights", line) for line in during)
    assert len(during) <= 3  # one an interval, not one a poll
    time.sleep(0.5)
    assert taken() == []  # nothing once the start is over
