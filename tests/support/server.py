"""`corecap serve` as a user starts it: `python -m corecap.cli serve ...` in a process of its
own, on a free localhost port, waited for until /health answers, stopped with SIGTERM."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

_START_TIMEOUT_S = 600  # an engine start on 2 busy cores


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, *args: str, hidden_states_path: str, log_path: str, cwd: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.hidden_states_path = hidden_states_path
        self.log_path = log_path
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "corecap.cli", "serve", "--port", str(self.port),
             "--hidden-states-path", hidden_states_path, *args],
            cwd=cwd, stdout=self.log, stderr=subprocess.STDOUT, env=os.environ.copy(),
        )
        try:
            self._wait_until_healthy()
        except BaseException:
            self.stop()
            raise

    def _wait_until_healthy(self) -> None:
        deadline = time.monotonic() + _START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"corecap serve exited ({self.proc.returncode}):\n{self.output()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1)
        raise AssertionError(f"corecap serve did not answer /health in {_START_TIMEOUT_S} s:\n{self.output()[-3000:]}")

    def output(self) -> str:
        if not self.log.closed:
            self.log.flush()
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def stop(self, timeout: float = 120) -> int:
        """SIGTERM, as a process manager stops it; its exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


class MooncakeMaster:
    """Mooncake's master on a free localhost port, as a trainer's cluster runs one."""

    def __init__(self, log_path: str):
        import shutil

        binary = shutil.which("mooncake_master") or os.path.join(os.path.dirname(sys.executable), "mooncake_master")
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen([binary, f"--rpc_port={self.port}", f"--metrics_port={free_port()}"],
                                     stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            if self.proc.poll() is not None:
                raise AssertionError(f"mooncake_master exited ({self.proc.returncode}): see {log_path}")
            time.sleep(0.2)
        self.stop()
        raise AssertionError(f"mooncake_master did not listen on {self.address} in 30 s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
