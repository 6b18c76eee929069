"""corecap as a user runs it: `python -m corecap.cli ...` in a directory of its own, as a
subprocess (the CLI demo's tests and the examples' tests share it)."""

from __future__ import annotations

import os
import subprocess
import sys


def corecap(*args, cwd, env_extra=None, check=True):
    env = {**os.environ, **(env_extra or {})}
    result = subprocess.run([sys.executable, "-m", "corecap.cli", *args], cwd=cwd, env=env, capture_output=True,
                            text=True, timeout=900)
    if check and result.returncode != 0:
        raise AssertionError(f"corecap {' '.join(args)} failed ({result.returncode}):\n{result.stderr[-3000:]}")
    return result
