"""The reference pages generated from the code (docs/reference/: the CLI's `--help`, the Python
API's docstrings, every error message) are what `python -m tools.reference` writes today."""

from __future__ import annotations

import ast
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_reference_pages_are_current():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, "-m", "tools.reference", "--check"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, (
        f"docs/reference/ is stale: regenerate it with `python -m tools.reference`\n{result.stderr}")


def test_api_reference_covers_every_export():
    tree = ast.parse((ROOT / "corecap" / "__init__.py").read_text())
    exported = next(ast.literal_eval(node.value) for node in tree.body
                    if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "__all__")
    reference = ast.parse((ROOT / "tools" / "reference.py").read_text())
    table = next(node.value for node in reference.body
                 if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "API")
    documented = {key.value for key in table.keys}
    missing = set(exported) - {"__version__"} - documented
    assert not missing, (f"tools/reference.py's API table lacks {sorted(missing)}: add them, "
                         "then `python -m tools.reference`")
