"""What `corecap.capture` does about the process it runs in, as Python users expect: corecap's
own lines through `logging` (the `corecap` logger), vLLM's quiet as on the CLI, and a call that
vLLM's spawned workers would repeat refused at once.

multiprocessing's spawn (vLLM's workers, corecap's sink) starts each child by re-running the
parent's main script as `__mp_main__`; a `capture()` at the script's top level then runs again
in every child, which cannot start processes of its own, and the parent only learns that its
worker died. `guard_spawned_main` refuses such a call in the parent before anything starts, and,
in a child re-running the script (multiprocessing's own test, `_inheriting`), says why there.
"""

from __future__ import annotations

import ast
import contextlib
import logging
import multiprocessing
import os
import sys

LOGGER = "corecap"
GUARD = 'if __name__ == "__main__":'
# vLLM's own lines at ERROR only: `corecap run` shows none of them (they go to its log file), and
# its warnings include one a weight on a model stored in another dtype (float32 weights run in bf16).
_QUIET_VLLM = "ERROR"


def guard_spawned_main() -> None:
    """Raise CorecapError when capture() runs at the top level of the main script, outside GUARD."""
    from corecap.errors import CorecapError

    main = sys.modules.get("__main__")
    script = getattr(main, "__file__", None)
    if getattr(multiprocessing.current_process(), "_inheriting", False):  # a spawned child re-running the script
        raise CorecapError(_guard_message(script or "the main script"))
    if not script or not script.endswith(".py") or not os.path.isfile(script):  # -c, a notebook, a REPL
        return
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name.split(".")[-1] == "__main__":  # `python -m package`: spawn does not re-run it
        return
    frame = sys._getframe(1)
    while frame is not None and not (frame.f_code.co_name == "<module>" and frame.f_globals is vars(main)):
        frame = frame.f_back
    if frame is not None and not _guarded(script, frame.f_lineno):
        raise CorecapError(_guard_message(script))


def _guard_message(script: str) -> str:
    return (f"corecap.capture() at the top level of {script}: vLLM's workers re-run the script when they start; "
            f"put the call under `{GUARD}`")


def _guarded(script: str, lineno: int) -> bool:
    """Whether the top-level statement at `lineno` of `script` is an `if` testing `__name__`."""
    try:
        with open(script, encoding="utf-8") as f:
            tree = ast.parse(f.read(), script)
    except (OSError, SyntaxError, ValueError):
        return True  # unreadable: multiprocessing's own check in the child stands
    for node in tree.body:
        if node.lineno <= lineno <= (node.end_lineno or node.lineno):
            return isinstance(node, ast.If) and any(
                isinstance(n, ast.Name) and n.id == "__name__" for n in ast.walk(node.test))
    return True


@contextlib.contextmanager
def api_logging(log=None):
    """For one capture: `say(line)`. Given `log`, corecap's lines go to it and vLLM's logging is
    left as it is (the CLI passes its run log, which keeps vLLM's whole log). Otherwise corecap's
    lines go to the `corecap` logger at INFO (to stderr while no handler is configured for it),
    and vLLM's logger, here and in its workers, shows errors only (VLLM_LOGGING_LEVEL, restored
    after), unless the user set VLLM_LOGGING_LEVEL."""
    logger = logging.getLogger(LOGGER)
    handler = None
    if log is None and not logger.hasHandlers():  # logging not configured: show them, as vLLM shows its own
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
    level = logger.level
    if log is None and logger.getEffectiveLevel() > logging.INFO:
        logger.setLevel(logging.INFO)
    quiet = log is None and "VLLM_LOGGING_LEVEL" not in os.environ
    vllm_logger = logging.getLogger("vllm")
    vllm_level = vllm_logger.level
    if quiet:
        # read by vLLM's logger when vLLM is imported, here and in the workers
        os.environ["VLLM_LOGGING_LEVEL"] = _QUIET_VLLM
        vllm_logger.setLevel(_QUIET_VLLM)  # vLLM already imported here: its logger is set already
    try:
        yield log or logger.info
    finally:
        if quiet:
            os.environ.pop("VLLM_LOGGING_LEVEL", None)
            vllm_logger.setLevel(vllm_level)
        logger.setLevel(level)
        if handler is not None:
            logger.removeHandler(handler)
