#!/usr/bin/env bash
# Install the e2e test's npm packages if needed (from package-lock.json), then
# run e2e.mjs. Exit 77 (skipped) when npm cannot install them (offline).
set -u
cd "$(dirname "$0")"
# ctest runs the e2e parts in parallel: one installs, the others wait on the lock.
install_packages() {
  [ -d node_modules/openai ] && return 0
  command -v npm >/dev/null && npm ci --no-audit --no-fund --prefer-offline >/dev/null 2>&1
}
if ! (flock 9 && install_packages) 9>.npm-install.lock; then
  echo "skipped: cannot install the openai npm package (npm ci failed; offline?)"
  exit 77
fi
exec node e2e.mjs "$@"
