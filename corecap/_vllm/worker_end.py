"""How each of vLLM's worker processes ends, once vLLM has shut it down.

A worker's `worker_main` ends with `WorkerProc.shutdown` (its message queues closed, the worker
and the distributed environment torn down), in a `finally` whatever stopped it; the process then
exits through the interpreter's teardown of the torch and vLLM modules it imported, which writes
nothing and costs seconds on a small CPU, while the driver waits for every worker to exit
(`MultiprocExecutor._ensure_worker_termination`) on each engine's shutdown. Installed in every
worker with the capture, `install` has `WorkerProc.shutdown`, called from there, end the process
as corecap's own command ends (corecap/process_end.py): Python's exit work done (the ring's
`atexit` unlink and logging's flush among it; no collection of the model's objects), then
`os._exit` with the status the interpreter would have given.
tests/test_worker_end.py checks the shape of `worker_main` this relies on.
"""

from __future__ import annotations

import ast
import sys

from corecap.process_end import end

_MARK = "corecap_ends_the_process"
WORKER_PROC = "vllm.v1.executor.multiproc_executor.WorkerProc"


def install(worker_proc=None) -> None:
    """In a worker: `WorkerProc.shutdown` (or `worker_proc`'s, a test's stand-in), called by
    `worker_main` as its last act, ends the process."""
    if worker_proc is None:
        from vllm.v1.executor.multiproc_executor import WorkerProc as worker_proc
    shutdown = worker_proc.shutdown
    if getattr(shutdown, _MARK, False):
        return

    def shutdown_then_end(self) -> None:
        shutdown(self)
        if sys._getframe(1).f_code.co_name != "worker_main":
            return  # called from elsewhere: vLLM's own code goes on
        code = exit_status(sys.exc_info()[1])
        if code is not None:
            end(code, collect=False)  # a worker writes no file: its states and logs are flushed by now

    setattr(shutdown_then_end, _MARK, True)
    worker_proc.shutdown = shutdown_then_end


def exit_status(error: BaseException | None) -> int | None:
    """The status the worker process would exit with, `error` being the exception on its way out
    of `worker_main`'s `finally` (vLLM logs and swallows an `Exception` before it: none then);
    None where Python's own exit is left to decide (an exception multiprocessing would print)."""
    if error is None:
        return 0
    if isinstance(error, SystemExit):  # SIGTERM or SIGINT, in vLLM's handler: SystemExit()
        if error.code is None:
            return 0
        return error.code if isinstance(error.code, int) else None
    return None


def worker_main_problem(source) -> str | None:
    """What `install` relies on in vLLM's source (a corecap/_vllm/vllm_source.py `Source`), or
    None: `WorkerProc.worker_main`'s outermost `try` ends, in its `finally`, with the call of
    `worker.shutdown()` (inside `if worker is not None:`), nothing after it."""
    method = source.cls(WORKER_PROC).method("worker_main")
    if method is None:
        return "WorkerProc.worker_main is gone"
    tries = [n for n in method.node.body if isinstance(n, ast.Try) and n.finalbody]
    if not tries:
        return "WorkerProc.worker_main has no try/finally around the worker's life"
    last = tries[-1].finalbody[-1]
    if isinstance(last, ast.If) and not last.orelse:
        last = last.body[-1]
    call = last.value if isinstance(last, ast.Expr) else None
    if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "shutdown"
            and isinstance(call.func.value, ast.Name) and call.func.value.id == "worker"):
        return "WorkerProc.worker_main's finally no longer ends with worker.shutdown()"
    return None
