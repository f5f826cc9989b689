#!/usr/bin/env bash
# Install missing Debian packages, build Release into build/, then run the
# main job on the built-in default model (build/default-model.gguf, made by
# `kvserve synth` during the build). Extra arguments go to the command, e.g.
# `scripts/run.sh -m model.gguf -n 128`.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${KVSERVE_BUILD_DIR:-build}
# Only nodejs/npm (end-to-end tests) are optional here: if apt cannot install
# something, try the build anyway; cmake names any library that is missing.
scripts/deps.sh || echo "run.sh: scripts/deps.sh failed; trying to build with what is installed" >&2
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$build" -j "$(nproc)"
# The demo: 64 tokens after a short prompt, streamed as text, with a timing
# line on stderr. The default model's weights are random, so is its text.
exec "$build/kvserve" serve "$@"
