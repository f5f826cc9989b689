#!/usr/bin/env bash
# kvserve's Anthropic and Responses routes driven by the official npm clients
# (@anthropic-ai/sdk, openai). Installs them from package-lock.json if needed
# (npm ci); exits 77 (skipped) when they are absent and npm cannot install
# them (offline). By hand: cd tests/e2e/sdk && npm ci.
set -u
cd "$(dirname "$0")"
install_packages() {
  [ -d node_modules/@anthropic-ai/sdk ] && [ -d node_modules/openai ] && return 0
  command -v npm >/dev/null && npm ci --no-audit --no-fund --prefer-offline >/dev/null 2>&1
}
if ! (flock 9 && install_packages) 9>.npm-install.lock; then
  echo "skipped: cannot install @anthropic-ai/sdk and openai (npm ci in tests/e2e/sdk failed; offline?)"
  exit 77
fi
exec node apis_sdk.mjs "$@"
