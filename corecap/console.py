"""A quiet terminal for `corecap run`: everything the process and its children (vLLM's engine and
workers, torch, tqdm) write to stdout and stderr goes to the run's log file, STORE/corecap.log;
the terminal shows corecap's own lines, its progress line, and the rest only with `-v`.

Done at the file-descriptor level, since vLLM's workers are other processes writing to the
descriptors they inherit: fds 1 and 2 become a pipe that a thread copies into the log (and to
the terminal with `verbose`), while corecap writes its own lines to copies of the original
descriptors. `__exit__` puts the descriptors back and drains the pipe.

A run on a store that does not exist yet logs to a temporary file, moved into the store once the
run has made it: a run refused before it made the store leaves no directory behind, and the CLI
removes that file (the one-line error says what it would).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import threading
import time

LOG_FILE = "corecap.log"
DRAIN_SECONDS = 5.0  # how long closing the log waits for the children's last output


class RunLog:
    """The log of a run on `store`: STORE/corecap.log, or (until the run makes the store) a
    temporary file; `path` is where it is, and after `__exit__` where it stays."""

    def __init__(self, store: str, verbose: bool = False):
        self.store = store
        self.path = os.path.join(store, LOG_FILE)
        # An existing directory's log stays where it is, whatever happens; a run that makes one
        # (its writer lock may, corecap/writer_lock.py) logs there only once the store is made.
        self.in_store = os.path.isdir(store)
        self.verbose = verbose
        self.terminal_out = self.terminal_err = None
        self._saved: list[int] = []
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed = False

    def __enter__(self) -> "RunLog":
        if self.in_store:
            self.file = open(self.path, "ab", buffering=0)
        else:
            name = os.path.basename(os.path.normpath(self.store))
            fd, self.path = tempfile.mkstemp(prefix=f"corecap-{name}-", suffix=".log")
            self.file = os.fdopen(fd, "ab", buffering=0)
        self.file.write(f"--- corecap run, {time.strftime('%Y-%m-%d %H:%M:%S')}, pid {os.getpid()}\n".encode())
        sys.stdout.flush()
        sys.stderr.flush()
        self._saved = [os.dup(1), os.dup(2)]
        self._start_resource_tracker()
        self.terminal_out = os.fdopen(os.dup(self._saved[0]), "w", buffering=1)
        self.terminal_err = os.fdopen(os.dup(self._saved[1]), "w", buffering=1)
        read_end, write_end = os.pipe()
        os.dup2(write_end, 1)
        os.dup2(write_end, 2)
        os.close(write_end)
        self._thread = threading.Thread(target=self._copy, args=(read_end,), daemon=True, name="corecap-log")
        self._thread.start()
        return self

    def _start_resource_tracker(self) -> None:
        """Python's multiprocessing resource tracker, which the run's first shared-memory object
        starts, lives until this process exits and keeps the descriptors 1 and 2 it inherited:
        started here with both on the log file, it writes its warnings there and never holds the
        pipe open, which closing the log would otherwise wait DRAIN_SECONDS for."""
        from multiprocessing import resource_tracker

        os.dup2(self.file.fileno(), 1)
        os.dup2(self.file.fileno(), 2)
        resource_tracker.ensure_running()

    def _copy(self, fd: int) -> None:
        try:
            while chunk := os.read(fd, 1 << 16):
                with self._lock:  # once closed, a leftover child's output is read and dropped, never left to block it
                    if self._closed:
                        continue
                    self.file.write(chunk)
                    if self.verbose:
                        self.terminal_err.buffer.write(chunk)
                        self.terminal_err.flush()
        finally:
            os.close(fd)

    def say(self, message: str, err: bool = True) -> None:
        """One of corecap's own lines: on the terminal, and in the log."""
        stream = self.terminal_err if err else self.terminal_out
        stream.write(message + "\n")
        stream.flush()
        with self._lock:
            self.file.write((message + "\n").encode(errors="replace"))

    def record(self, text: str) -> None:
        """Into the log only (e.g. a traceback)."""
        with self._lock:
            self.file.write(text.encode(errors="replace"))

    def __exit__(self, *exc) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(self._saved[0], 1)  # the pipe's last write ends close here (children have exited)
        os.dup2(self._saved[1], 2)
        for fd in self._saved:
            os.close(fd)
        if self._thread is not None:
            self._thread.join(timeout=DRAIN_SECONDS)  # a leftover child holding the pipe: stop copying (daemon thread)
        with self._lock:  # the thread may still be copying: it must not write to what closes here
            self._closed = True
            self.terminal_out.close()
            self.terminal_err.close()
            self.file.close()
        self._settle()

    def final_error(self, error: str, internal: bool) -> str:
        """The failed run's one line, once the log is closed. A run refused before it made the
        store leaves nothing: its one line says all its log would (a bug's traceback stays)."""
        if not self.in_store and not internal:
            os.unlink(self.path)
            return f"{error}; no store was made"
        traceback = f" (the traceback is in {self.path})" if internal else ""
        return f"{error}; no store was made{traceback}" if not self.in_store else f"{error}{traceback}"

    def _settle(self) -> None:
        """A store this run made gets the temporary log (appended: a concurrent run may have
        started one there); a run refused before it made the store keeps it where it is."""
        if self.in_store or not os.path.exists(os.path.join(self.store, "data.mdb")):
            return
        path = os.path.join(self.store, LOG_FILE)
        with open(self.path, "rb") as src, open(path, "ab") as dst:
            shutil.copyfileobj(src, dst)
        os.unlink(self.path)
        self.path, self.in_store = path, True
