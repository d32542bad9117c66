#!/usr/bin/env bash
# Mutation testing of the hand-off's sans-I/O cores (kvguard/vllm), beside
# pyproject's own [tool.mutmut] (the lifecycle and the scheduler core):
#   bash scripts/mutmut-handoff.sh [mutmut run args]   then, in $WORK:
#   ../.venv/bin/mutmut results
# It copies the checkout to $WORK (default /tmp/kvguard-mutmut-handoff),
# points [tool.mutmut] at the cores and at their tests -- the examples
# (tests/test_handoff_cores.py; the edges and log lines in
# tests/test_handoff_{prefill_edges,decode_edges,logs}.py) and the
# simulation, whose hypothesis search runs KVGUARD_SIM_EXAMPLES worlds per
# mutant (60 unless set) -- and runs mutmut there. A mutant only has to be
# detected: no shrinking.
set -euo pipefail
export WORK="${WORK:-/tmp/kvguard-mutmut-handoff}"
export KVGUARD_SIM_EXAMPLES="${KVGUARD_SIM_EXAMPLES:-60}"
export MUTMUT_BLOCK='[tool.mutmut]
source_paths = [
    "kvguard/vllm/prefill_core.py",
    "kvguard/vllm/prefill_records.py",
    "kvguard/vllm/admission.py",
    "kvguard/vllm/peer_ledger.py",
    "kvguard/vllm/decode_core.py",
    "kvguard/vllm/decode_links.py",
    "kvguard/vllm/decode_records.py",
    "kvguard/vllm/decode_legs.py",
]
timeout_multiplier = 4.0
also_copy = ["docs/", "lifecycle/", "scheduler/", "transfer/", "kvguard/", "benchmarks/"]
pytest_add_cli_args_test_selection = [
    "tests/test_handoff_cores.py",
    "tests/test_handoff_prefill_edges.py",
    "tests/test_handoff_decode_edges.py",
    "tests/test_handoff_logs.py",
    "tests/test_handoff_sim.py::test_the_clean_cores_pass_the_same_seeds",
    "tests/test_handoff_sim.py::test_random_worlds_keep_every_invariant",
    "tests/test_pd_protocol.py",
    "tests/test_tp_ranks.py",
]
'
exec bash "$(dirname "$0")/mutmut-subset.sh" "$@"
