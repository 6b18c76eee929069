"""How the `corecap` process ends (the console script, `python -m corecap`, `python -m corecap.cli`).

When a command has finished, it has closed its store, its log and every file it wrote, and vLLM's
workers and corecap's sink have exited: `entry` ends the process as corecap/process_end.py says,
without the interpreter's teardown of torch and vLLM. `main` called in-process (click's
CliRunner) is untouched.
"""

from __future__ import annotations

import sys

from corecap.cli import main
from corecap.process_end import end


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

