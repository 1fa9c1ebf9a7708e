#!/bin/sh
# tools/gpu_quick.py on a GPU machine with no network, from a fresh copy of the working tree:
#
#     sh tools/gpu_quick.sh "$OUT" [gpu_quick.py's options]      # carry .whl (make gpu-wheels fills it)
#
# 1. the wheels in .whl/ (pure-python packages the image lacks) installed into /tmp/site, offline;
# 2. the I/O engine built with cmake and put beside zerolite's sources, unless it imports already
#    (no pip install: nothing to isolate, nothing to fetch, nothing left in the image);
# 3. tools/gpu_quick.py --out "$OUT". Its exit status is this script's.
# The build's output goes to $OUT/gpu_quick_build.log.
set -u
STARTED=$(date +%s)
OUT=${1:-${OUT:-gpu_quick_out}}
[ $# -gt 0 ] && shift
cd "$(dirname "$0")/.." || exit 2
mkdir -p "$OUT"
PY=${PYTHON:-python3}
BUILD_LOG="$OUT/gpu_quick_build.log"
: > "$BUILD_LOG"
if ls .whl/*.whl > /dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --disable-pip-version-check --target /tmp/site .whl/*.whl >> "$BUILD_LOG" 2>&1 \
        || echo "gpu_quick.sh: installing .whl/ failed (see $BUILD_LOG); going on" >&2
    PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    export PYTHONPATH
fi
if ! "$PY" -c "import zerolite._engine" >> "$BUILD_LOG" 2>&1; then
    echo "gpu_quick.sh $(date +%H:%M:%S) building the I/O engine" >&2
    GENERATOR=""
    command -v ninja > /dev/null 2>&1 && GENERATOR="-G Ninja"
    # shellcheck disable=SC2086
    timeout 300 cmake -S . -B build/gpu-quick $GENERATOR -DCMAKE_BUILD_TYPE=Release \
            -DPython_EXECUTABLE="$(command -v "$PY")" -Dnanobind_DIR="$("$PY" -m nanobind --cmake_dir)" >> "$BUILD_LOG" 2>&1 \
        && timeout 300 cmake --build build/gpu-quick -j "$(nproc)" >> "$BUILD_LOG" 2>&1 \
        && cp build/gpu-quick/_engine*.so zerolite/ \
        && "$PY" -c "import zerolite._engine" >> "$BUILD_LOG" 2>&1
    if ! "$PY" -c "import zerolite._engine" >> "$BUILD_LOG" 2>&1; then
        # The same build through scikit-build-core, offline (no isolation: nothing to fetch), into a folder of its own.
        echo "gpu_quick.sh $(date +%H:%M:%S) cmake alone failed: building through pip" >&2
        rm -rf /tmp/zerolite-built
        timeout 300 "$PY" -m pip install --no-build-isolation --no-deps --no-index --disable-pip-version-check \
                --target /tmp/zerolite-built . >> "$BUILD_LOG" 2>&1 \
            && cp /tmp/zerolite-built/zerolite/_engine*.so zerolite/ \
            && "$PY" -c "import zerolite._engine" >> "$BUILD_LOG" 2>&1 \
            || { echo "gpu_quick.sh: building the I/O engine failed; the end of $BUILD_LOG:" >&2; tail -n 30 "$BUILD_LOG" >&2; }
    fi
fi
# Nine minutes in all: what the build took comes out of the steps' budget (a --budget-s given wins).
BUDGET=$((510 - ($(date +%s) - STARTED)))
echo "gpu_quick.sh $(date +%H:%M:%S) running tools/gpu_quick.py (budget ${BUDGET} s)" >&2
exec "$PY" tools/gpu_quick.py --out "$OUT" --budget-s "$BUDGET" "$@"
