"""`corecap doctor` and `corecap run` on the GPU releases the CPU tests cannot run: plain `vllm` 0.33.0
and 0.34.0 pin torch 2.14.0 with CUDA (the CPU tests run the CPU torch).
Their source is what can be checked, as on an install: each wheel's Python files and metadata are
unpacked (vLLM's code never runs) and put first on PYTHONPATH, where Python and
importlib.metadata find that vLLM as they would an installed one. The source checks must all
hold but the torch pin, and the runner check must find the generations the wheel ships.

The wheels come from CI's wheel cache, which .ci/gpu_wheels.sh fills (or CORECAP_GPU_WHEELS, a
directory); without one a test skips here and fails under CI=true."""

from __future__ import annotations

import email.parser
import glob
import importlib.metadata as md
import os
import subprocess
import sys
import zipfile

import pytest
from packaging.requirements import Requirement

from corecap._vllm import contract, versions
from support.machine import in_ci
from support.reference import write_jsonl

RELEASES = versions.READ_NOT_RUN["vllm"]  # what .ci/gpu_wheels.sh downloads
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def wheel_dir() -> str:
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.environ.get("CORECAP_GPU_WHEELS") or os.path.join(cache, "corecap-ci", "wheels")


@pytest.fixture(scope="module", params=RELEASES)
def release(request, tmp_path_factory) -> tuple[str, str, set[str], str]:
    """(version, the unpacked tree, the wheel's file names, its METADATA text)."""
    version = request.param
    found = sorted(glob.glob(os.path.join(wheel_dir(), f"vllm-{version}-*.whl")))
    if not found:
        message = f"no vllm-{version} wheel in {wheel_dir()} (.ci/gpu_wheels.sh downloads it)"
        if in_ci():
            pytest.fail(f"{message} (CI=true: mandatory)", pytrace=False)
        pytest.skip(message)
    root = str(tmp_path_factory.mktemp(f"vllm-{version}"))
    info = f"vllm-{version}.dist-info/"
    with zipfile.ZipFile(found[-1]) as wheel:
        names = set(wheel.namelist())
        wheel.extractall(root, [n for n in names if (n.startswith("vllm/") and n.endswith(".py"))
                                or n.startswith(info)])
        metadata = wheel.read(f"{info}METADATA").decode()
    return version, root, names, metadata


def _corecap(root: str, *args: str, cwd: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([_ROOT, root])}
    # liveness only: the source checks take about a second, and nothing imports vLLM
    return subprocess.run([sys.executable, "-m", "corecap.cli", *args], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=120)


def _torch_pin(metadata: str) -> Requirement:
    """The wheel's own `Requires-Dist: torch...`, read from its METADATA (not by corecap)."""
    requires = email.parser.Parser().parsestr(metadata).get_all("Requires-Dist") or []
    (pin,) = [r for r in map(Requirement, requires) if r.name == "torch" and r.marker is None]
    return pin


def _moved_by_torch(version: str, metadata: str) -> list[str]:
    pin, torch = _torch_pin(metadata), md.version("torch")
    if pin.specifier.contains(torch, prereleases=True):
        return []
    return [f"moved  vllm {version}: torch {torch} is installed, but vllm {version} pins torch{pin.specifier}"]


def test_doctor_on_the_wheels_source(release):
    version, root, names, metadata = release
    result = _corecap(root, "doctor")
    lines = result.stdout.splitlines()
    moved = _moved_by_torch(version, metadata)
    assert result.returncode == (1 if moved else 0), result.stdout + result.stderr
    assert lines[0].startswith(f"vllm {version}, torch {md.version('torch')}, Python ")
    assert lines[0].endswith(f"warning: {versions.version_warning('vllm', version)}")
    assert "its code was read against corecap's contract" in lines[0]
    assert [line for line in lines if line.startswith("moved")] == moved
    assert len([line for line in lines if line.startswith("ok     ")]) == len(contract.CHECKS) - len(moved)
    (worker,) = [line for line in lines if line.startswith("ok     worker class")]
    assert worker.endswith(": vllm.v1.worker.gpu_worker.Worker (vllm/platforms/cuda.py)")
    (runner,) = [line for line in lines if line.startswith("ok     model runner")]
    v2 = contract.RUNNERS[(False, True)]
    if "vllm/v1/worker/gpu_model_runner.py" in names:  # the wheel still ships the V1 runner
        assert runner.endswith(f"V1 runner {contract.RUNNERS[(False, False)]} and V2 runner {v2}; "
                               "a run checks the one its configuration picks")
    else:
        assert runner.endswith(f"V2 runner {v2} alone: the V1 runner is gone (vLLM 0.34+)")


def test_the_wheels_workers_end_with_their_shutdown(release):
    """What corecap/_vllm/worker_end.py relies on, in each release's worker_main."""
    from corecap._vllm.vllm_source import Source
    from corecap._vllm.worker_end import worker_main_problem

    version, root, _, _ = release
    assert worker_main_problem(Source(os.path.join(root, "vllm"))) is None, version


def test_run_checks_the_wheels_source_before_vllm_loads(release, tiny_model, tmp_path):
    """A run makes the same checks first: on torch 2.13 it stops at the torch pin, before vLLM
    (which could not import here) or the model loads; on the torch it pins it would go on."""
    version, root, _, metadata = release
    moved = _moved_by_torch(version, metadata)
    if not moved:
        pytest.skip(f"torch {md.version('torch')} is the one vllm {version} pins: a run would start vLLM")
    data = write_jsonl(tmp_path / "data.jsonl", [{"id": "a", "input_ids": [1, 2, 3]}])
    result = _corecap(root, "run", "--model", tiny_model, "--data", data, "--store", str(tmp_path / "store"))
    lines = result.stdout.splitlines() + result.stderr.splitlines()
    assert result.returncode == 2, result.stdout + result.stderr
    assert f"warning: {versions.version_warning('vllm', version)}" in lines
    problem = moved[0].removeprefix("moved  ")
    assert lines[-1].startswith(f"corecap: error: the installed vLLM does not fit corecap: {problem} "
                                f"(known to work: {versions.known_good_line()}; see `corecap doctor`); "
                                "no store was made")
    assert not (tmp_path / "store").exists()
