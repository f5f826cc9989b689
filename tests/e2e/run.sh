#!/usr/bin/env bash
# Install the e2e test's npm packages if needed (from package-lock.json), then
# run e2e.mjs. Exit 77 (skipped) when npm cannot install them (offline).
set -u
cd "$(dirname "$0")"
if [ ! -d node_modules/openai ]; then
  if ! command -v npm >/dev/null || ! npm ci --no-audit --no-fund --prefer-offline >/dev/null 2>&1; then
    echo "skipped: cannot install the openai npm package (npm ci failed; offline?)"
    exit 77
  fi
fi
exec node e2e.mjs "$@"
