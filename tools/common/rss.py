"""Peak RSS of the processes a run spreads over (driver, sink, workers), sampled on a thread: the
kernel keeps only each process's own peak, lost when it exits. RSS counts the shared-memory
ring's pages each process has touched."""

from __future__ import annotations

import multiprocessing
import threading
from collections.abc import Callable, Iterable


def process_tree(pid: int) -> Callable[[], Iterable[tuple[str, int]]]:
    """The process `pid` and all below it, each named by pid, name and the start of its command line."""
    import psutil

    root = psutil.Process(pid)

    def processes():
        out = []
        for p in [root, *root.children(recursive=True)]:
            try:
                out.append((f"{p.pid} {p.name()}: {' '.join(p.cmdline()).strip()[:120]}", p.pid))
            except psutil.Error:
                continue
        return out
    return processes


def children_by_role() -> Iterable[tuple[str, int]]:
    """This process's multiprocessing children: the sink (it holds the states cache) and the workers."""
    children = multiprocessing.active_children()
    return [("corecap-sink" if c.name == "corecap-sink" else "worker", c.pid) for c in children]


class RssPeaks:
    """`with RssPeaks(processes, interval) as peaks:` ... `peaks.mib` maps each name that
    `processes()` gave to the largest RSS seen under it, in MiB; `peaks.anon_mib` to the largest
    of its RssAnon (Linux: private anonymous pages, what the process allocated itself, without the
    shared libraries' and shared memory's pages that RSS counts too; absent elsewhere), and
    `peaks.shmem_mib` to the largest of its RssShmem (the shared-memory pages it touched: the ring's)."""

    def __init__(self, processes: Callable[[], Iterable[tuple[str, int]]], interval: float = 0.2):
        self.processes, self.interval = processes, interval
        self.mib: dict[str, float] = {}
        self.anon_mib: dict[str, float] = {}
        self.shmem_mib: dict[str, float] = {}
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self) -> RssPeaks:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()

    def _watch(self) -> None:
        import psutil

        while not self._done.is_set():
            try:
                procs = list(self.processes())
            except psutil.Error:
                break
            for name, pid in procs:
                try:
                    mib = psutil.Process(pid).memory_info().rss / 2**20
                except psutil.Error:
                    continue
                self.mib[name] = max(self.mib.get(name, 0.0), mib)
                for field, peaks in (("RssAnon", self.anon_mib), ("RssShmem", self.shmem_mib)):
                    value = status_mib(pid, field)
                    if value is not None:
                        peaks[name] = max(peaks.get(name, 0.0), value)
            self._done.wait(self.interval)

    def largest_gb(self, n: int) -> list[tuple[float, str]]:
        """The n largest peaks, in GB, largest first."""
        return sorted(((round(mib / 1024, 2), name) for name, mib in self.mib.items()), reverse=True)[:n]


def status_mib(pid: int, field: str) -> float | None:
    """A field of /proc/PID/status (RssAnon, RssShmem, ...) in MiB (None where there is none)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(f"{field}:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None
