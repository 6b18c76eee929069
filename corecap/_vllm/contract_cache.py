"""The contract checks' verdict, kept per installed vLLM.

Every `corecap run` and `corecap serve` starts with contract.py's checks of vLLM's source, which
parse dozens of its modules (`corecap doctor` times them: 0.6 s on 2 cores). Once they all held,
the verdict is kept in corecap's cache directory (`CORECAP_CACHE`, or ~/.cache/corecap) with the
size and modification time of every file the checks read, and the next start reuses it while
nothing it depends on changed: those files, the vLLM and torch releases installed, the model's
architecture (the model-class check), and corecap's own code (the checks themselves). A verdict
that something moved is never kept, so such a run stops with the checks' own sentence every time;
`corecap doctor` always runs the checks.

A cache that cannot be read or written is the same as none: the checks run.
"""

from __future__ import annotations

import hashlib
import importlib.metadata as md
import json
import os
import tempfile

from corecap._vllm.vllm_source import Source

_FORMAT = 1


def verdict_path(source: Source, dist: str, version: str, architecture: str | None) -> str:
    """Where the verdict for this vLLM (`source`, its distribution and version), torch,
    architecture and corecap is kept."""
    from corecap.demo import cache_dir

    key = json.dumps({
        "format": _FORMAT, "vllm": [dist, version, os.path.realpath(source.root)],
        "replaced": sorted(source.replaced.items()), "torch": _version("torch"), "architecture": architecture,
        "corecap": _corecap_digest(),
    })
    return os.path.join(cache_dir(), "contract", hashlib.sha256(key.encode()).hexdigest()[:32] + ".json")


def holds(path: str) -> bool:
    """Whether the verdict at `path` (verdict_path) was that the contract held, with every file it
    read then unchanged since."""
    try:
        with open(path, encoding="utf-8") as f:
            files = json.load(f)["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    if not isinstance(files, dict) or not files:
        return False
    return all(_stat(path) == (stat if isinstance(stat, list) else None) for path, stat in files.items())


def keep(path: str, source: Source) -> None:
    """After every check held: keep that verdict at `path` (verdict_path), with the files `source`
    read for it."""
    files = {read: _stat(read) for read in source.files_read()}
    if not files or None in files.values():
        return
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".contract-", dir=os.path.dirname(path))
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump({"files": files}, f)
        os.replace(tmp, path)
    except OSError:
        pass


def _stat(path: str) -> list[int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return [st.st_size, st.st_mtime_ns]


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def _corecap_digest() -> str:
    """corecap's own Python source: a change to any check (or to what a check imports from
    corecap) is a new verdict."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    paths = sorted(os.path.join(folder, name) for folder, _, names in os.walk(root) for name in names
                   if name.endswith(".py"))
    digest = hashlib.sha256()
    for path in paths:
        digest.update(os.path.relpath(path, root).encode() + b"\0")
        with open(path, "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()
