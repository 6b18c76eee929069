"""The trainers' packages some tests read exports with, each with the line that installs it beside
vLLM (README, "Train a draft head": without its dependencies, which would replace vLLM's torch).
A test that needs one skips, naming that line, where it is missing; under CI=true (.ci/run installs
them) it fails instead (support/machine.py)."""

from __future__ import annotations

import importlib.util

import pytest

from support.machine import in_ci

INSTALL = {
    "speculators": 'pip install --no-deps speculators==0.9.0 hs-connectors==0.9.0 && pip install "datasets>=4,<=5.1.0"',
    "specforge": 'pip install --no-deps specforge==0.2.0 && pip install "datasets>=4,<=5.1.0"',
    "modelopt": 'pip install --no-deps nvidia-modelopt==0.47.0 && pip install "omegaconf>=2.3.0" "pulp<4.0" scipy',
}


def require_trainer(module: str) -> None:
    """Skip the calling test (fail it under CI=true) unless the trainer's package `module` is installed."""
    if importlib.util.find_spec(module) is not None:
        return
    message = f"{module} is not installed; install it with: {INSTALL[module]}"
    if in_ci():
        pytest.fail(f"{message} (CI=true: mandatory)", pytrace=False)
    pytest.skip(message)
