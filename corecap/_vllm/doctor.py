"""`corecap doctor`, and the same checks at the start of every run: vLLM's contract checked before
any weights load.

doctor reads vLLM's installed source (contract.py, vllm_source.py) and the installed packages'
metadata (torchvision, torchaudio and torchcodec built for another torch break `import vllm`:
versions.companion_problems), and imports neither vLLM nor torch, whose import takes many times
longer (measured: docs/versions.md, "How long doctor takes"). The
checks that need vLLM's objects (live.py) run at the start of
every run, where vLLM is imported anyway, and in `corecap doctor --deep`, which builds the engine
configuration for a config.json alone (without `--model`: a small dense Llama, as vLLM would
build it on the machine doctor runs on).
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import platform
import shutil
import tempfile
import time
from dataclasses import dataclass

from corecap._vllm import contract, contract_cache, live, versions
from corecap._vllm.vllm_source import Source
from corecap.errors import CorecapError

_PROBE_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128, "intermediate_size": 256,
    "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 512,
    "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "torch_dtype": "float32",
}
_PROBE = "a config.json alone (2-layer Llama, no weights)"


@dataclass(frozen=True, kw_only=True)
class Report:
    dist: str
    version: str
    results: list  # contract.Result
    model: str  # what the model class check was made against
    deep: bool  # vLLM imported, and live.py's checks made
    source_s: float  # reading vLLM's source and checking it
    import_s: float  # --deep: `import vllm` and the modules the live checks use
    total_s: float  # since the command started (the interpreter's own start not included)
    companions: tuple = ()  # (distribution, why) of torch's companions that do not fit torch

    @property
    def num_moved(self) -> int:
        """What fails: contract checks that found something moved, and companions that do not fit."""
        return sum(1 for r in self.results if r.problem) + len(self.companions)

    def lines(self) -> list[str]:
        warning = versions.version_warning(self.dist, self.version)
        out = [f"{self.dist} {self.version}, torch {_version('torch')}, Python {platform.python_version()}: "
               + (f"warning: {warning}" if warning else f"tested (known to work: {versions.known_good_line()})")]
        for _, why in self.companions:
            out.append(f"broken {why} (a companion built for another torch breaks `import vllm`)")
        for r in self.results:
            if r.problem:
                out.append(f"moved  {self.dist} {self.version}: {r.problem}")
            else:
                out.append(f"ok     {r.name}" + (f": {r.note}" if r.note else ""))
        num_moved = sum(1 for r in self.results if r.problem)
        verdict = f"all {len(self.results)} checks hold"
        if num_moved:
            verdict = (f"{num_moved} of {len(self.results)} checks found something moved; "
                       f"known to work: {versions.known_good_line()}")
        if self.deep:
            how = (f"{self.source_s:.1f} s reading vLLM's source, {self.import_s:.1f} s importing vLLM, "
                   f"{self.total_s - self.source_s - self.import_s:.1f} s of live checks")
        else:
            how = (f"{self.source_s:.1f} s reading vLLM's source, vLLM not imported; "
                   f"{len(live.names())} checks need it imported: `corecap doctor --deep`, "
                   "and the start of every `corecap run`, make them")
        out.append(f"corecap doctor: {verdict} (model: {self.model}) in {self.total_s:.1f} s: {how}")
        if self.companions:
            names = [name for name, _ in self.companions]
            out.append(f"corecap doctor: {' and '.join(names)} do not fit the installed torch; "
                       "vLLM imports without them, so remove them:")
            out.append(f"    pip uninstall -y {' '.join(names)}")
        return out


def _version(dist: str) -> str:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return "not installed"


def doctor(model: str | None = None, deep: bool = False, started: float | None = None) -> Report:
    """Check the installed vLLM against corecap's contract; no GPU, no weights, no engine, and
    unless `deep`, no vLLM import. `started`: the time.perf_counter() the command started at."""
    t0 = time.perf_counter() if started is None else started
    source = Source()
    dist, version = versions.installed_vllm()
    results = contract.check_contract(source, model_architecture(model))
    companions = tuple(versions.companion_problems())
    t1 = time.perf_counter()
    what = model or _PROBE
    if not deep:
        return Report(
            dist=dist, version=version, results=results, model=what, deep=False, source_s=t1 - t0, import_s=0.0,
            total_s=t1 - t0, companions=companions,
        )
    problem = versions.vllm_import_problem()
    t2 = time.perf_counter()
    if problem:
        failed = results + [contract.Result("import vllm", problem)]
        return Report(
            dist=dist, version=version, results=failed, model=what, deep=True, source_s=t1 - t0, import_s=t2 - t1,
            total_s=t2 - t0, companions=companions,
        )
    results = results + _live_results(source, model)
    return Report(
        dist=dist, version=version, results=results, model=what, deep=True, source_s=t1 - t0, import_s=t2 - t1,
        total_s=time.perf_counter() - t0, companions=companions,
    )


def _live_results(source: Source, model: str | None) -> list:
    from corecap._vllm.options import build_vllm_config, environment
    from corecap.config import EngineOptions

    results = live.check_live(source)
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
                return results + [contract.Result("the engine configuration builds", str(e))]
            return results + live.check_live(source, config)
    finally:
        if probe:
            shutil.rmtree(probe, ignore_errors=True)


def model_architecture(model: str | None) -> str | None:
    """The architecture a model's config.json names (a directory, or a model id in the local HF
    cache), without vLLM; the probe's without a model; None where the config names none."""
    if model is None:
        return _PROBE_CONFIG["architectures"][0]
    path = os.path.join(model, "config.json")
    if not os.path.isfile(path):
        try:
            from huggingface_hub import try_to_load_from_cache

            path = try_to_load_from_cache(model, "config.json")
        except Exception:  # not an id huggingface_hub accepts
            path = None
        if not isinstance(path, str):
            raise CorecapError(f"--model {model}: no config.json there "
                               "(a model directory, or a model id in the local HF cache)")
    try:
        with open(path, encoding="utf-8") as f:
            architectures = json.load(f).get("architectures") or []
    except (OSError, ValueError, AttributeError) as e:
        raise CorecapError(f"{path}: not a readable JSON object ({type(e).__name__}: {e})") from None
    return architectures[0] if architectures and isinstance(architectures[0], str) else None


