"""The workers' own errors, for the driver's one line when the engine fails to start.

vLLM's driver learns little of a worker's failure: a worker that raises while it starts (loading
the weights, a kernel that refuses a dtype) closes its ready pipe, and the driver raises a
generic "WorkerProc initialization failed ... See stack trace for root cause"; one that raises
in an RPC (KV cache setup, warm-up) is passed on as its message alone, without its type. Both
paths log the exception in the worker first (`logger.exception` in vLLM's multiproc_executor:
"WorkerProc failed to start.", "WorkerProc hit an exception."), traceback included, which the
run's log receives (corecap/console.py).

So a handler on that logger, in each worker, writes the last exception it logged (type, first
line of the message, rank, time) to a small file in a directory the driver made for this engine
start, named by `ENV`; the driver reads them once the start has failed (`first_error`). The
handler gets into the workers both ways vLLM starts them: a forked worker inherits the one the
driver installs while its workers start (`recording`), a spawned one installs it when it imports
corecap/_vllm/worker.py, the worker extension (`watch`), which vLLM does before the worker
initialises its device or loads a weight. A worker that dies without raising (the kernel's OOM
killer) records nothing: corecap/_vllm/worker_deaths.py names it by the signal that killed it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing
import os
import signal
import time

from corecap._vllm.worker_deaths import rank_of

ENV = "CORECAP_WORKER_ERRORS"
LOGGER = "vllm.v1.executor.multiproc_executor"  # where vLLM logs a worker's exception
_MAX_CHARS = 500


class _Recorder(logging.Handler):
    """Writes the last exception logged in this worker process to DIR/PID.json."""

    def __init__(self, directory: str, driver_pid: int):
        super().__init__(level=logging.ERROR)
        self.directory = directory
        self.driver_pid = driver_pid  # the driver's own records are not a worker's

    def emit(self, record: logging.LogRecord) -> None:
        if os.getpid() == self.driver_pid or not record.exc_info or record.exc_info[1] is None:
            return
        error = record.exc_info[1]
        lines = str(error).strip().splitlines()
        entry = {"rank": _rank(), "pid": os.getpid(), "time": time.time(), "type": type(error).__name__,
                 "message": (lines[0] if lines else "")[:_MAX_CHARS]}
        path = os.path.join(self.directory, f"{os.getpid()}.json")
        try:
            with open(path + ".tmp", "w") as f:
                json.dump(entry, f)
            os.replace(path + ".tmp", path)  # whole, or not there
        except OSError:  # the driver has cleaned up already: nobody is asking
            pass


def _rank() -> int | None:
    return rank_of(multiprocessing.current_process().name)


def _install(directory: str, driver_pid: int) -> _Recorder | None:
    logger = logging.getLogger(LOGGER)
    if any(isinstance(h, _Recorder) for h in logger.handlers):
        return None
    handler = _Recorder(directory, driver_pid)
    logger.addHandler(handler)
    return handler


def watch() -> None:
    """In a worker (corecap/_vllm/worker.py, on import): record its errors where the driver said."""
    directory = os.environ.get(ENV)
    if directory:
        _install(directory, os.getppid())


def ignore_interrupts() -> None:
    """In a worker (corecap/_vllm/worker.py, on import): ignore SIGINT and SIGTERM. A terminal's
    Ctrl-C goes to the whole process group, and so does the SIGTERM of a job scheduler or of
    systemd stopping a service; vLLM's handler (installed just before) would end the worker
    mid-step, which the driver would report as a worker's death, and the worker's shared memory
    would outlive the run. The driver stops the workers itself once it has committed what is
    complete; a worker whose driver is gone ends by itself (vLLM's death pipe). Only in vLLM's
    worker processes (children that know where to record errors): never in the driver, which
    may import this module too."""
    if os.environ.get(ENV) and multiprocessing.parent_process() is not None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


@contextlib.contextmanager
def recording(directory: str):
    """In the driver, around starting the workers: they inherit where to record (the environment)
    and, when forked, the handler itself."""
    saved = os.environ.get(ENV)
    os.environ[ENV] = directory
    handler = _install(directory, os.getpid())
    try:
        yield
    finally:
        if handler is not None:
            logging.getLogger(LOGGER).removeHandler(handler)
        if saved is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = saved


def first_error(directory: str) -> str | None:
    """The earliest of the workers' last errors, as one line naming the worker; None if none
    recorded one. The earliest: a worker's failure makes the others fail after it (a closed
    connection, a shutdown), and it is their cause."""
    entries = []
    for name in os.listdir(directory):
        if name.endswith(".json"):
            try:
                with open(os.path.join(directory, name)) as f:
                    entries.append(json.load(f))
            except (OSError, ValueError):
                continue
    if not entries:
        return None
    entry = min(entries, key=lambda e: e["time"])
    who = f"worker rank {entry['rank']}" if entry["rank"] is not None else f"worker pid {entry['pid']}"
    if entry["message"].startswith("worker rank "):  # corecap's own, which names the rank already
        return entry["message"]
    return f"{who}: {entry['type']}: {entry['message']}"
