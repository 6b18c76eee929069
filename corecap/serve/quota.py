"""The bound on states written and not yet taken: each file stays under --hidden-states-path
until its reader removes it (speculators' loader deletes what it read), so a trainer that stops
reading must not let the server fill the disk. Over the quota, new requests are answered 503."""

from __future__ import annotations

import glob
import os
import threading
import time

from corecap.sink.deliver import PARTIAL

_RECOUNT_S = 0.5  # how often the files still there are counted again, at most


class Quota:
    def __init__(self, directory: str, limit_bytes: int):
        self.directory = directory
        self.limit_bytes = limit_bytes
        self.files: dict[str, int] = {}  # written by this server, maybe still there → bytes
        self.used_bytes = 0
        self.counted = 0.0
        self.lock = threading.Lock()

    def add(self, name: str, nbytes: int) -> None:
        with self.lock:
            self.files[name] = nbytes
            self.used_bytes += nbytes

    def fits(self) -> bool:
        """Room for more: the files not yet taken are under the limit (recounted at most every
        half second: the readers remove them without telling the server)."""
        with self.lock:
            if self.used_bytes >= self.limit_bytes and time.monotonic() - self.counted > _RECOUNT_S:
                self.files = {n: b for n, b in self.files.items() if os.path.exists(os.path.join(self.directory, n))}
                self.used_bytes = sum(self.files.values())
                self.counted = time.monotonic()
            return self.used_bytes < self.limit_bytes

    def line(self) -> str:
        return (f"{self.used_bytes / 2**20:,.0f} MiB of states not yet taken, the quota is "
                f"{self.limit_bytes / 2**20:,.0f} MiB (--hidden-states-quota-gb)")

    def remove(self, name: str) -> None:
        """A file nobody will read (its client went away)."""
        for path in (os.path.join(self.directory, name), os.path.join(self.directory, name + ".lock")):
            try:
                os.remove(path)
            except FileNotFoundError:
                pass
        with self.lock:
            self.used_bytes -= self.files.pop(name, 0)

    def remove_partial(self) -> None:
        """What a shutdown left half-written (none of it was handed to a client)."""
        for path in glob.glob(os.path.join(glob.escape(self.directory), "corecap-*" + PARTIAL)):
            os.remove(path)
