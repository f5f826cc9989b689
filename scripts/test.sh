#!/usr/bin/env bash
# Build Release and run the whole suite, then rebuild Debug with ASan+UBSan
# and run the unit tests again under the sanitizers, then in an AVX2-only and
# a portable build (the kernels this CPU would not otherwise run).
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=$(nproc)
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j "$jobs"
ctest --test-dir build --output-on-failure -j "$jobs"
cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=Debug -DKS_SANITIZE=ON >/dev/null
cmake --build build-asan -j "$jobs"
ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
  ctest --test-dir build-asan --output-on-failure -j "$jobs" -L unit
# The SIMD paths this CPU does not take by default: an AVX2-only build and a
# portable (no -march=native) build run the unit tests too.
if [ "$(uname -m)" = x86_64 ]; then
  cmake -S . -B build-avx2 -DCMAKE_BUILD_TYPE=Release -DCMAKE_C_FLAGS=-mno-avx512f >/dev/null
  cmake --build build-avx2 -j "$jobs"
  ctest --test-dir build-avx2 --output-on-failure -j "$jobs" -L unit
fi
cmake -S . -B build-portable -DCMAKE_BUILD_TYPE=Release -DKS_NATIVE=OFF >/dev/null
cmake --build build-portable -j "$jobs"
ctest --test-dir build-portable --output-on-failure -j "$jobs" -L unit
# Fuzzing: every parser (GGUF, the completion/chat request body, the tokenizer,
# the chat templates) gets a short libFuzzer run in a clang build (build-fuzz)
# from a copy of its corpus under tests/fuzz/; any crash, leak or slow input
# fails the script. Skipped (not failed) without clang or libFuzzer's runtime.
# FUZZ_SECONDS (default 20) is each harness's run; 0 turns the stage off.
fuzz_secs=${FUZZ_SECONDS:-20}
if [ "$fuzz_secs" != 0 ]; then
  fuzz_rc=0
  tests/fuzz/run.sh "$fuzz_secs" || fuzz_rc=$?
  if [ "$fuzz_rc" = 77 ]; then
    echo "fuzz stage skipped (see the message above)"
  elif [ "$fuzz_rc" != 0 ]; then
    exit "$fuzz_rc"
  fi
fi
