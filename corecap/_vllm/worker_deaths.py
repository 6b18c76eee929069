"""Workers that died by a signal, named in the driver's one line.

A worker killed outright (SIGKILL from the kernel's out-of-memory killer, a segfault) logs
nothing and records no error (corecap/_vllm/worker_errors.py): vLLM's driver then says only
that the start failed ("WorkerProc initialization failed ...") or that its RPC was cancelled.
The exit status is the one trace such a death leaves, and only the process's parent, the
driver, can read it: vLLM's executor holds each worker's `multiprocessing.Process` and, when a
start fails or the executor shuts down, passes them all to `_ensure_worker_termination`, which
reaps them. corecap's executor (corecap/_vllm/engine.py) notes there which had died before vLLM
ended the rest (`dead_on_their_own`); those are the cause.
"""

from __future__ import annotations

import os
import re
import signal
import time

SETTLE_S = 1.0  # how long the driver waits for a dying worker's exit status (`dead_on_their_own`)
# SIGKILL from outside, with nobody asking, is nearly always the kernel's OOM killer.
_OUT_OF_MEMORY_HINT = (
    "likely out of memory (the kernel's OOM killer; `dmesg` shows it): lower --gpu-memory-utilization "
    "(on a CPU the share of RAM for vLLM's KV cache, or set VLLM_CPU_KVCACHE_SPACE in GiB) or --max-num-seqs"
)


def rank_of(process_name: str) -> int | None:
    """vLLM names each worker process `VllmWorker-RANK` (multiproc_executor, make_worker_process)."""
    m = re.fullmatch(r"VllmWorker-(\d+)", process_name)
    return int(m.group(1)) if m else None


def dead_on_their_own(processes, settle_s: float = 0.0) -> list[tuple[int | None, int, int]]:
    """(rank, pid, exit code) of each worker process that has exited already; reaps them
    (`exitcode` polls), as vLLM's termination would next. `settle_s`: how long to wait for a
    first one to exit. A killed worker's pipes close before the kernel has made it a zombie
    (its exit status readable), and vLLM's driver, woken by the closed pipe, gets here within
    that gap; the process's `sentinel` is a pipe too, so only polling tells."""
    deadline = time.monotonic() + settle_s
    while not any(p.exitcode is not None for p in processes) and time.monotonic() < deadline:
        time.sleep(0.01)
    return [(rank_of(p.name), p.pid, p.exitcode) for p in processes if p.exitcode is not None]


def describe(rank: int | None, pid: int, exitcode: int | None, during: str = "") -> str:
    """One line for a worker that is gone: the signal that killed it and, for SIGKILL, its
    likely cause; "died" when it exited by itself or its status is unknown."""
    who = f"worker rank {rank} (pid {pid})" if rank is not None else f"worker pid {pid}"
    if exitcode is None or exitcode >= 0:
        return f"{who} died{during}"
    try:
        name = signal.Signals(-exitcode).name
    except ValueError:
        name = f"signal {-exitcode}"
    if -exitcode == signal.SIGKILL:
        return f"{who} was killed by {name}{during}: {_OUT_OF_MEMORY_HINT}"
    return f"{who} was killed by {name}{during}"


def first_killed(deaths: list[tuple[int | None, int, int]], during: str = "") -> str | None:
    """The line for the first worker among `deaths` that a signal killed; None if none was."""
    for rank, pid, exitcode in sorted(deaths, key=lambda d: (d[0] is None, d[0] or 0)):
        if exitcode < 0:
            return describe(rank, pid, exitcode, during)
    return None


def noted(executors: list) -> list:
    """The worker deaths the executors noted (`_ensure_worker_termination`). A worker that dies
    once the workers are up (the KV cache's setup, warm-up) is noted by vLLM's monitor thread,
    which may still be at it when the driver's RPC has failed: wait for it, a little."""
    deadline = time.monotonic() + 2 * SETTLE_S
    while time.monotonic() < deadline and any(
        getattr(e, "is_failed", False) and not hasattr(e, "corecap_deaths") for e in executors
    ):
        time.sleep(0.05)
    return [death for e in executors for death in getattr(e, "corecap_deaths", [])]


def alive(pid: int) -> bool:
    """Whether the process runs. os.kill(pid, 0) alone succeeds on a zombie: a worker that died
    and that nobody reaped yet, which is how a dead worker of ours first looks."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")  # the state, after the name
    except FileNotFoundError:
        return False
    except (OSError, IndexError):  # no /proc here: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
