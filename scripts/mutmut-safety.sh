#!/usr/bin/env bash
# Mutation testing of what guards a load beyond its lifecycle: the digest
# (transfer/checksum.py), its check (kvguard/vllm/integrity.py), the CURVE
# keys (kvguard/curve.py) and the proxy's backend pool (kvguard/proxy/backends.py):
#   bash scripts/mutmut-safety.sh [mutmut run args]   then, in $WORK:
#   $ROOT/.venv/bin/mutmut results
# As scripts/mutmut-handoff.sh: a copy of the checkout in $WORK (default
# /tmp/kvguard-mutmut-safety) whose [tool.mutmut] points at these modules
# and their tests.
set -euo pipefail
export WORK="${WORK:-/tmp/kvguard-mutmut-safety}"
export MUTMUT_BLOCK='[tool.mutmut]
source_paths = [
    "transfer/checksum.py",
    "kvguard/vllm/integrity.py",
    "kvguard/curve.py",
    "kvguard/proxy/backends.py",
]
timeout_multiplier = 4.0
pytest_add_cli_args = ["-m", "not mooncake", "-p", "no:cacheprovider"]
also_copy = ["docs/", "lifecycle/", "scheduler/", "transfer/", "kvguard/", "benchmarks/"]
pytest_add_cli_args_test_selection = [
    "tests/test_checksum.py",
    "tests/test_pd_integrity.py",
    "tests/test_curve.py",
    "tests/test_pd_auth.py",
    "tests/test_proxy.py",
]
'
exec bash "$(dirname "$0")/mutmut-subset.sh" "$@"
