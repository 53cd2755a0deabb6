#!/usr/bin/env bash
# Builds every libFuzzer target with clang (-DFUSION_FUZZ=ON, CPU only) and runs each for
# $FUZZ_SECONDS (default 60) over a scratch copy of its seed corpus. New inputs stay in the scratch
# copy; a crash leaves its reproducer in build/fuzz/crashes/ and makes this script fail.
set -euo pipefail
cd "$(dirname "$0")/../.."
FUZZ_SECONDS=${FUZZ_SECONDS:-60}
BUILD=${FUZZ_BUILD_DIR:-build/fuzz}

command -v clang >/dev/null || { echo "run-fuzzers: clang not found (deploy/install-deps.sh installs it)" >&2; exit 1; }
cmake -S . -B "$BUILD" -DCMAKE_C_COMPILER=clang -DFUSION_FUZZ=ON -DFUSION_CUDA=OFF -DBUILD_TESTING=ON \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
targets=$(cd tests/fuzz/corpus && ls)
cmake --build "$BUILD" -j "$(nproc)" --target $(for t in $targets; do printf 'fuzz-%s ' "$t"; done)

mkdir -p "$BUILD/crashes"
failed=0
for t in $targets; do
  work=$(mktemp -d)
  cp tests/fuzz/corpus/"$t"/* "$work"/
  echo "== fuzz-$t for $FUZZ_SECONDS s ($(ls "$work" | wc -l) seeds)"
  if ! "$BUILD/bin/fuzz-$t" -max_total_time="$FUZZ_SECONDS" -timeout=10 -rss_limit_mb=2048 \
       -artifact_prefix="$BUILD/crashes/$t-" -print_final_stats=1 "$work" 2>"$BUILD/fuzz-$t.log"; then
    echo "run-fuzzers: fuzz-$t found a failure (log: $BUILD/fuzz-$t.log, reproducer in $BUILD/crashes/)" >&2
    tail -n 30 "$BUILD/fuzz-$t.log" >&2
    failed=1
  else
    grep -E 'stat::number_of_executed_units|stat::peak_rss_mb' "$BUILD/fuzz-$t.log" | tr '\n' ' '; echo
  fi
  rm -rf "$work"
done
exit $failed
