#!/usr/bin/env bash
# On the machine the kit was carried to (tools/amx/make_kit.sh says how), from the project's root:
#
#   bash tools/amx/remote_run.sh KITDIR [pytest arguments]
#
# joins KITDIR/c*/kit.tar.part*, checks the sha256, puts the Python of make_kit's machine back at
# its own path, installs the wheels and this checkout (editable) into it, says whether torch sees
# AMX, runs `corecap doctor`, then pytest with the arguments given (default: each of the test
# files that choose or refuse by AMX in a pytest of its own, `--full`). AMX_ROOT=DIR puts that
# Python under DIR instead of / (to try the kit on the machine that made it without touching its
# own Python).
set -euo pipefail
KITDIR=$1
shift
ROOT=${AMX_ROOT:-/}
WORK=$(mktemp -d /tmp/amxkit.XXXX)
parts=$(cat "$KITDIR"/c*/parts)
found=$(ls "$KITDIR"/c*/kit.tar.part* | wc -l)
[ "$found" -eq "$parts" ] || { echo "amx kit: $found of $parts parts in $KITDIR"; exit 2; }
cat $(ls "$KITDIR"/c*/kit.tar.part* | sort) > "$WORK/kit.tar"
[ "$(sha256sum "$WORK/kit.tar" | cut -d' ' -f1)" = "$(cat "$KITDIR"/c*/kit.sha256)" ] \
    || { echo "amx kit: sha256 differs"; exit 2; }
tar -C "$WORK" -xf "$WORK/kit.tar" && rm "$WORK/kit.tar"
mkdir -p "$ROOT"
tar -C "$ROOT" -xJf "$WORK/python.tar.xz"
PY=$ROOT$(cat "$WORK/interpreter")
if [ "$ROOT" != / ]; then
    home=$(dirname "$(dirname "$PY")")
    export PYTHONHOME=$home LD_LIBRARY_PATH=$home/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi
"$PY" -m pip install -q --no-index --no-deps --no-warn-script-location "$WORK"/wheels/*.whl
"$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e .
rm -rf "$WORK"
echo "amx_tile flags: $(grep -c amx_tile /proc/cpuinfo || true); C++ compiler (Inductor's): $(command -v g++ || echo none)"
"$PY" -c "import torch; print('torch', torch.__version__, 'AMX tiles:', torch.cpu._is_amx_tile_supported())"
"$PY" -m corecap.cli doctor
if [ $# -gt 0 ]; then
    exec "$PY" -m pytest -q -p no:cacheprovider -rs "$@"
fi
# One pytest a file, so that each file's failures are printed as soon as it ends: a run cut short
# by the device's time still says why the files before failed (2026-12-05, a run stopped 320 s in
# had printed only its progress dots).
rc=0
for file in tests/test_mla_backends.py tests/test_worker_errors.py tests/test_quantized.py tests/test_options.py \
        tests/test_kimi.py; do
    "$PY" -m pytest -q -p no:cacheprovider -rs --full "$file" || rc=1
done
exit $rc
