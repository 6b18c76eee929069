"""A vLLM worker process ends as soon as vLLM has shut it down (corecap/_vllm/worker_end.py): its
exit work done (`atexit` handlers run, output flushed), its status the one Python would give,
without the interpreter's teardown; and vLLM's `worker_main` has the shape that relies on."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest

from corecap._vllm.vllm_source import Source, package_dir
from corecap._vllm.worker_end import exit_status, worker_main_problem

# A worker's life in miniature: `worker_main` ends with `worker.shutdown()` in its `finally`, as
# vLLM's does; what follows it, and the interpreter's teardown (an object whose finalizer prints),
# must not run once the process is ended there.
_WORKER = textwrap.dedent("""
    import atexit, sys
    from corecap._vllm import worker_end

    class Teardown:
        def __del__(self):
            print("teardown ran", flush=True)

    KEPT = Teardown()  # finalized in the interpreter's teardown, at a normal exit

    class FakeWorkerProc:
        def shutdown(self):
            print("vLLM's shutdown ran", flush=True)

    def worker_main(how):
        worker = FakeWorkerProc()
        try:
            if how == "sigterm":
                raise SystemExit()
            if how == "status 3":
                raise SystemExit(3)
            if how == "failed":
                try:
                    raise RuntimeError("a failed step, logged by vLLM")
                except Exception:
                    pass
            if how == "interrupted":
                raise KeyboardInterrupt
        finally:
            if worker is not None:
                worker.shutdown()
        print("after worker_main", flush=True)

    atexit.register(lambda: print("atexit ran", flush=True))
    worker_end.install(FakeWorkerProc)
    FakeWorkerProc().shutdown()  # called from elsewhere: the process goes on
    print("still running", flush=True)
    worker_main(sys.argv[1])
""")


@pytest.mark.parametrize("how, status", [("shutdown", 0), ("sigterm", 0), ("status 3", 3), ("failed", 0)])
def test_a_worker_ends_at_its_shutdown_with_its_exit_work_done(how, status):
    done = subprocess.run([sys.executable, "-c", _WORKER, how], capture_output=True, text=True, timeout=60)
    assert done.returncode == status, done.stderr
    assert done.stdout.splitlines() == ["vLLM's shutdown ran", "still running", "vLLM's shutdown ran", "atexit ran"]


def test_an_exception_python_would_print_is_left_to_python():
    done = subprocess.run([sys.executable, "-c", _WORKER, "interrupted"], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "KeyboardInterrupt" in done.stderr
    assert "teardown ran" in done.stdout.splitlines()  # the interpreter's own exit, as before


def test_the_exit_status_is_pythons():
    assert exit_status(None) == 0
    assert exit_status(SystemExit()) == 0 and exit_status(SystemExit(3)) == 3
    assert exit_status(SystemExit("a message")) is None  # Python prints it, status 1
    assert exit_status(KeyboardInterrupt()) is None


@pytest.mark.matrix
def test_vllms_worker_main_ends_with_the_workers_shutdown():
    assert worker_main_problem(Source()) is None


def test_a_moved_shutdown_is_named(tmp_path):
    """A release that did more after the worker's shutdown: ending the process there would skip it."""
    path = os.path.join(package_dir(), "v1", "executor", "multiproc_executor.py")
    text = open(path).read()
    moved, count = re.subn(r"(\n( +)if worker is not None:\n +worker\.shutdown\(\))", r"\1\n\2print()", text)
    assert count == 1
    edited = tmp_path / "multiproc_executor.py"
    edited.write_text(moved)
    source = Source(replaced={"vllm.v1.executor.multiproc_executor": str(edited)})
    assert worker_main_problem(source) == "WorkerProc.worker_main's finally no longer ends with worker.shutdown()"
