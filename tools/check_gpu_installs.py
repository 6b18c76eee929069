"""Check README's GPU install lines ("Export to a trainer": the table's `pip install ".[cuda]"`
column) by pip's dependency resolution, in CPU-only virtual environments: what a trainer's line
installs does not depend on a GPU being there.

    python3 tools/check_gpu_installs.py --vllm 0.34.0 0.33.0 0.26.0      # one release after another

First, what README's `pip install ".[cuda]"` alone resolves to in a fresh venv (a dry run). Then,
for each vLLM release: a fresh `python3.11 -m venv`, `pip install vllm==X`, then README's GPU
install of corecap (`pip install ".[cuda]"` from this checkout): the base. Then, for each trainer
row of README's table, a hard-linked copy of the base (`cp -al`: seconds, no second download) in
which the trainer's GPU line runs as written. After each: `pip check`, the `pip list` diff against
the base (torch, vLLM and the nvidia-* packages must not move, nothing may be removed),
`import torch, vllm, corecap` and the trainer's loader from examples/ imported (run_path, not
run: there is no export to read). One verdict line per trainer and release at the end.

pip runs as a new user's would: the local pip configuration (local wheel directories, constraints)
is set aside, so everything comes from PyPI. A pin of vLLM's that the index does not
serve (vllm 0.34.0's flashinfer-python==0.7.3) is given a metadata-only stand-in wheel of that
version declaring the next release's dependencies, so the rest resolves as it would for a user
who has it; the output says when that happened.

Not a CI test: each release downloads several GB of CUDA wheels (torch and ~30 nvidia packages)
and unpacks them (docs/benchmarks.md, "Install checks", gives the releases last checked and the
wall time; the venvs are removed at the end unless --keep).
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOADERS = {"speculators": "examples/load_spec.py", "specforge": "examples/load_sf.py",
           "modelopt": "examples/load_mo.py"}
# vLLM pins that PyPI does not serve: (package, pinned version, the release whose dependencies the stand-in declares).
STAND_INS = {"0.34.0": [("flashinfer-python", "0.7.3", "0.7.4")]}
# What a trainer's line must leave as the base had it (vLLM and the CUDA build it was compiled for).
HELD = re.compile(r"^(torch|torchvision|torchaudio|triton|vllm|nvidia-.*|cuda-.*)$")


def readme_gpu_lines(path: str) -> dict[str, list[str]]:
    """Each trainer row of README's install table: its GPU cell's pip commands (the CPU cell's where
    it says "the same"; none for a trainer with no pip line)."""
    with open(path) as f:
        lines = f.read().splitlines()
    head = next((i for i, line in enumerate(lines) if line.startswith("| trainer |") and ".[cuda]" in line), None)
    if head is None:
        raise SystemExit(f'{path}: no install table (a row starting "| trainer |" naming ".[cuda]")')
    rows = {}
    for line in lines[head + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in re.split(r"\|(?=(?:[^`]*`[^`]*`)*[^`]*$)", line.strip("|"))]
        name, cpu, gpu = cells[0], cells[1], cells[2]
        cell = cpu if gpu.startswith("the same") else gpu
        rows[name] = [c for c in re.findall(r"`([^`]+)`", cell) if c.startswith("pip ")]
    return rows


def pip_env(find_links: str | None) -> dict[str, str]:
    """A new user's pip: no config file (the local wheel directories, extra indexes, torch
    cap), no PYTHONPATH (the checks must import what was installed), only PyPI and the stand-ins;
    no cache (every release downloads afresh, leaving nothing behind)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") and k != "PYTHONPATH"}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_CACHE_DIR="1")
    for k in ("PIP_CERT", "PIP_DEFAULT_TIMEOUT"):
        if k in os.environ:
            env[k] = os.environ[k]
    if find_links:
        env["PIP_FIND_LINKS"] = find_links
    return env


def sh(cmd: str, venv: str, env: dict, cwd: str = "/tmp") -> tuple[int, str]:
    """cmd in bash with `pip` and `python` meaning the venv's (a function, not bin/pip, whose
    shebang would name the base in a hard-linked copy)."""
    prelude = f'pip() {{ "{venv}/bin/python" -m pip "$@"; }}; python() {{ "{venv}/bin/python" "$@"; }}; set -e; '
    p = subprocess.run(["bash", "-c", prelude + cmd], cwd=cwd, env=env, capture_output=True, text=True)
    return p.returncode, (p.stdout + p.stderr).strip()


