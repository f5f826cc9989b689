#!/usr/bin/env bash
# Short libFuzzer runs of every harness, for scripts/test.sh:
#   tests/fuzz/run.sh [SECONDS [NAME...]]   (default 20 s each, all harnesses)
# Configures and builds build-fuzz (clang, Debug, -DKS_FUZZ=ON), then runs each
# harness for SECONDS from a temporary copy of its corpus tests/fuzz/NAME/ (the
# source tree is never written), one at a time, under nice. Any crash, leak,
# sanitizer report or slow input (> 25 s) fails the script; the input is left
# in build-fuzz/fuzz-artifacts/ and the command that replays it is printed.
# Exit 77 (skipped) when clang or libFuzzer's runtime is missing.
# Env: BUILD_DIR (build-fuzz), KVSERVE_SHARED (the vocabularies; ../shared).
set -euo pipefail
cd "$(dirname "$0")/../.."
secs=${1:-20}
shift || true
names=("$@")
[ ${#names[@]} -gt 0 ] || names=(gguf body tokenizer chat apis)
build=${BUILD_DIR:-build-fuzz}

if ! command -v clang >/dev/null; then
  echo "fuzz: SKIPPED: clang is not installed (scripts/deps.sh installs it)"
  exit 77
fi
probe=$(mktemp -d)
trap 'rm -rf "$probe"' EXIT
printf '#include <stdint.h>\n#include <stddef.h>\nint LLVMFuzzerTestOneInput(const uint8_t *d, size_t n) { (void)d; (void)n; return 0; }\n' \
  >"$probe/p.c"
if ! clang -fsanitize=fuzzer,address,undefined "$probe/p.c" -o "$probe/p" 2>"$probe/err"; then
  echo "fuzz: SKIPPED: clang cannot link libFuzzer (libclang-rt-dev missing?): $(head -c 300 "$probe/err")"
  exit 77
fi

jobs=$(nproc)
[ "$jobs" -le 2 ] || jobs=2
CC=clang cmake -S . -B "$build" -DKS_FUZZ=ON -DCMAKE_BUILD_TYPE=Debug >/dev/null
nice cmake --build "$build" -j "$jobs" --target $(printf 'fuzz_%s ' "${names[@]}") >/dev/null

shared=${KVSERVE_SHARED:-$(cd .. && pwd)/shared}
artifacts="$build/fuzz-artifacts"
mkdir -p "$artifacts"
for name in "${names[@]}"; do
  case $name in
    gguf) max_len=20000 ;;
    body) max_len=4096 ;;
    *) max_len=2048 ;;
  esac
  dict=()
  [ -f "tests/fuzz/$name.dict" ] && dict=(-dict="tests/fuzz/$name.dict")
  corpus="$probe/$name"
  mkdir -p "$corpus"
  cp tests/fuzz/"$name"/* "$corpus"/
  log="$build/fuzz_$name.log"
  start=$(date +%s)
  if ! KVSERVE_SHARED=$shared nice "$build/fuzz_$name" "$corpus" "${dict[@]}" -max_total_time="$secs" \
      -max_len="$max_len" -timeout=25 -rss_limit_mb=2560 -error_exitcode=1 -print_final_stats=1 \
      -artifact_prefix="$artifacts/$name-" >"$log" 2>&1; then
    echo "fuzz: fuzz_$name FAILED; its log is $log:"
    grep -E 'ERROR|SUMMARY|runtime error|fuzz_'"$name"':|Test unit written' "$log" | head -20 || true
    echo "replay: KVSERVE_SHARED=$shared $build/fuzz_$name $artifacts/$name-<crash file>"
    exit 1
  fi
  stats=$(grep -E '^#[0-9]+' "$log" | tail -1 | sed -E 's/^(#[0-9]+)[[:space:]]+[A-Z]+[[:space:]]+/\1 /')
  echo "fuzz: fuzz_$name ok in $(($(date +%s) - start)) s: $stats"
done
