#!/usr/bin/env bash
# Installs every Debian package fusion needs to build, test and run.
# Idempotent and non-interactive: packages already present are not touched, and
# `apt-get update` runs at most once per invocation, only when something is missing.
set -euo pipefail

PACKAGES=(
  build-essential cmake pkg-config git
  libzmq3-dev
  libprotobuf-c-dev protobuf-c-compiler
  libsodium-dev
  libsqlite3-dev sqlite3
  libcmocka-dev
  libopenblas-dev liblapacke-dev
  libcjson-dev
  libmicrohttpd-dev  # the broker's --http listener (/metrics)
  curl  # tests scrape /metrics as an operator would
  chromium  # the dashboard's browser test (headless)
  clang libclang-rt-14-dev
  iproute2 procps
  python3-torch  # the independent reference of tests/reference/hf_reference.py (run as /usr/bin/python3)
)

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed'; then
    missing+=("$p")
  fi
done

# node and npm fetch the test data (deploy/fetch-test-data.sh); a NodeSource nodejs, which
# carries its own npm, counts as installed.
if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
  missing+=(nodejs npm)
fi

if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#PACKAGES[@]} packages present"
  exec "$(dirname "$0")/fetch-test-data.sh"
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null || { echo "install-deps: need root or sudo to install: ${missing[*]}" >&2; exit 1; }
  SUDO="sudo"
fi

echo "install-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q
$SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
echo "install-deps: done"
exec "$(dirname "$0")/fetch-test-data.sh"
