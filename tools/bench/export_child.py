"""One `corecap export` in a process of its own (tools/bench/export.py runs it), so its peak RSS
is its own and no import or cache of another format's export is warm. Each stage of the export is
timed by wrapping the functions the driver calls: decode, the layout's gather + write (a file per
sample, or DeepSpec's row into its shard), the fsync + rename, and the walking thread's read.

    python -m tools.bench.export_child STORE OUT FORMAT WORKERS   # FORMAT: a bench format name

jsonl reads headers only and is done with a store in well under a second, so it is exported again
(to a fresh file each time) until JSONL_SECONDS have passed, and the passes are summed.

Its last line is `RESULT {json}` (tools/common/child.py)."""

from __future__ import annotations

import os
import resource
import sys
import threading
import time

from corecap.export import driver, formats, jsonl
from corecap.store import store
from tools.common.child import report

# A bench format: (corecap's --format, --dtype).
FORMATS = {
    "speculators": ("speculators", "auto"), "speculators-fp8": ("speculators", "fp8"),
    "specforge": ("specforge", "auto"), "modelopt": ("modelopt", "auto"),
    "specforge-dflash": ("specforge-dflash", "auto"), "specforge-dspark": ("specforge-dspark", "auto"),
    "deepspec": ("deepspec", "auto"), "jsonl": ("jsonl", None),
}

JSONL_SECONDS = 20.0
spent: dict[str, float] = {}  # stage -> seconds summed over the threads that ran it
_lock = threading.Lock()


def timed(name: str, fn):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            with _lock:
                spent[name] = spent.get(name, 0.0) + time.perf_counter() - start
    return wrapper


class StandInTokenizer:
    """jsonl's text without a tokenizer on disk: four characters a token (about a Llama-3
    token's), so the line's size is a real one's; what a real tokenizer's decode costs is not measured."""

    def __len__(self) -> int:
        return 1 << 31

    def decode(self, ids: list[int]) -> str:
        return "abcd" * len(ids)


def instrument(fmt: str) -> None:
    store.Store.decode = timed("decode", store.Store.decode)
    store.Store.states = timed("read (walking thread)", store.Store.states)
    layout = formats.LAYOUTS[fmt]
    if getattr(layout, "shares_files", False):  # DeepSpec: rows into shards, a shard fsync'd when full
        layout.write_row = timed("gather + write", layout.write_row)
        # a shard's fsync + rename, on the sync thread that wrote its last row or in finish() for the last
        layout._commit = staticmethod(timed("fsync + rename", layout._commit))
    else:
        layout.write = timed("gather + write", layout.write)
        driver.commit_file = timed("fsync + rename", driver.commit_file)


def export_once(store_path: str, out: str, name: str, workers: int) -> dict:
    fmt, dtype = FORMATS[name]
    start = time.perf_counter()
    if fmt == "jsonl":
        seconds = nbytes = samples = tokens = passes = 0
        while seconds < JSONL_SECONDS:
            s = jsonl.export_jsonl(store_path, out, StandInTokenizer())
            os.unlink(out)
            seconds, nbytes, samples, tokens = (seconds + s.seconds, nbytes + s.nbytes, samples + s.num_samples,
                                                tokens + s.num_tokens)
            passes += 1
    else:
        instrument(fmt)
        s = driver.export_store(store_path, out, fmt, dtype=dtype, workers=workers)
        seconds, nbytes, samples, tokens, passes = s.seconds, s.nbytes, s.num_samples, s.num_tokens, 1
    return {
        "format": name, "seconds": seconds, "wall": time.perf_counter() - start, "nbytes": nbytes,
        "samples": samples, "tokens": tokens, "passes": passes,
        "maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "stage_ms_per_sample": {k: round(v / samples * 1e3, 1) for k, v in spent.items()},
    }


if __name__ == "__main__":
    report(export_once(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])))
