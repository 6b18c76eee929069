#!/usr/bin/env bash
# The GPU releases CI cannot run (plain vllm 0.33.0 and 0.34.0 pin torch 2.14.0 with CUDA): their
# wheels are downloaded into CI's wheel cache, never installed (.ci/run calls this before the full
# suite). tests/test_gpu_wheels.py, in the full suite, unpacks each wheel's Python files (about a
# second) and runs `corecap doctor` and `corecap run` on that source (docs/versions.md). The
# releases are versions.READ_NOT_RUN's; the wheels (336 and 239 MB) are downloaded once per
# machine, as .ci/matrix.sh's are.
#
#   bash .ci/gpu_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1
CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/corecap-ci/wheels"
mkdir -p "$CACHE"
start=$SECONDS
for v in $(python3 -c "from corecap._vllm.versions import READ_NOT_RUN; print(*READ_NOT_RUN['vllm'])"); do
    if ! compgen -G "$CACHE/vllm-$v-*.whl" > /dev/null; then
        python3 -m pip download -q --no-deps "vllm==$v" -d "$CACHE"
    fi
    ls "$CACHE"/vllm-"$v"-*.whl
done
echo "GPU wheels ready in $((SECONDS - start)) s"
