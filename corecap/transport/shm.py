"""Shared memory that a killed run leaves in /dev/shm, recorded by each run and removed by the next.

vLLM's message queues between the driver and its workers are files in /dev/shm: two psm_*
files, hundreds of MiB together even for the tiny CPU model in the tests, more with more workers. A run that
ends by itself, by SIGTERM or with a dead worker has them unlinked on the way out (by vLLM, or by
a dead worker's resource tracker). A run SIGKILLed with its whole process group (a job
scheduler's hard limit, an OOM kill of its cgroup) cannot, and /dev/shm is RAM that stays taken
until reboot: repeated kills in tests/support/kill_loop.py left gigabytes before the harness removed
it (docs/benchmarks.md, "Figures the code cites").

So while its engine starts, a run records every /dev/shm file its processes (the driver and its
descendants) map in /dev/shm/corecap-shm-<pid namespace>-<pid>-<start time>.json, and removes
the record when it ends if those files are gone. Every corecap run, first thing, removes the
files named in the records of runs that are gone (the pid is dead, or now belongs to a process
started later), then the records. Only files a record names are touched, only while each is
still the file that was recorded (the same inode, owned by this user), and only for records made
in this pid namespace: containers that share /dev/shm but not their pids cannot tell whether the
other's runs are alive. Where /dev/shm or /proc is missing, nothing is recorded or removed.
"""

from __future__ import annotations

import json
import os
import stat
import threading
import time
from dataclasses import dataclass

DIRECTORY = "/dev/shm"
PREFIX = "corecap-shm-"
SUFFIX = ".json"


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (field 22 of /proc/PID/stat), or None
    if there is no such process: with the pid, it names one process across pid reuse."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]  # fields after the command start at 3
    except (OSError, IndexError):
        return None


def _pid_namespace() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid").removeprefix("pid:[").removesuffix("]")
    except OSError:
        return None


def _children(pid: int) -> list[int]:
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    out = []
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out.extend(int(c) for c in f.read().split())
        except OSError:  # the thread is gone, or the kernel lacks CONFIG_PROC_CHILDREN
            continue
    return out


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(_children(p))
    return out


def _mapped(pids: list[int], directory: str) -> set[int]:
    """Inodes of the files in `directory` that these processes map. By inode, not name: glibc
    makes a named semaphore (Python's multiprocessing locks, one of them vLLM's) as a temporary
    file, maps it, links it under its name and unlinks the temporary one, so the mapping names a
    deleted file while the semaphore's name stays in /dev/shm."""
    try:
        device = os.stat(directory).st_dev
    except OSError:
        return set()
    inodes = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    fields = line.rstrip("\n").split(None, 5)
                    if len(fields) < 6 or os.path.dirname(fields[5]) != directory:
                        continue
                    major, minor = fields[3].split(":")
                    if os.makedev(int(major, 16), int(minor, 16)) == device:
                        inodes.add(int(fields[4]))
        except (OSError, ValueError):  # gone meanwhile
            continue
    return inodes


