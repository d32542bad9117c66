#!/usr/bin/env bash
# Every test, the README's test command (after scripts/bootstrap.sh) and CI's:
#   1. builds .venv-vllm (scripts/vllm-env.sh; idempotent),
#   2. runs the suite in .venv: every test but tests/vllm/,
#   3. runs tests/vllm/ (vLLM's tests; their harness is the package tests.vllm)
#      in .venv-vllm.
# The two runs split the files, not the markers, so no test is deselected in
# both. --strict-skips fails a run on any skip not allowed in
# tests/skip_policy.py (CUDA tests on a host without CUDA, namespace tests
# without root); -ra in pyproject lists every skip with its reason. Both runs
# always run; the exit status is the first failing one's.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
    echo "scripts/test.sh: no .venv here; run scripts/bootstrap.sh first" >&2
    exit 2
fi
bash scripts/vllm-env.sh

status=0
echo "== tests in .venv (all but tests/vllm/)"
.venv/bin/python -m pytest -q --strict-skips --ignore=tests/vllm || status=$?
echo "== vLLM tests in .venv-vllm (tests/vllm/)"
# KVGUARD_REQUIRE_VLLM=1: a vLLM that does not import is an error, not a skip.
# The tensor parallel module first: it starts and stops the most memory
# (four servers, six workers), and on the CI VM memory churn late in a long
# run has frozen every process for tens of seconds (docs/vllm.md). pytest
# collects a file named twice once, in the order of the arguments (a folder
# argument would be collected in its own order).
KVGUARD_REQUIRE_VLLM=1 .venv-vllm/bin/python -m pytest -q --strict-skips \
    tests/vllm/test_vllm_tp.py tests/vllm/test_*.py ||
    { rc=$?; [ "$status" -ne 0 ] || status=$rc; }
exit "$status"
