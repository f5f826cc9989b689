#!/usr/bin/env bash
# Install the Debian packages kvserve builds and tests with, if any is missing.
set -euo pipefail
pkgs=(build-essential cmake pkg-config clang libclang-rt-14-dev
      libmicrohttpd-dev libcjson-dev libpcre2-dev libxxhash-dev liblmdb-dev libcmocka-dev libcurl4-openssl-dev
      libhiredis-dev redis-server haproxy
      curl chromium)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
# Node may come from outside Debian (its own npm bundled); a Debian npm package
# would conflict with it, so only ask apt when the commands are missing.
command -v node >/dev/null || missing+=(nodejs)
command -v npm >/dev/null || missing+=(npm)
if ((${#missing[@]})); then
  echo "installing: ${missing[*]}"
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}"
fi