class ShmRecord:
    """This run's record. `watch()` as the engine starts: until `stop_watching()`, a thread adds
    what the run's processes map, so that a kill during a long model load finds the files made so
    far recorded. `close()` when the run ends.

    Reading the processes' maps costs far more than listing a directory (docs/benchmarks.md,
    "Figures the code cites"), so the thread lists the directory every `interval`
    seconds instead and reads the maps
    when a name appears, then again each tick while a new name is not yet accounted for (for up
    to a second: it may be another program's, or not mapped yet). A kill in the few tens of
    milliseconds between a file's creation and its recording leaves that file unrecorded."""

    def __init__(self, directory: str = DIRECTORY, interval: float = 0.02):
        self.directory = directory
        self.interval = interval
        self.pid = os.getpid()
        start, namespace = _start_time(self.pid), _pid_namespace()
        self.enabled = start is not None and namespace is not None and os.path.isdir(directory)
        self.path = os.path.join(directory, f"{PREFIX}{namespace}-{self.pid}-{start}{SUFFIX}")
        self.files: dict[str, int] = {}  # name → inode
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def scan(self) -> None:
        if not self.enabled:
            return
        inodes = _mapped(_descendants(self.pid), self.directory)
        new = {}
        with os.scandir(self.directory) as entries:
            for entry in entries:
                if entry.name not in self.files and not entry.name.startswith(PREFIX) and entry.inode() in inodes:
                    new[entry.name] = entry.inode()
        if new:
            self.files.update(new)
            self._write()

    def _write(self) -> None:
        temporary = self.path + ".tmp"
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"files": self.files}, f)  # whose: the name says
        os.replace(temporary, self.path)  # a kill mid-write leaves the previous record whole

    def watch(self) -> None:
        if not self.enabled:
            return
        self._thread = threading.Thread(target=self._watch, name="corecap-shm-record", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        first_seen = dict.fromkeys(os.listdir(self.directory), -1.0)  # there before: not this run's
        try:
            self.scan()
            while not self._stop.wait(self.interval):
                now = time.monotonic()
                names = os.listdir(self.directory)
                for name in names:
                    first_seen.setdefault(name, now)
                if any(now - first_seen[n] < 1.0 for n in names if n not in self.files and not n.startswith(PREFIX)):
                    self.scan()
        except OSError:  # /dev/shm full: the run itself says so soon enough
            return

    def stop_watching(self) -> None:
        """Stop the thread, with a last scan: everything the started engine maps is recorded."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        try:
            self.scan()
        except OSError:
            pass

    def close(self, grace: float = 0.5, timeout: float = 5.0) -> None:
        """Call after the engine's shutdown. The record goes once its files are gone, which can
        take a moment: a worker that was told to stop may still be unlinking its queue. While
        another of the run's processes maps a recorded file, and for `grace` seconds in any case,
        this waits (`timeout` at most); what is left then is a dead process's (a SIGKILLed
        worker's), or this one's own until it exits, and the record stays for the next run."""
        self.stop_watching()
        if not self.enabled:
            return
        start = time.monotonic()
        while True:
            left = {ino for n, ino in self.files.items() if _same_file(self.directory, n, ino)}
            if not left:
                break
            elapsed = time.monotonic() - start
            children = _descendants(self.pid)[1:]  # what this process maps does not go while it waits
            if elapsed > timeout or (elapsed > grace and not left & _mapped(children, self.directory)):
                return
            time.sleep(0.05)
        for path in (self.path, self.path + ".tmp"):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


def _same_file(directory: str, name: str, inode: int) -> os.stat_result | None:
    """The file's stat while it is still the recorded one (a regular file, that inode, ours)."""
    try:
        st = os.lstat(os.path.join(directory, name))
    except OSError:
        return None
    return st if stat.S_ISREG(st.st_mode) and st.st_ino == inode and st.st_uid == os.getuid() else None


@dataclass(frozen=True)
class Removed:
    pids: list[int]  # runs whose leftovers were removed
    num_files: int
    num_bytes: int

    def line(self) -> str:
        runs = ", ".join(map(str, self.pids))
        return (
            f"removed {self.num_files} shared-memory files ({self.num_bytes / 2**20:.0f} MiB) left in /dev/shm by "
            f"{'a killed run' if len(self.pids) == 1 else f'{len(self.pids)} killed runs'} (pid {runs})"
        )


def remove_left_behind(directory: str = DIRECTORY) -> Removed:
    """Remove the files that runs which are gone recorded, then their records."""
    pids, num_files, num_bytes = set(), 0, 0
    namespace = _pid_namespace()
    try:
        names = os.listdir(directory)
    except OSError:
        return Removed([], 0, 0)
    for name in names:
        owner = name.removeprefix(PREFIX).split(SUFFIX)[0].split("-")
        if not name.startswith(PREFIX) or len(owner) != 3 or owner[0] != namespace or not owner[1].isdigit():
            continue
        pid, start = int(owner[1]), owner[2]
        if _start_time(pid) == start:  # still running
            continue
        path = os.path.join(directory, name)
        files = {}
        if name.endswith(SUFFIX):
            try:
                with open(path) as f:
                    files = json.load(f)["files"]
            except (OSError, ValueError, KeyError, TypeError):  # not ours to read, or not a record
                continue
        for file, inode in files.items() if isinstance(files, dict) else ():
            st = None if "/" in file or not isinstance(inode, int) else _same_file(directory, file, inode)
            if st is None:
                continue
            try:
                os.unlink(os.path.join(directory, file))
            except OSError:
                continue
            pids.add(pid)
            num_files += 1
            num_bytes += st.st_size
        try:
            os.unlink(path)
        except OSError:
            pass
    return Removed(sorted(pids), num_files, num_bytes)
