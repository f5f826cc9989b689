#!/usr/bin/env bash
# Install missing Debian packages, build Release into build/, then run the
# main job, the OpenAI-compatible server, on the built-in default model
# (build/default-model.gguf, made by `kvserve synth` during the build). Extra
# arguments go to `kvserve serve`, e.g. `scripts/run.sh -m model.gguf --port 9000`.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${KVSERVE_BUILD_DIR:-build}
# Only nodejs/npm (end-to-end tests) are optional here: if apt cannot install
# something, try the build anyway; cmake names any library that is missing.
scripts/deps.sh || echo "run.sh: scripts/deps.sh failed; trying to build with what is installed" >&2
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$build" -j "$(nproc)"
exec "$build/kvserve" serve "$@"
