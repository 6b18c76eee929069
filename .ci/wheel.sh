#!/usr/bin/env bash
# CI's release check (.ci/run calls it after the install): `python -m build` makes the sdist and
# the wheel, the wheel installs into a fresh virtual environment, and there, from a directory
# outside the checkout (so the checkout is not on sys.path), `corecap --version` and `corecap
# doctor` run on the wheel's own files, its package data included.
#
# The venv is layered on the main install the way .ci/matrix.sh layers its venvs (a .pth file
# adds the main install's site-packages after the venv's own): torch, vLLM and corecap's other
# dependencies come from there, so nothing is downloaded again, and the wheel is installed with
# --no-deps. The venv's own site-packages come first on sys.path, so its corecap shadows the
# main install's (editable or not); the script checks that `import corecap` finds the wheel's.
# The build runs without isolation: the main install's setuptools (pyproject.toml's
# build-system requirement, which `build` checks) builds it, with no download.
#
#   bash .ci/wheel.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1
start=$SECONDS
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m build --no-isolation --sdist --wheel --outdir "$tmp/dist" . > "$tmp/build.log" 2>&1 || {
    cat "$tmp/build.log"; exit 1; }
wheel=$(ls "$tmp"/dist/corecap-*.whl)
sdist=$(ls "$tmp"/dist/corecap-*.tar.gz)
echo "built $(basename "$sdist") and $(basename "$wheel")"
# The package data the demo and type checkers need, inside the wheel and the sdist:
python3 - "$wheel" "$sdist" <<'EOF'
import sys, tarfile, zipfile
wheel, sdist = sys.argv[1:]
names = set(zipfile.ZipFile(wheel).namelist())
missing = [n for n in ("corecap/demo_data.jsonl", "corecap/py.typed", "corecap/cli/__init__.py") if n not in names]
assert not missing, f"{wheel} lacks {missing}"
assert not any(n.startswith(("tests/", "tools/")) for n in names), f"{wheel} holds tests/ or tools/"
sdist_names = {n.split("/", 1)[-1] for n in tarfile.open(sdist).getnames()}
missing = [n for n in ("corecap/demo_data.jsonl", "corecap/py.typed", "pyproject.toml") if n not in sdist_names]
assert not missing, f"{sdist} lacks {missing}"
EOF
BASE=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")  # the main install
python3 -m venv --without-pip "$tmp/venv"
py="$tmp/venv/bin/python"
site=$("$py" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
echo "import site; site.addsitedir('$BASE')" > "$site/corecap-ci-base.pth"
"$py" -m pip install -q --no-deps "$wheel"
mkdir "$tmp/elsewhere"
cd "$tmp/elsewhere"
# PYTHONPATH would put a checkout ahead of the venv: the check is of the wheel alone.
found=$(env -u PYTHONPATH "$py" -c "import corecap; print(corecap.__file__)")
case "$found" in
    "$site"/corecap/__init__.py) echo "import corecap: $found (the wheel's)" ;;
    *) echo "import corecap found $found, not the wheel's (under $site)"; exit 1 ;;
esac
env -u PYTHONPATH "$tmp/venv/bin/corecap" --version
env -u PYTHONPATH "$tmp/venv/bin/corecap" doctor
echo "wheel check done in $((SECONDS - start)) s"
