"""The sink process's own memory: what it asks of the allocator, and what it measures of itself
for the run's record (trace.json's `sink`, corecap/run.py)."""

from __future__ import annotations

import ctypes

import psutil

TRIM_EVERY_S = 1.0  # how often the commit thread gives the heaps' free pages back (writer.py)


def rss() -> int:
    """This process's resident bytes now."""
    return psutil.Process().memory_info().rss


def peak_rss() -> int:
    """This process's peak resident bytes so far (the kernel's high-water mark, VmHWM; 0 where
    there is no /proc)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def return_freed_memory() -> None:
    """Give the heaps' free pages back to the system (glibc's malloc_trim; elsewhere nothing).
    glibc keeps what its heaps once held, and gives each thread a heap of its own: the samples'
    byte planes and compressed payloads, freed by one thread and allocated by another, left the
    sink's resident memory growing with the number of samples well past what --buffer-gb bounds
    (docs/benchmarks.md, "Generation"). The commit
    thread calls this at most every TRIM_EVERY_S: the allocator's fast paths stay as they are
    (fixing its mmap threshold instead would map, fault in and unmap every large temporary)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
