"""What a test needs of the machine it runs on, said once: the tests that need root or
CAP_SYS_ADMIN (a network namespace, a tmpfs of their own) skip, naming what is missing, on a
machine without it; in CI (CI=true, as .ci/run sets) they are mandatory, and a machine that
cannot run them is a failure there, not a silent skip."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() == "true"


def require(available: bool, what: str) -> None:
    """Skip the calling test (fail it under CI=true) unless `available`; `what` says what it needs."""
    if available:
        return
    message = f"this machine does not allow {what}"
    if in_ci():
        pytest.fail(f"{message} (CI=true: mandatory)", pytrace=False)
    pytest.skip(message)


def can_unshare_network() -> bool:
    """A new network namespace for a child process (CAP_SYS_ADMIN)."""
    probe = "import ctypes, sys; sys.exit(ctypes.CDLL(None, use_errno=True).unshare(0x40000000) != 0)"
    return subprocess.run([sys.executable, "-c", probe]).returncode == 0


def can_make_network_namespaces() -> bool:
    """Named network namespaces and veth pairs with iproute2 (root)."""
    return os.geteuid() == 0 and shutil.which("ip") is not None


def num_cores() -> int:
    """The cores this process may run on (what corecap counts)."""
    return len(os.sched_getaffinity(0))
