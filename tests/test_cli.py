"""The CLI as a user meets it: `corecap run` with no arguments (the built-in demo), then get/ls/info."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from support.reference import engine_line


def corecap(*args, cwd, env_extra=None, check=True):
    import os

    env = {**os.environ, **(env_extra or {})}
    result = subprocess.run([sys.executable, "-m", "corecap.cli", *args], cwd=cwd, env=env, capture_output=True,
                            text=True, timeout=900)
    if check and result.returncode != 0:
        raise AssertionError(f"corecap {' '.join(args)} failed ({result.returncode}):\n{result.stderr[-3000:]}")
    return result


@pytest.fixture(scope="module")
def demo_store(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("demo")
    env = {"CORECAP_CACHE": str(cwd / "cache")}
    result = corecap("run", cwd=cwd, env_extra=env)
    return cwd, env, result


@pytest.mark.engine
def test_demo_run_then_get(demo_store):
    cwd, env, result = demo_store
    assert "corecap.lmdb: committed 23 samples" in result.stdout
    keys = corecap("ls", cwd=cwd).stdout.split()
    assert len(keys) == 23 and "demo-long" in keys
    out = corecap("get", "demo-long", "--out", "x.safetensors", cwd=cwd).stdout
    # The default layers: EAGLE-3's three, N after the final norm and the pre-norm final state.
    assert "demo-long:" in out and "layers [2, 4, 5, 8, 'prenorm']" in out
    from safetensors import safe_open

    with safe_open(str(cwd / "x.safetensors"), "pt") as f:
        assert json.loads(f.metadata()["layers"]) == [2, 4, 5, 8, "prenorm"]
        ids, hs = f.get_tensor("input_ids"), f.get_tensor("hidden_states")
    assert ids.dtype == torch.int64 and hs.shape == (5, len(ids), 128)
    assert float((hs[4] - hs[3]).norm() / hs[3].norm()) > 1e-2  # prenorm is not layer N again
    info = json.loads(corecap("info", cwd=cwd).stdout)
    assert info["num_samples"] == 23 and info["layers"] == [2, 4, 5, 8, "prenorm"] and info["format_version"] == 3
    assert "prenorm = the residual stream after the last decoder layer, before the final norm" in info["layer_meaning"]
    assert info["model"]["weights_fingerprint"] and info["vllm_version"]


@pytest.mark.engine
def test_errors_are_one_line(demo_store):
    cwd, env, _ = demo_store
    r = corecap("get", "no-such-key", cwd=cwd, check=False)
    assert r.returncode == 2 and r.stderr.strip() == "corecap: error: corecap.lmdb: no sample with key 'no-such-key'"
    r = corecap("run", "--layers", "2,x", cwd=cwd, env_extra=env, check=False)
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1] == (
        "corecap: error: --layers '2,x': expected comma-separated integers or 'prenorm', e.g. 2,16,29,32,prenorm"
    )


def test_get_on_a_missing_store(tmp_path):
    r = corecap("get", "k", "--store", str(tmp_path / "none"), cwd=tmp_path, check=False)
    assert r.returncode == 2 and "not a corecap store" in r.stderr


@pytest.mark.engine
def test_a_quiet_terminal_and_the_whole_log_in_the_store(demo_store):
    """corecap's own lines and the summary on the terminal (the effective engine settings first);
    vLLM's log, the workers' included, in STORE/corecap.log."""
    cwd, env, result = demo_store
    lines = result.stderr.splitlines()
    first = engine_line(lines)
    assert first.startswith("engine: ") and "tokens per step" in first, lines[:3]
    assert len(lines) <= 8 and not any(" INFO " in line or "WARNING" in line for line in lines), result.stderr
    log = (cwd / "corecap.lmdb" / "corecap.log").read_text()
    assert "Resolved architecture" in log  # the driver's vLLM log
    assert "Injected <class 'corecap._vllm.worker.CaptureExtension'>" in log  # a worker process's line
    assert first in log and result.stdout.strip() in log
