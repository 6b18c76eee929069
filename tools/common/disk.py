"""The disk's fsync'd sequential write rate, as `dd conv=fsync` measures it: the bound a store on
that file system is compared against."""

from __future__ import annotations

import os
import subprocess
import time


def dd_rate(directory: str, nbytes: int, block_mib: int = 16) -> float:
    """GB/s of `dd conv=fsync` writing nbytes (blocks of block_mib MiB) into directory."""
    path = os.path.join(directory, "dd.bin")
    count = max(1, nbytes // (block_mib << 20))
    start = time.perf_counter()
    subprocess.run(["dd", "if=/dev/zero", f"of={path}", f"bs={block_mib}M", f"count={count}", "conv=fsync"],
                   check=True, capture_output=True)
    seconds = time.perf_counter() - start
    os.unlink(path)
    return count * (block_mib << 20) / seconds / 1e9
