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
root="$(cd "$(dirname "$0")/.." && pwd)"
work="${WORK:-/tmp/kvguard-mutmut-safety}"
rm -rf "$work"
mkdir -p "$work"
tar -C "$root" --exclude=./.venv --exclude=./.venv-vllm --exclude=./mutants --exclude=./.git \
    -cf - . | tar -C "$work" -xf -
"$root/.venv/bin/python" - "$work/pyproject.toml" <<'PY'
import re
import sys

path = sys.argv[1]
text = open(path).read()
block = """[tool.mutmut]
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
"""
text = re.sub(r"\[tool\.mutmut\]\n(?:(?!\n\[).)*", block.rstrip(), text, count=1, flags=re.S)
open(path, "w").write(text)
PY
cd "$work"
export HYPOTHESIS_PROFILE=mutmut
exec "$root/.venv/bin/mutmut" run "$@"
