"""`corecap doctor`, and the same checks at the start of every run: vLLM's contract
(corecap/_vllm/contract.py) checked before any weights load, timed apart from vLLM's import.

Without a model, the configured checks (the runner, the model's class) are made against a
config.json alone: a small dense Llama, as vLLM would build it on this machine.
"""

from __future__ import annotations

import ast
import importlib
import importlib.metadata as md
import inspect
import json
import os
import platform
import shutil
import tempfile
import time
from dataclasses import dataclass

from corecap._vllm import contract
from corecap._vllm.options import build_vllm_config, environment
from corecap._vllm.versions import installed_dist, installed_vllm, known_good_line, version_warning, vllm_import_problem
from corecap.config import EngineOptions
from corecap.errors import CorecapError

_PROBE_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128, "intermediate_size": 256,
    "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 512,
    "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "torch_dtype": "float32",
}


@dataclass(frozen=True)
class Report:
    dist: str
    version: str
    results: list  # contract.Result
    model: str  # what the configured checks were made against
    import_s: float  # `import vllm` (with torch when `started` is given: corecap imports torch first)
    modules_s: float  # importing the vLLM modules contract.py reads (a run imports most of them anyway)
    checks_s: float  # the checks, with the engine configuration and the worker's, runner's, model's modules

    @property
    def num_moved(self) -> int:
        return sum(1 for r in self.results if r.problem)

    def lines(self) -> list[str]:
        warning = version_warning(self.dist, self.version)
        out = [f"{self.dist} {self.version}, torch {md.version('torch')}, Python {platform.python_version()}: "
               + (f"warning: {warning}" if warning else f"tested (known to work: {known_good_line()})")]
        for r in self.results:
            if r.problem:
                out.append(f"moved  {self.dist} {self.version}: {r.problem}")
            else:
                out.append(f"ok     {r.name}" + (f": {r.note}" if r.note else ""))
        verdict = (f"{self.num_moved} of {len(self.results)} checks found something moved; known to work: {known_good_line()}"
                   if self.num_moved else f"all {len(self.results)} checks hold")
        out.append(f"corecap doctor: {verdict} (model: {self.model}); {self.checks_s:.1f} s of checks after "
                   f"{self.import_s + self.modules_s:.1f} s importing vLLM ({self.import_s:.1f} s torch and `import vllm`)")
        return out


def doctor(model: str | None = None, started: float | None = None) -> Report:
    """Check the installed vLLM against corecap's contract; no GPU, no weights, no engine.
    `started`: the time.perf_counter() before the caller imported corecap (and so torch)."""
    t0 = time.perf_counter() if started is None else started
    problem = vllm_import_problem()  # timed apart: most of doctor's time on a slow machine
    if problem:
        return Report(*installed_dist(), [contract.Result("import vllm", problem)], model or "-", time.perf_counter() - t0, 0.0, 0.0)
    t1 = time.perf_counter()
    for module in _contract_modules():
        try:
            importlib.import_module(module)
        except ImportError:
            pass  # a module that moved: the check that reads it says so
    t2 = time.perf_counter()
    dist, version = installed_vllm()
    results = contract.check_contract()
    probe = None
    if model is None:
        probe = tempfile.mkdtemp(prefix="corecap-doctor-")
        with open(os.path.join(probe, "config.json"), "w") as f:
            json.dump(_PROBE_CONFIG, f)
    try:
        with environment():
            try:
                config = build_vllm_config(EngineOptions(), model or probe)
            except CorecapError as e:
                results.append(contract.Result("the engine configuration builds", str(e)))
            else:
                results += contract.check_contract(config)
    finally:
        if probe:
            shutil.rmtree(probe, ignore_errors=True)
    what = model or "a config.json alone (2-layer Llama, no weights)"
    return Report(dist, version, results, what, t1 - t0, t2 - t1, time.perf_counter() - t2)


def _contract_modules() -> list[str]:
    """The vLLM modules contract.py imports (inside its checks), to time their import apart."""
    tree = ast.parse(inspect.getsource(contract))
    return sorted({n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("vllm.")})


def checked_vllm_config(options: EngineOptions, model: str, log, layers=None):
    """The start of a run: vLLM's contract checked (a CorecapError naming what moved), an untested
    version warned about, then the engine configuration (no weights) and what it makes vLLM build;
    `layers`: what the preflight checks the model class can give (build_vllm_config)."""
    dist, version = installed_vllm()
    warning = version_warning(dist, version)
    if warning:
        log(f"warning: {warning}")
    _stop_if_moved(contract.check_contract())
    config = build_vllm_config(options, model, layers)
    _stop_if_moved(contract.check_contract(config))
    return config


def moved_line(results: list) -> str | None:
    """One sentence naming everything that moved, with the vLLM version, or None."""
    problems = [r.problem for r in results if r.problem]
    if not problems:
        return None
    dist, version = installed_vllm()
    return f"{dist} {version}: {'; '.join(problems)} (known to work: {known_good_line()}; see `corecap doctor`)"


def _stop_if_moved(results: list) -> None:
    line = moved_line(results)
    if line:
        raise CorecapError(f"the installed vLLM does not fit corecap: {line}")
