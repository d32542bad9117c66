#!/usr/bin/env bash
# mutmut on a copy of the checkout whose [tool.mutmut] is $MUTMUT_BLOCK, in
# $WORK (removed first): what scripts/mutmut-handoff.sh and
# scripts/mutmut-safety.sh share. A mutant only has to be detected: the
# mutmut hypothesis profile (tests/conftest.py), no shrinking.
#   MUTMUT_BLOCK=... WORK=... bash scripts/mutmut-subset.sh [mutmut run args]
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
work="${WORK:?WORK names the copy}"
rm -rf "$work"
mkdir -p "$work"
tar -C "$root" --exclude=./.venv --exclude=./.venv-vllm --exclude=./mutants --exclude=./.git \
    -cf - . | tar -C "$work" -xf -
"$root/.venv/bin/python" - "$work/pyproject.toml" <<'PY'
import os
import re
import sys

path = sys.argv[1]
text = open(path).read()
block = os.environ["MUTMUT_BLOCK"]
text = re.sub(r"\[tool\.mutmut\]\n(?:(?!\n\[).)*", block.rstrip(), text, count=1, flags=re.S)
open(path, "w").write(text)
PY
cd "$work"
export HYPOTHESIS_PROFILE=mutmut
exec "$root/.venv/bin/mutmut" run "$@"
