#!/usr/bin/env bash
# The test command: installs dependencies, builds a Debug tree with address and undefined-behaviour
# sanitizers (warnings are errors), runs the whole ctest suite, and exits non-zero on any failure.
#   ./deploy/check.sh              # everything
#   BUILD_DIR=... ./deploy/check.sh
#   CTEST_ARGS="-R kern" ./deploy/check.sh
set -euo pipefail
cd "$(dirname "$0")/.."

BUILD_DIR=${BUILD_DIR:-build/check}
JOBS=${JOBS:-$(nproc)}

./deploy/install-deps.sh

cmake -S . -B "$BUILD_DIR" \
  -DCMAKE_BUILD_TYPE=Debug \
  -DFUSION_SANITIZE=ON \
  -DFUSION_WERROR=ON \
  ${CMAKE_ARGS:-}
cmake --build "$BUILD_DIR" -j "$JOBS"

# CUDA under ASan needs the shadow gap left alone; leaks are errors.
export ASAN_OPTIONS=${ASAN_OPTIONS:-protect_shadow_gap=0:detect_leaks=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
cd "$BUILD_DIR"
ctest --output-on-failure -j "$JOBS" ${CTEST_ARGS:-}
