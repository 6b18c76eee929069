"""The ids of aborted requests whose states may still come (`corecap serve`): the sink skips those
states instead of refusing them as an unknown request's (sink/collect.py `forget`), and lets each
id go once none can come any more, so that a server's aborts do not grow the sink for as long as
it runs.

An aborted request's states come only from the engine steps scheduled before its abort: those
in vLLM's batch queue then, and those the capturing worker's sender has not pushed yet (it may be
`MAX_IN_FLIGHT` steps behind the compute thread: corecap/_vllm/sender.py). Neither end sees when
the last of them has reached the sink: the driver hears of a step's end from its output, which the
worker returns before its sender has pushed the step's states, and the workers' pushes and the
driver's messages come on different sockets, in no common order. So an id is kept for a bound far
past those steps: `KEEP_S` seconds and `KEEP_CHUNKS` chunks taken, both counted from when the sink
learnt of the abort. Time alone would let ids go while the sink itself was held up and their
states waited in its socket; chunks alone would let them go while another replica's steps fill
the socket and the aborted request's replica is in a long step. An id let go too early fails the
server (states of an unknown request), one kept too long costs a few bytes: both bounds are
generous."""

from __future__ import annotations

import time
from collections import OrderedDict

KEEP_S = 120.0
KEEP_CHUNKS = 1024  # chunks from every replica's sender, with their queues full many times over


class AbortedIds:
    """Aborted requests' ids, oldest first, each with when the sink learnt of it (the clock's time,
    the chunks taken until then)."""

    def __init__(self, keep_s: float = KEEP_S, keep_chunks: int = KEEP_CHUNKS, clock=time.monotonic):
        self.keep_s = keep_s
        self.keep_chunks = keep_chunks
        self.clock = clock
        self.ids: OrderedDict[str, tuple[float, int]] = OrderedDict()
        self.num_chunks = 0  # chunks taken so far

    def __contains__(self, req_id: str) -> bool:
        return req_id in self.ids

    def __len__(self) -> int:
        return len(self.ids)

    def add(self, req_id: str) -> None:
        self.ids[req_id] = (self.clock(), self.num_chunks)
        self.ids.move_to_end(req_id)

    def chunk_taken(self) -> None:
        """One more chunk taken: the ids past both bounds go."""
        self.num_chunks += 1
        if not self.ids:
            return
        now = self.clock()
        while self.ids:
            since, chunks = next(iter(self.ids.values()))
            if now - since < self.keep_s or self.num_chunks - chunks < self.keep_chunks:
                return
            self.ids.popitem(last=False)
