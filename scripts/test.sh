#!/usr/bin/env bash
# Build Release and run the whole suite, then rebuild Debug with ASan+UBSan
# and run the unit tests again under the sanitizers, then the threaded tests
# under ThreadSanitizer, then the unit tests in an AVX2-only and a portable
# build (the kernels this CPU would not otherwise run).
#
# A test whose inputs are missing exits 77 and ctest reports it "Not Run"
# (skipped), never passed; after each ctest run this prints how many were
# skipped and which cases were skipped inside tests that ran the rest. With
# CI=true, a missing ../shared (or $KVSERVE_SHARED) is an error, not a pile of
# skips.
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=$(nproc)

shared=${KVSERVE_SHARED:-$(cd .. && pwd)/shared}
if [ ! -d "$shared" ]; then
  if [ "${CI:-}" = true ]; then
    echo "scripts/test.sh: CI=true but the shared models directory $shared does not exist;" \
      "the tests that need it would only be skipped. Provide it (or set KVSERVE_SHARED)." >&2
    exit 1
  fi
  echo "scripts/test.sh: no $shared: the tests that need the shared models will be skipped" >&2
fi

# cmocka's skip() alone counts as a pass; cases skip through KS_SKIP
# (tests/support/skip.h), which makes the binary's exit status tell.
if grep -nE '(^|[^_A-Za-z])skip\(\)' tests/*.c; then
  echo "scripts/test.sh: the tests above call cmocka's skip() directly; use KS_SKIP (tests/support/skip.h)" >&2
  exit 1
fi

# ctest, then a summary of what did not really run: tests that exited 77
# (skipped) and cases skipped inside tests that ran the others (the
# "SKIPPED k of n cases" line of tests/support/skip.c), read from ctest's JUnit
# report (whose output limit is raised so that the line is not cut off).
run_ctest() {
  local dir=$1 rc=0
  shift
  local junit="$PWD/$dir/ctest-junit.xml"
  rm -f "$junit"
  ctest --test-dir "$dir" --output-on-failure --output-junit "$junit" \
    --test-output-size-passed 1048576 --test-output-size-failed 1048576 "$@" || rc=$?
  if [ -f "$junit" ]; then
    local total skipped names
    total=$({ grep -o -m1 'tests="[0-9]*"' "$junit" || true; } | tr -dc 0-9)
    skipped=$({ grep -o -m1 'skipped="[0-9]*"' "$junit" || true; } | tr -dc 0-9)
    names=$({ grep -o '<testcase name="[^"]*" classname="[^"]*" time="[^"]*" status="notrun"' "$junit" || true; } |
      cut -d'"' -f2 | paste -sd' ' -)
    echo "== ctest $dir $*: ${skipped:-0} of ${total:-0} tests skipped${names:+ ($names)}"
    awk '/<testcase name="/ { split($0, f, "\""); name = f[2] }
         /SKIPPED [0-9]+ of [0-9]+ cases:/ { sub(/.*SKIPPED /, "SKIPPED "); print "   " name ": " $0 }' "$junit" |
      sed -e 's/&lt;/</g; s/&gt;/>/g; s/&quot;/"/g; s/&apos;/'"'"'/g; s/&amp;/\&/g'
  fi
  return $rc
}

cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j "$jobs"
run_ctest build -j "$jobs"
cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=Debug -DKS_SANITIZE=ON >/dev/null
cmake --build build-asan -j "$jobs"
ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
  run_ctest build-asan -j "$jobs" -L unit
# The server under memory pressure (demotions, preemptions) with the Debug
# build's kv_check after every cache mutation and attn's bounds asserts on.
ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
  run_ctest build-asan -R '^server_e2e_pressure$'
# Anthropic's and the Responses API's translation over the chat route (streams wrapped, references held).
ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
  run_ctest build-asan -R '^server_apis$'
# ThreadSanitizer needs a build of its own (it cannot share one with ASan);
# only the tests that run threads: the scheduler's, the server's, the store
# writer's and the thread pool's.
tsan_tests="test_sched test_sched_cost test_server test_server_chat test_server_n test_prefix_cache test_store test_threads"
tsan_tests+=" test_store_redis"
cmake -S . -B build-tsan -DCMAKE_BUILD_TYPE=Debug -DKS_TSAN=ON >/dev/null
cmake --build build-tsan -j "$jobs" --target $tsan_tests default_model
# die_after_fork=0: test_store opens damaged stores in forked children (so a
# crash is seen, not suffered), and each child's store starts its writer
# thread; TSan refuses any thread after a fork it counts as multi-threaded
# (exit 66, seen once in a loaded CI run), which is not a race.
TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1 die_after_fork=0" \
  run_ctest build-tsan -j "$jobs" -R "^($(tr ' ' '|' <<<"$tsan_tests"))\$"
# The SIMD paths this CPU does not take by default: an AVX2-only build and a
# portable (no -march=native) build run the tests labelled isa (CMakeLists.txt
# says which: the kernels, attention, the cache, the models).
if [ "$(uname -m)" = x86_64 ]; then
  cmake -S . -B build-avx2 -DCMAKE_BUILD_TYPE=Release -DCMAKE_C_FLAGS=-mno-avx512f >/dev/null
  cmake --build build-avx2 -j "$jobs"
  run_ctest build-avx2 -j "$jobs" -L isa
  # Where this CPU has AVX-VNNI the AVX2-only build uses it (vpdpbusd on
  # ymm); AVX2 CPUs without it (Haswell to Zen 3) take the vpmaddubsw
  # forms, whose kernel tests run here in a build of their own.
  if echo | cc -march=native -mno-avx512f -dM -E - | grep -q '__AVXVNNI__'; then
    novnni_tests=$(cd tests && ls test_quant*.c | sed 's/\.c$//' | tr '\n' ' ')
    cmake -S . -B build-avx2-novnni -DCMAKE_BUILD_TYPE=Release "-DCMAKE_C_FLAGS=-mno-avx512f -mno-avxvnni" >/dev/null
    cmake --build build-avx2-novnni -j "$jobs" --target $novnni_tests test_attn
    run_ctest build-avx2-novnni -j "$jobs" -R "^($(tr ' ' '|' <<<"${novnni_tests}test_attn"))\$"
  fi
fi
cmake -S . -B build-portable -DCMAKE_BUILD_TYPE=Release -DKS_NATIVE=OFF >/dev/null
cmake --build build-portable -j "$jobs"
run_ctest build-portable -j "$jobs" -L isa
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
