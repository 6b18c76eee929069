"""The store writer: a thread that encodes finished samples and commits them in durable batches.

Each LMDB commit is one fsync'd transaction holding whole samples only, so a kill at any
moment leaves every committed sample intact and no partial one. Batching many samples per
commit (up to `batch_bytes`, or whatever is queued) keeps the disk streaming; the bounded queue
is the backpressure that stops host memory from growing when the disk is the bottleneck.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch

from corecap import CorecapError
from corecap.store import Store, encode_sample

_DONE = object()


@dataclass
class CommitTiming:
    start: float
    end: float
    num_samples: int
    nbytes: int


class Writer:
    def __init__(self, store: Store, batch_bytes: int = 64 << 20, max_queued: int = 16):
        self.store = store
        self.layers = store.meta.layers
        self.batch_bytes = batch_bytes
        self.queue: queue.Queue = queue.Queue(maxsize=max_queued)
        self.error: BaseException | None = None
        self.num_committed = 0
        self.num_tokens = 0
        self.nbytes = 0
        self.commits: list[CommitTiming] = []
        self.thread = threading.Thread(target=self._loop, daemon=True, name="corecap-writer")
        self.thread.start()

    def put(self, key: str, token_ids: np.ndarray, states: torch.Tensor) -> None:
        while True:
            self.raise_if_failed()
            try:
                self.queue.put((key, token_ids, states), timeout=0.1)
                return
            except queue.Full:
                continue

    def raise_if_failed(self) -> None:
        if self.error is not None:
            raise self.error

    def _loop(self) -> None:
        done = False
        try:
            while not done:
                item = self.queue.get()
                records, size, tokens = [], 0, 0
                while True:
                    if item is _DONE:
                        done = True
                        break
                    key, ids, states = item
                    record = encode_sample(key, ids, states, self.layers)
                    records.append(record)
                    size += record.nbytes
                    tokens += len(ids)
                    if size >= self.batch_bytes:
                        break
                    try:
                        item = self.queue.get_nowait()
                    except queue.Empty:
                        break
                if records:
                    start = time.time()
                    nbytes = self.store.put_many(records)
                    self.commits.append(CommitTiming(start, time.time(), len(records), nbytes))
                    self.num_committed += len(records)
                    self.num_tokens += tokens
                    self.nbytes += nbytes
        except BaseException as e:
            self.error = CorecapError(f"{self.store.path}: writing the store failed: {e}")

    def close(self) -> None:
        """Commit everything queued and stop; raises if any commit failed."""
        if self.thread.is_alive():
            while self.thread.is_alive():
                try:
                    self.queue.put(_DONE, timeout=0.1)
                    break
                except queue.Full:
                    continue
            self.thread.join()
        self.raise_if_failed()
