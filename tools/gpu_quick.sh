#!/bin/sh
# tools/gpu_quick.py on a GPU machine with no network, from a fresh copy of the working tree:
#
#     sh tools/gpu_quick.sh "$OUT" [gpu_quick.py's options]      # carry .whl (make gpu-wheels fills it)
#
# 1. the wheels in .whl/ (pure-python packages the image lacks) installed into /tmp/site, offline;
# 2. the I/O engine built with cmake and put beside zerolite's sources, unless it imports already
#    (no pip install: nothing to isolate, nothing to fetch, nothing left in the image); failing that,
#    through pip (scikit-build-core, offline); failing that, the one make gpu-wheels built (--prebuild);
# 3. tools/gpu_quick.py --out "$OUT". Its exit status is this script's.
# The build's output goes to $OUT/gpu_quick_build.log.
set -u
STARTED=$(date +%s)
cd "$(dirname "$0")/.." || exit 2
if [ "${1:-}" = "--prebuild" ]; then
    # make gpu-wheels: the engine built here for CPython 3.12 (the GPU image's) into
    # ${2:-.whl}: step 2's last resort where the image cannot build it (no Python headers, say).
    PY312=${PY312:-$(command -v python3.12)}
    "${PY312:-false}" -c "import sys; assert sys.version_info[:2] == (3, 12)" 2> /dev/null \
        || { echo "gpu_quick.sh --prebuild: no CPython 3.12 here (set PY312); skipped" >&2; exit 0; }
    rm -rf build/gpu-quick-prebuild && mkdir -p build/gpu-quick-prebuild "${2:-.whl}"
    "$PY312" -m pip install -q --disable-pip-version-check --target build/gpu-quick-prebuild/nb nanobind || exit 1
    cmake -S . -B build/gpu-quick-prebuild/cmake -DCMAKE_BUILD_TYPE=Release -DPython_EXECUTABLE="$PY312" \
        -Dnanobind_DIR="$(PYTHONPATH=build/gpu-quick-prebuild/nb "$PY312" -m nanobind --cmake_dir)" > build/gpu-quick-prebuild/log 2>&1 \
        && cmake --build build/gpu-quick-prebuild/cmake -j "$(nproc)" >> build/gpu-quick-prebuild/log 2>&1 \
        && cp build/gpu-quick-prebuild/cmake/_engine*.so "${2:-.whl}/" \
        || { tail -n 20 build/gpu-quick-prebuild/log >&2; exit 1; }
    exit 0
fi
OUT=${1:-${OUT:-gpu_quick_out}}
[ $# -gt 0 ] && shift
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
    timeout 60 cmake -S . -B build/gpu-quick $GENERATOR -DCMAKE_BUILD_TYPE=Release \
            -DPython_EXECUTABLE="$(command -v "$PY")" -Dnanobind_DIR="$("$PY" -m nanobind --cmake_dir)" >> "$BUILD_LOG" 2>&1 \
        && timeout 150 cmake --build build/gpu-quick -j "$(nproc)" >> "$BUILD_LOG" 2>&1 \
        && cp build/gpu-quick/_engine*.so zerolite/ \
        && "$PY" -c "import zerolite._engine" >> "$BUILD_LOG" 2>&1
    if ! "$PY" -c "import zerolite._engine" >> "$BUILD_LOG" 2>&1; then
        # The same build through scikit-build-core, offline (no isolation: nothing to fetch), into a folder of its own.
        echo "gpu_quick.sh $(date +%H:%M:%S) cmake alone failed: building through pip" >&2
        rm -rf /tmp/zerolite-built
        timeout 150 "$PY" -m pip install --no-build-isolation --no-deps --no-index --disable-pip-version-check \
                --target /tmp/zerolite-built . >> "$BUILD_LOG" 2>&1 \
            && cp /tmp/zerolite-built/zerolite/_engine*.so zerolite/ \
            && "$PY" -c "import zerolite._engine" >> "$BUILD_LOG" 2>&1 \
            || true
    fi
    if ! "$PY" -c "import zerolite._engine" >> "$BUILD_LOG" 2>&1; then
        # The last resort: the engine make gpu-wheels built for CPython 3.12 (tools/gpu_quick.sh --prebuild).
        cp .whl/_engine*.so zerolite/ 2> /dev/null
        "$PY" -c "import zerolite._engine" >> "$BUILD_LOG" 2>&1 \
            && echo "gpu_quick.sh: using the engine built by make gpu-wheels" >&2 \
            || { echo "gpu_quick.sh: no I/O engine; the end of $BUILD_LOG:" >&2; tail -n 30 "$BUILD_LOG" >&2; }
    fi
fi
# Nine minutes in all: what the build took comes out of the steps' budget (a --budget-s given wins).
BUDGET=$((510 - ($(date +%s) - STARTED)))
echo "gpu_quick.sh $(date +%H:%M:%S) running tools/gpu_quick.py (budget ${BUDGET} s)" >&2
exec "$PY" tools/gpu_quick.py --out "$OUT" --budget-s "$BUDGET" "$@"
