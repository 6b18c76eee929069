"""README's hand-off ("Export to a trainer") as a user runs it: on the quick start's store (conftest's
`demo_store`: `corecap run` with no arguments), every `$ corecap export ...` and `$ python
examples/...` line of that section runs as written, in order, and prints what README shows after
it (an export's time and rates aside). The examples are the trainers' own loaders (speculators,
SpecForge, ModelOpt), installed as README says.
"""

from __future__ import annotations

import pathlib
import re
import shlex
import subprocess
import sys

import pytest

from support.cli import corecap
from support.trainers import require_trainer

# the demo's engine run (shared with test_cli, asked for by name: `engine` is marked here) and ~1 min of
# trainers' imports
pytestmark = [pytest.mark.full, pytest.mark.engine]

ROOT = pathlib.Path(__file__).resolve().parent.parent
SECTION = "## Export to a trainer"
TIMING = re.compile(r"in [\d.]+s \([\d.]+ GB/s, [\d.]+ samples/s\)")


def readme_runs() -> list[tuple[str, list[str]]]:
    """Each `$ command` of README's hand-off section (its comment dropped) and the lines shown after it."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index(SECTION) + len(SECTION):]
    section = section[: section.index("\n## ")]
    runs: list[tuple[str, list[str]]] = []
    shown = None  # the lines of the command being read; a line outside the block ends it
    for line in section.splitlines():
        if line.startswith("    $ "):
            shown = []
            runs.append((line[6:].split("  #")[0].strip(), shown))
        elif shown is not None and line.startswith("    "):
            shown.append(line[4:])
        else:
            shown = None
    return runs


def _same(lines: list[str]) -> list[str]:
    return [TIMING.sub("in Ts (R GB/s, S samples/s)", line) for line in lines]


def test_readme_shows_every_format_and_example():
    commands = [command for command, _ in readme_runs()]
    for fmt in ("speculators", "specforge", "modelopt", "specforge-dspark", "deepspec"):
        assert any(c.startswith(f"corecap export --format {fmt} ") for c in commands), fmt
    for script in LOADERS:
        assert any(c.startswith(f"python examples/{script} ") for c in commands), script


LOADERS = {"load_spec.py": "speculators", "load_sf.py": "specforge", "load_mo.py": "modelopt"}  # what each imports


def test_readme_hand_off_runs_as_shown(request):
    for trainer in LOADERS.values():  # before the demo's run: a missing trainer skips, naming its install line
        require_trainer(trainer)
    cwd, env, _ = request.getfixturevalue("demo_store")
    runs = readme_runs()
    assert runs
    for command, shown in runs:
        args = shlex.split(command)
        if args[0] == "corecap":
            result = corecap(*args[1:], cwd=cwd, env_extra=env)
            printed = (result.stderr + result.stdout).splitlines()
            assert _same(printed) == _same(shown), f"$ {command}\n" + "\n".join(printed)
        else:
            assert args[0] == "python" and args[1].startswith("examples/"), command
            result = subprocess.run([sys.executable, str(ROOT / args[1]), *args[2:]], cwd=cwd, capture_output=True,
                                    text=True, timeout=600)
            assert result.returncode == 0, f"$ {command}\n{result.stderr[-3000:]}"
            assert result.stdout.splitlines() == shown, f"$ {command}\n{result.stdout}"