def checked_vllm_config(options, model: str, log, layers=None, images: bool = False):
    """The start of a run: vLLM's contract checked on its source (a CorecapError naming what
    moved, before vLLM is even imported; the verdict is kept once it held: contract_cache.py),
    an untested version warned about, then vLLM imported,
    the live checks, the engine configuration (no weights) and what it makes vLLM build;
    `layers`: what the preflight checks the model class can give (build_vllm_config)."""
    from corecap._vllm.options import build_vllm_config

    source = Source()
    dist, version = versions.installed_vllm()
    warning = versions.version_warning(dist, version)
    if warning:
        log(f"warning: {warning}")
    architecture = model_architecture(model)
    verdict = contract_cache.verdict_path(source, dist, version, architecture)
    if not contract_cache.holds(verdict):
        _stop_if_moved(contract.check_contract(source, architecture))
        contract_cache.keep(verdict, source)
    versions.import_vllm()
    _stop_if_moved(live.check_live(source))
    if images:  # what only an input with images needs (contract._images notes it for the others)
        moved = contract.run_check("images", contract.images_problem, source)
        if moved.problem:
            raise CorecapError(f"the input has images, and this vLLM's multimodal input path moved: {moved.problem} "
                               f"(known to work: {versions.known_good_line()})")
    config = build_vllm_config(options, model, layers, images)
    _stop_if_moved(live.check_live(source, config))
    return config


def moved_line(results: list) -> str | None:
    """One sentence naming everything that moved, with the vLLM version, or None."""
    problems = [r.problem for r in results if r.problem]
    if not problems:
        return None
    dist, version = versions.installed_vllm()
    known = versions.known_good_line()
    return f"{dist} {version}: {'; '.join(problems)} (known to work: {known}; see `corecap doctor`)"


def _stop_if_moved(results: list) -> None:
    line = moved_line(results)
    if line:
        raise CorecapError(f"the installed vLLM does not fit corecap: {line}")
