#!/usr/bin/env bash
# On the machine the kit was carried to (tools/amx/make_kit.sh says how), from the project's root:
#
#   bash tools/amx/remote_run.sh KITDIR [--install-only | --every-file | pytest arguments]
#
# joins KITDIR/c*/kit.tar.part*, checks the sha256, puts the Python of make_kit's machine back at
# its own path (make_kit's prefix, e.g. /root/.pyenv/versions/3.11.7/bin/python3.11: name that
# interpreter in later commands), installs the wheels and this checkout (editable) into it, says
# whether torch sees AMX, runs `corecap doctor`, then pytest with the arguments given (default:
# each of the test files that choose or refuse by AMX, and test_architectures' DeepSeek-V3 cases,
# in a pytest of its own, `--full`; ~400 s on the GPU host's 16 cores; `--every-file`: every
# tests/test_*.py so but test_export* and test_examples, which need the trainers the kit does not
# carry; with AMX_STREAMS=4 AMX_LOGS=DIR, four at a time, each on a quarter of the cores: the end
# of the file says how). AMX_ROOT=DIR puts that Python under DIR instead of / (to try the kit on
# the machine that made it without touching its own Python).
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
if [ "${1:-}" = --install-only ]; then
    echo "installed: $PY"
    exit 0
elif [ $# -gt 0 ] && [ "$1" != --every-file ]; then
    exec "$PY" -m pytest -q -p no:cacheprovider -rs "$@"
fi
# One pytest a selection, so that each one's failures are printed as soon as it ends: a run cut
# short by the device's time still says why the ones before failed (2026-12-05, a run stopped
# 320 s in had printed only its progress dots). With AMX_LOGS=DIR each also writes DIR/NAME.log
# and DIR/done at the end (a run in the background, read by a later call). First the rotary
# tables' rebuild, then the two float32 MLA captures that it put right there (before it, ~1.2e-4
# off HF's in some engines, 5 of 48, from each sample's token 64 on: docs/tests.md "On a CPU
# with AMX"), then the rest.
rc=0
logs=${AMX_LOGS:-}
[ -z "$logs" ] || mkdir -p "$logs"
selections=(tests/test_rotary_tables.py "tests/test_architectures.py -k deepseek_v3" tests/test_kimi.py
    tests/test_checkpoint.py tests/test_preflight.py tests/test_quantized.py tests/test_mla_backends.py
    tests/test_worker_errors.py tests/test_options.py)
if [ "${1:-}" = --every-file ]; then  # the whole suite, a file a pytest, but those that need the trainers
    mapfile -t selections < <(ls tests/test_*.py | grep -v -e '^tests/test_export' -e '^tests/test_examples\.py$')
fi
streams=${AMX_STREAMS:-1}
if [ "$streams" -le 1 ]; then
    for selection in "${selections[@]}"; do
        name=$(basename "${selection%% *}" .py)
        # shellcheck disable=SC2086  # a selection is a file and its pytest arguments
        "$PY" -m pytest -q -p no:cacheprovider -rs --full $selection 2>&1 | tee ${logs:+"$logs/$name.log"} \
            || rc=1
    done
    [ -z "$logs" ] || echo "rc=$rc" > "$logs/done"
    exit $rc
fi
# AMX_STREAMS=N (N > 1, with AMX_LOGS outside /tmp, as root): N pytests at a time, each on its own
# 1/N of the cores (its affinity, which vLLM's CPU worker and corecap's replica placement both
# read, so each stream sees a machine of that many cores) and with its own /dev/shm and /tmp
# (tools/amx/stream.sh says why), taking the next selection from one queue as it ends one. The
# whole suite takes ~2,000 s on CI's 2 cores, more than a device session's 1,800 s: on the GPU
# host's 16 cores, four streams of four. The slowest files on four of its cores (2026-12-06,
# 240-360 s each) go first, so that none of them starts last.
case "$logs" in
    "") echo "AMX_STREAMS needs AMX_LOGS (each stream's output goes to its files)"; exit 2 ;;
    /tmp*|/dev/shm*) echo "AMX_LOGS=$logs: each stream has a /tmp and /dev/shm of its own; expected a directory elsewhere"
        exit 2 ;;
esac
queue=$logs/queue
slowest_first=(test_architectures test_generate test_parallel test_faults test_resume test_cli test_prefix
    test_capture test_async_scheduling test_preflight test_long_samples test_kimi test_quantized)
{
    for name in "${slowest_first[@]}"; do printf '%s\n' "${selections[@]}" | grep -x "tests/$name\.py" || true; done
    printf '%s\n' "${selections[@]}" | grep -v -x -f <(printf 'tests/%s.py\n' "${slowest_first[@]}") || true
} > "$queue"
mapfile -t cores < <("$PY" -c "import os; print(*sorted(os.sched_getaffinity(0)), sep='\n')")
per=$(( ${#cores[@]} / streams ))
for k in $(seq 0 $((streams - 1))); do
    mine=$(printf '%s,' "${cores[@]:$((k * per)):$per}")
    taskset -c "${mine%,}" unshare --mount --propagation private bash tools/amx/stream.sh "$PY" "$queue" "$logs" &
done
wait
if [ -s "$logs/failed" ]; then
    rc=1
    while read -r name; do echo "=== $name"; cat "$logs/$name.log"; done < "$logs/failed"
fi
echo "rc=$rc" > "$logs/done"
exit $rc
