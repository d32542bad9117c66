#!/usr/bin/env bash
# Set up a fresh Debian machine for kvguard: system library, CPU torch, the
# project with its dev extra. Idempotent; safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."

SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
# The Mooncake engine links libibverbs at import time, even for TCP.
if ! ldconfig -p | grep -q 'libibverbs\.so\.1'; then
    $SUDO apt-get update -qq
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1
fi
PY=${PYTHON:-python3}
# The CPU build first: a bare `torch` requirement would pull a multi-GB CUDA build.
"$PY" -m pip install -q torch==2.13.0
"$PY" -m pip install -q -e '.[dev]'
