"""How a corecap process ends once its work is done: the `corecap` command (corecap/cli/entry.py)
and each of vLLM's workers (corecap/_vllm/worker_end.py).

When such a process has finished, it has closed every file it wrote and given its messages to
their sockets; what is left is the interpreter tearing down the torch and vLLM modules it
imported, which costs seconds on a small CPU and writes nothing. `end` does Python's own exit
work (other threads joined, `atexit` handlers run, what is unreachable collected, stdout and
stderr flushed) and then ends the process, skipping that teardown.
"""

from __future__ import annotations

import atexit
import gc
import os
import sys
import threading


def end(code: int, collect: bool = True) -> None:
    """Python's own exit work, then the process ends with `code`, without the interpreter's
    teardown. `collect=False`: what is unreachable is not collected (a process that holds no
    file of its own open, only sockets and its memory, whose collection is the longest step)."""
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    if collect:
        gc.collect()  # an unreachable open file is closed (and flushed) as at a normal exit
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
