"""The vLLM tests' failure messages: counts and kvguard's lines (tests/vllm/diagnosis.py)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from tests.vllm.diagnosis import state_of

LOG = """\
(APIServer pid=1) INFO 12-07 06:04:16 [api_router.py:39] Resetting prefix cache...
2026-12-07 06:03:01 [info     ] prefill_link_lost              endpoint=tcp://127.0.0.1:1 waits=2
2026-12-07 06:03:01 [warning  ] kv_load_failed                 fenced=True reason=peer_lost
(EngineCore pid=2) WARNING 12-07 06:04:16 [block_pool.py:839] Failed to reset prefix cache
2026-12-07 06:03:02 [error    ] receiver_loop_error            error=boom
"""


@dataclass
class FakeServer:
    name: str = "decode-0"
    samples: dict[str, float] = field(default_factory=dict)
    down: bool = False

    def metrics(self) -> dict[str, float]:
        if self.down:
            raise ConnectionRefusedError("refused")
        return self.samples

    def log_tail(self, lines: int = 40, grep: str = "") -> str:

        keep = [t for t in LOG.splitlines() if not grep or re.search(grep, t)]
        return "\n".join(keep[-lines:])


def test_a_state_names_the_counts_the_transfers_and_only_kvguard_lines() -> None:
    server = FakeServer(
        samples={
            'vllm:num_requests_running{engine="0"}': 0.0,
            'vllm:num_requests_waiting{engine="0"}': 9.0,
            'vllm:kv_cache_usage_perc{engine="0"}': 0.25,
            'vllm:kvguard_held_blocks{engine="0"}': 4.0,
            'vllm:kvguard_held_blocks{engine="1"}': 2.0,
            'vllm:kvguard_quarantined_blocks{engine="0"}': 18.0,
            'vllm:kvguard_oldest_live_load_seconds{engine="0"}': 0.0,
            'vllm:kvguard_transfers_total{engine="0",role="decode",outcome="failed",'
            'reason="peer_lost"}': 9.0,
            'vllm:kvguard_transfers_total{engine="0",role="decode",outcome="loaded",'
            'reason=""}': 40.0,
            'vllm:kvguard_transfers_total{engine="0",role="decode",outcome="failed",'
            'reason="timeout"}': 0.0,
        }
    )
    lines = state_of(server).splitlines()
    assert lines[0] == (
        "--- decode-0: num_requests_running=0 num_requests_waiting=9 kv_cache_usage_perc=0.25 "
        "kvguard_held_blocks=6 kvguard_quarantined_blocks=18 kvguard_oldest_live_load_seconds=0"
    )
    assert lines[1] == "  transfers: decode/failed/peer_lost=9, decode/loaded=40"
    assert [x.split("]")[1].split()[0] for x in lines[2:]] == [
        "prefill_link_lost",
        "kv_load_failed",
        "receiver_loop_error",
    ]


def test_a_state_of_a_server_without_metrics_still_shows_its_lines() -> None:
    lines = state_of(FakeServer(down=True), lines=1).splitlines()
    assert lines == [
        "--- decode-0: (no metrics: refused)",
        "2026-12-07 06:03:02 [error    ] receiver_loop_error            error=boom",
    ]
