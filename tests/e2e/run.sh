#!/usr/bin/env bash
# Install the e2e test's npm packages if needed (from package-lock.json), then
# run e2e.mjs (or clients.mjs for the part "clients"). Exit 77 (skipped) when
# npm cannot install them (offline).
set -u
cd "$(dirname "$0")"
# ctest runs the e2e parts in parallel: one installs, the others wait on the lock.
install_packages() {
  local pkg missing=
  for pkg in openai ai @ai-sdk/openai-compatible @langchain/openai zod; do [ -d "node_modules/$pkg" ] || missing=1; done
  [ -z "$missing" ] && return 0
  command -v npm >/dev/null && npm ci --no-audit --no-fund --prefer-offline >/dev/null 2>&1
}
if ! (flock 9 && install_packages) 9>.npm-install.lock; then
  echo "skipped: cannot install the npm packages (npm ci failed; offline?)"
  exit 77
fi
# clients: the Vercel AI SDK and LangChain (clients.mjs); the other parts: e2e.mjs
[ "${1:-}" = clients ] && exec node clients.mjs
exec node e2e.mjs "$@"
