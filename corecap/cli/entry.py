"""How the `corecap` process ends (the console script, `python -m corecap`, `python -m corecap.cli`).

When a command has finished, it has closed its store, its log and every file it wrote, and vLLM's
workers and corecap's sink have exited; what is left is the interpreter tearing down the torch and
vLLM modules it imported, which costs a finished `run` ~2.5 s on a small CPU and writes nothing.
`entry` does Python's own exit work (other threads joined, `atexit` handlers run, what is
unreachable collected, stdout and stderr flushed) and then ends the process, skipping that
teardown. `main` called in-process (click's CliRunner) is untouched.
"""

from __future__ import annotations

import atexit
import gc
import os
import sys
import threading

from corecap.cli import main


def entry() -> None:
    try:
        main()
        code = 0  # click's main ends with SystemExit; this is for one that returns
    except SystemExit as e:
        code = e.code
    if code is None:
        code = 0
    elif not isinstance(code, int):  # sys.exit("message"): printed, status 1, as Python does
        print(code, file=sys.stderr)
        code = 1
    end(code)


def end(code: int) -> None:
    """Python's own exit work, then the process ends with `code`, without the interpreter's teardown."""
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    gc.collect()  # an unreachable open file is closed (and flushed) as at a normal exit
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
