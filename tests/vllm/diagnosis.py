"""What a server still holds, and kvguard's last word on it: for a failing test's message.

A server that keeps KV blocks (a prefix cache that will not reset, a server
never idle) shows it only in vLLM's counts. This adds kvguard's gauges
(held, quarantined, the oldest live transfer), the transfers by outcome,
and kvguard's own log lines (links, loads, holds, fences, the threads'
errors), so a CI failure names the load or link that never ended.
"""

from __future__ import annotations

import re
from typing import Final, Protocol

__all__ = ["KVGUARD_LINES", "state_of", "total"]

# kvguard's events in a server's log: structlog's event names and the worker's lines.
KVGUARD_LINES: Final = (
    r"prefill_link_|kv_load_|KV load|_loop_error|thread_not_ended|expect_duplicate|"
    r"result_unexpected|send_failed|hold_|push_|peer_forgotten|KV load failure|"
    r"Failing \d+ request"
)
_COUNTS: Final = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:kvguard_held_blocks",
    "vllm:kvguard_quarantined_blocks",
    "vllm:kvguard_oldest_live_load_seconds",
)


class _Server(Protocol):
    name: str

    def metrics(self) -> dict[str, float]: ...

    def log_tail(self, lines: int = 40, grep: str = "") -> str: ...


def state_of(server: _Server, lines: int = 40) -> str:
    """``server``'s counts, its kvguard transfers by outcome, and its last
    ``lines`` kvguard log lines."""
    try:
        m = server.metrics()
    except OSError as exc:  # a dead or hung server: its log still speaks
        counts = f"(no metrics: {exc})"
    else:
        parts = [f"{k.split(':', 1)[1]}={total(m, k):g}" for k in _COUNTS]
        transfers = sorted(
            f"{_labels(k)}={v:g}"
            for k, v in m.items()
            if k.startswith("vllm:kvguard_transfers_total{") and v
        )
        counts = " ".join(parts) + "\n  transfers: " + (", ".join(transfers) or "none")
    log = server.log_tail(lines, KVGUARD_LINES) or "(no kvguard lines)"
    return f"--- {server.name}: {counts}\n{log}"


def total(m: dict[str, float], name: str) -> float:
    """``name``'s samples in ``m``, summed over their labels."""
    return sum(v for k, v in m.items() if k.split("{")[0] == name)


def _labels(key: str) -> str:
    """The role, outcome and reason labels of a transfers sample."""
    found = dict(re.findall(r'(\w+)="([^"]*)"', key))
    return "/".join(found.get(x, "") for x in ("role", "outcome", "reason")).rstrip("/")