def installed(venv: str, env: dict) -> dict[str, str]:
    rc, out = sh("pip list --format=json", venv, env)
    assert rc == 0, out
    return {d["name"].lower().replace("_", "-"): d["version"] for d in json.loads(out.splitlines()[-1])}


def diff(before: dict, after: dict) -> dict[str, list[str]]:
    return {"added": [f"{k}=={after[k]}" for k in sorted(after.keys() - before.keys())],
            "removed": [f"{k}=={before[k]}" for k in sorted(before.keys() - after.keys())],
            "changed": [f"{k} {before[k]} -> {after[k]}" for k in sorted(before.keys() & after.keys())
                        if before[k] != after[k]]}


def checks(venv: str, env: dict, loader: str | None) -> dict:
    """pip check, the imports, the loader's imports: what README's lines promise."""
    result = {}
    result["pip_check"] = sh("pip check", venv, env)
    result["imports"] = sh('python -c "import torch, vllm, corecap; print(torch.__version__, torch.version.cuda, '
                           'vllm.__version__, corecap.__file__)"', venv, env)
    if loader:
        path = os.path.join(ROOT, loader)
        result["loader"] = sh(f"python -c \"import runpy; runpy.run_path('{path}', run_name='imports_only')\"",
                              venv, env)
    return result


def stand_in(package: str, version: str, like: str, directory: str, env: dict, venv: str) -> str | None:
    """A metadata-only wheel of package==version declaring `like`'s dependencies, unless PyPI serves
    the real one (then None)."""
    with tempfile.TemporaryDirectory() as tmp:
        if sh(f"pip download -q --no-deps {package}=={version} -d {tmp}", venv, env)[0] == 0:
            return None
        rc, out = sh(f"pip download -q --no-deps --only-binary :all: {package}=={like} -d {tmp}", venv, env)
        assert rc == 0, out
        wheel = next(os.path.join(tmp, f) for f in os.listdir(tmp) if f.endswith(".whl"))
        with zipfile.ZipFile(wheel) as z:
            meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    meta = re.sub(r"^Version: .*$", f"Version: {version}", meta, count=1, flags=re.M)
    meta += f"\n(stand-in written by corecap's tools/check_gpu_installs.py: {package} {version} is not on PyPI)\n"
    dist = f"{package.replace('-', '_')}-{version}.dist-info"
    files = {f"{dist}/METADATA": meta.encode(),
             f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: corecap\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = "".join(f"{n},sha256={base64.urlsafe_b64encode(hashlib.sha256(b).digest()).rstrip(b'=').decode()},"
                     f"{len(b)}\n" for n, b in files.items()) + f"{dist}/RECORD,,\n"
    files[f"{dist}/RECORD"] = record.encode()
    os.makedirs(directory, exist_ok=True)
    out = os.path.join(directory, f"{package.replace('-', '_')}-{version}-py3-none-any.whl")
    with zipfile.ZipFile(out, "w") as z:
        for n, b in files.items():
            z.writestr(n, b)
    return out


def run_step(label: str, cmd: str, venv: str, env: dict, cwd: str = "/tmp") -> None:
    start = time.monotonic()
    rc, out = sh(cmd, venv, env, cwd)
    print(f"  {label}: rc {rc} in {time.monotonic() - start:.0f} s", flush=True)
    if rc:
        raise SystemExit(f"{label} failed:\n{out[-3000:]}")


def base_venv(version: str, args, env: dict) -> tuple[str, dict, list[str]]:
    venv = os.path.join(args.root, f"gpuvenv-{version}")
    shutil.rmtree(venv, ignore_errors=True)
    notes = []
    subprocess.run([args.python, "-m", "venv", venv], check=True)
    run_step("pip upgrade", "pip install -q -U pip", venv, env)
    for package, pinned, like in STAND_INS.get(version, []):
        wheel = stand_in(package, pinned, like, os.path.join(args.root, "gpuvenv-stand-ins"), env, venv)
        if wheel:
            env = dict(env, PIP_FIND_LINKS=os.path.dirname(wheel))
            notes.append(f"{package}=={pinned} is not on PyPI: a metadata-only stand-in with {like}'s dependencies")
    run_step(f"pip install vllm=={version}", f"pip install -q vllm=={version}", venv, env)
    run_step('pip install ".[cuda]"', 'pip install -q ".[cuda]"', venv, env, cwd=ROOT)
    return venv, env, notes


def fresh_resolution(args, env: dict) -> str:
    """What README's `pip install ".[cuda]"` picks in a fresh venv, without a vLLM named first (a
    dry run: pip resolves, downloads what it must read, installs nothing)."""
    venv = os.path.join(args.root, "gpuvenv-resolve")
    shutil.rmtree(venv, ignore_errors=True)
    subprocess.run([args.python, "-m", "venv", venv], check=True)
    report = os.path.join(venv, "report.json")
    rc, out = sh(f'pip install -q -U pip && pip install -q --dry-run --report {report} ".[cuda]"', venv, env, ROOT)
    if rc:
        return f'pip install ".[cuda]" fails to resolve:\n{out[-2000:]}'
    with open(report) as f:
        picked = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in json.load(f)["install"]}
    shutil.rmtree(venv, ignore_errors=True)
    return f'pip install ".[cuda]" in a fresh venv picks vllm {picked.get("vllm")}, torch {picked.get("torch")}'


