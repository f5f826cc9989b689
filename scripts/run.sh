#!/usr/bin/env bash
# Install missing Debian packages, build Release into build/, then run the
# main job on the built-in default model (build/default-model.gguf, made by
# `kvserve synth` during the build). Extra arguments go to the command, e.g.
# `scripts/run.sh -m model.gguf -n 128`.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${KVSERVE_BUILD_DIR:-build}
scripts/deps.sh
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$build" -j "$(nproc)"
# The demo: 64 tokens from a short prompt ("Once upon a time" in the default
# model's vocabulary: BOS, then its byte tokens <0xXX> = 3 + byte), streamed, with a timing line on stderr.
exec "$build/kvserve" generate --ids 1,82,113,102,104,35,120,115,114,113,35,100,35,119,108,112,104 -n 64 "$@"
