"""The sink process's own memory: what it asks of the allocator, and what it measures of itself
for the run's record (trace.json's `sink`, corecap/run.py)."""

from __future__ import annotations

import ctypes

import psutil

# glibc's M_MMAP_THRESHOLD, and the size from which the sink's allocations are mappings of their
# own (glibc's own starting value, which it would raise); M_ARENA_MAX, and the heaps its threads share
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_BYTES = 128 << 10
_M_ARENA_MAX = -8
_ARENAS = 2


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
    """Allocations of 128 KiB and more are mappings of their own, given back to the system when
    freed, and the sink's threads share two heaps (glibc; elsewhere nothing changes). glibc's
    default raises that threshold to the largest block freed so far (up to 32 MiB), and gives
    each thread a heap of its own: the samples' buffers, byte planes and compressed payloads,
    freed by one thread and allocated by another, then came from heaps that keep what they once
    held, and the sink's resident memory grew with the number of samples well past what
    --buffer-gb bounds (docs/benchmarks.md, "2026-12-05 (CPU): the sink's memory as the prompts double")."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_BYTES)
        libc.mallopt(_M_ARENA_MAX, _ARENAS)
    except (OSError, AttributeError):
        pass
