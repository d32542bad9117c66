#!/usr/bin/env bash
# Set up a fresh Debian machine for kvguard: the system packages the engine
# and the tests need, then a project virtual environment (.venv) with the CPU
# torch build and kvguard with its dev extra. Idempotent; safe to re-run.
# (scripts/test.sh builds the second environment, .venv-vllm, itself.)
#
# Everything goes into .venv, never into the interpreter first on PATH: a
# stock Debian python refuses `pip install` (PEP 668), and a machine's own
# packages would hide an undeclared dependency.
set -euo pipefail
cd "$(dirname "$0")/.."

SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
# The Mooncake engine links libibverbs at import time, even for TCP;
# iproute2 creates the namespaces of the cross-host tests.
need=()
ldconfig -p | grep -q 'libibverbs\.so\.1' || need+=(libibverbs1)
command -v ip >/dev/null || need+=(iproute2)
# etcd: the metadata service of most Mooncake deployments, started by its tests.
command -v etcd >/dev/null || need+=(etcd-server)
# Graphviz: `kvguard diagram` renders through `dot`, and its tests must not skip.
command -v dot >/dev/null || need+=(graphviz)
python3 -c 'import ensurepip' 2>/dev/null || need+=(python3-venv)
if [ ${#need[@]} -gt 0 ]; then
    $SUDO apt-get update -qq
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}"
fi

VENV=${KVGUARD_VENV:-.venv}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PY="$VENV/bin/python"
"$PY" -m pip install -q --upgrade pip
# The CPU build first: a bare `torch` requirement would pull a multi-GB CUDA build.
"$PY" -m pip install -q torch==2.13.0
"$PY" -m pip install -q -e '.[dev,cpu]'
