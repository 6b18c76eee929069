"""This process's read-only LMDB environments, one a store, shared by every `Store.open` of it."""

from __future__ import annotations

import contextlib
import os
import threading

import lmdb


class Readers:
    """This process's read-only LMDB environments, one a store, shared by every `Store.open` of
    it until the last closes: LMDB's locks are per process, so py-lmdb refuses a second open of
    one environment in a process, and a `Store` held open would otherwise keep a StoreDataset
    (which opens the store for each item) or a second `Store.open` from reading it. A forked
    child never uses its parent's environments (LMDB forbids it): it starts with none."""

    def __init__(self):
        self.lock = threading.Lock()
        self.pid = os.getpid()
        self.envs: dict[str, list] = {}  # realpath → [env, opens]

    def open(self, path: str, open_env) -> lmdb.Environment:
        key = os.path.realpath(path)
        with self.lock:
            if self.pid != os.getpid():
                self.pid, self.envs = os.getpid(), {}
            if key in self.envs:
                entry = self.envs[key]
                _grow_map(entry[0], path)
                entry[1] += 1
                return entry[0]
            env = open_env()
            self.envs[key] = [env, 1]
            return env

    def close(self, path: str, env: lmdb.Environment) -> None:
        key = os.path.realpath(path)
        with self.lock:
            entry = self.envs.get(key)
            if entry is None or entry[0] is not env or self.pid != os.getpid():
                env.close()
                return
            entry[1] -= 1
            if entry[1] == 0:
                del self.envs[key]
                env.close()


def _grow_map(env: lmdb.Environment, path: str) -> None:
    """A shared reader's map covers a store a writer has grown since (else its reads fail: MDB_MAP_RESIZED)."""
    size = os.path.getsize(os.path.join(path, "data.mdb"))
    if size > env.info()["map_size"]:
        with contextlib.suppress(lmdb.Error):  # a transaction of another Store is active: the map stays
            env.set_mapsize(2 * size)


readers = Readers()