def trainer(name: str, commands: list[str], base: str, before: dict, env: dict) -> dict:
    venv = f"{base}-{re.sub(r'[^a-z0-9]+', '-', name.lower()).strip('-')}"
    shutil.rmtree(venv, ignore_errors=True)
    subprocess.run(["cp", "-al", base, venv], check=True)
    start = time.monotonic()
    rc, out = sh(" && ".join(commands), venv, env, cwd=ROOT)
    loader = next((path for key, path in LOADERS.items() if name.lower().startswith(key)), None)
    result = {"line": " && ".join(commands), "rc": rc, "seconds": round(time.monotonic() - start),
              "diff": diff(before, installed(venv, env)), **checks(venv, env, loader)}
    if rc:
        result["output"] = out[-3000:]
    moved = [d for d in result["diff"]["changed"] + result["diff"]["removed"] if HELD.match(re.split(r"[ =]", d)[0])]
    problems = ([f"line rc {rc}"] if rc else []) + [f"moved {d}" for d in moved] + \
        [f"{k} failed" for k in ("imports", "loader") if k in result and result[k][0]] + \
        [f"removed {d}" for d in result["diff"]["removed"] if d not in moved]
    result["verdict"] = "ok" if not problems else "FAIL: " + "; ".join(problems)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm", nargs="+", default=["0.34.0", "0.33.0", "0.26.0"],
                    help="vLLM releases, one after another")
    ap.add_argument("--python", default="python3.11")
    ap.add_argument("--root", default="/tmp", help="where the venvs go (gpuvenv-*, about 9 GB a release)")
    ap.add_argument("--keep", action="store_true", help="keep the venvs")
    ap.add_argument("--json", help="write every result here")
    args = ap.parse_args()
    rows = readme_gpu_lines(os.path.join(ROOT, "README.md"))
    start, report, verdicts = time.monotonic(), {}, []
    picked = fresh_resolution(args, pip_env(None))
    print(picked, flush=True)
    for version in args.vllm:
        print(f"vllm {version}:", flush=True)
        base, env, notes = base_venv(version, args, pip_env(None))
        before = installed(base, env)
        report[version] = {"notes": notes, "base": {"torch": before.get("torch"), "vllm": before.get("vllm"),
                                                    "packages": len(before), **checks(base, env, None)}}
        for note in notes:
            print(f"  note: {note}")
        print(f"  base: {len(before)} packages, torch {before.get('torch')}, pip check: "
              f"{report[version]['base']['pip_check'][1]}", flush=True)
        for name, commands in rows.items():
            if not commands:
                verdicts.append(f"vllm {version}  {name}: no pip line in README (nothing to check)")
                continue
            result = report[version][name] = trainer(name, commands, base, before, env)
            print(f"  {name}: {result['verdict']} ({result['seconds']} s); diff {json.dumps(result['diff'])}; "
                  f"pip check: {result['pip_check'][1]}", flush=True)
            verdicts.append(f"vllm {version}  {name}: {result['verdict']}" + "".join(f" ({n})" for n in notes))
        changed = diff(before, installed(base, env))
        assert not any(changed.values()), f"the base venv changed under a hard-linked copy: {changed}"
        if not args.keep:
            for d in os.listdir(args.root):
                if d == f"gpuvenv-{version}" or d.startswith(f"gpuvenv-{version}-"):
                    shutil.rmtree(os.path.join(args.root, d), ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    if not args.keep:
        shutil.rmtree(os.path.join(args.root, "gpuvenv-stand-ins"), ignore_errors=True)
    print(f"\n{len(args.vllm)} vLLM release(s) in {time.monotonic() - start:.0f} s; {picked}:")
    print("\n".join(verdicts))
    sys.exit(0 if all(": ok" in v or "no pip line" in v for v in verdicts) else 1)


if __name__ == "__main__":
    main()
