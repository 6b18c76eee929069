"""One configuration a process: a benchmark runs itself again as a child (`python -m MODULE --one
NAME ...`), so every engine starts in a fresh process and its peak RSS is its own. The child
prints its result as one line `RESULT {json}`; the parent reads the last such line.

The hidden options `--one`, `--model`, `--data`, `--workdir` carry what the parent built."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PREFIX = "RESULT "


def add_child_options(ap: argparse.ArgumentParser) -> None:
    """The options only a child is given (hidden from --help)."""
    for name in ("--one", "--model", "--data", "--workdir"):
        ap.add_argument(name, default=None, help=argparse.SUPPRESS)


def parse_or_answer(ap: argparse.ArgumentParser, one) -> argparse.Namespace | None:
    """The parsed options of the parent; a child (given --one) prints `one(args)` as its RESULT and
    gets None: `args = parse_or_answer(ap, one)`, then `if args is None: return`."""
    add_child_options(ap)
    args = ap.parse_args()
    if args.one:
        report(one(args))
        return None
    return args


def report(result: dict) -> None:
    """The child's answer: its last line on stdout."""
    print(PREFIX + json.dumps(result), flush=True)


def child_env(extra: dict | None = None) -> dict:
    """This environment, with the repository root on PYTHONPATH so that `-m tools...` resolves
    from any working directory."""
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, **(extra or {})}


def run_child(module: str, args: list[str], timeout: float,
              env: dict | None = None) -> tuple[dict, subprocess.CompletedProcess]:
    """Run `python -m module args...`; its RESULT and the finished process. A child that failed or
    printed no RESULT ends the benchmark with its stderr's tail."""
    cmd = [sys.executable, "-m", module, *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=child_env(env), timeout=timeout)
    results = [line.removeprefix(PREFIX) for line in proc.stdout.splitlines() if line.startswith(PREFIX)]
    if proc.returncode != 0 or not results:
        raise SystemExit(f"{' '.join(args[:2])} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(results[-1]), proc


def append_jsonl(path: str, record: dict) -> None:
    """One result a line, appended: a benchmark interrupted keeps what it measured. The folder is
    made if missing (a child's record, or a failed one's, must not be lost to a mistyped `--out`)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def command_line() -> str:
    """This process's command as docs/benchmarks.md writes it: `python -m tools.bench.NAME ...`."""
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    head = ["python", "-m", spec.name] if spec is not None else ["python", sys.argv[0]]
    return shlex.join([*head, *sys.argv[1:]])


def run_bounded(cmd: list[str], timeout: float, env: dict | None = None) -> tuple[int | str, str]:
    """Run `cmd` in a process group of its own; (exit status or "timeout", stderr). At the timeout
    the whole group is killed: a corecap run's engine core, workers and sink are its grandchildren,
    and killing only the child left them holding the GPU, so that the next run found no memory."""
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                          start_new_session=True) as proc:
        try:
            _, err = proc.communicate(timeout=timeout)
            return proc.returncode, err
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            _, err = proc.communicate()
            return "timeout", f"timeout after {timeout:.0f}s: {err[-2000:]}"


def free_port() -> int:
    """A TCP port free on the loopback interface now (for a server the benchmark starts)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, server: subprocess.Popen, timeout: float) -> bool:
    """Whether the server started as `server` answers `url`/health within `timeout` seconds; False
    as soon as it exits. Asked once a second: an engine's start takes minutes, not milliseconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and server.poll() is None:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2):
                return True
        except OSError:  # refused while it starts; urllib's HTTPError is one too
            time.sleep(1)
    return False
