"""The hand-off cores' log lines: one event per transition, with its fields.

A log line is what an operator greps when a load went wrong, so its event
name and fields are part of each core's output: each test drives a core
through a run and asserts every event it logged, in order, exactly
(``structlog.testing.capture_logs``, every level let through).
"""

from __future__ import annotations

import pytest
from structlog.testing import capture_logs
from test_handoff_cores import EP, LAYOUT, D, decode, push

from kvguard.vllm.prefill_core import PrefillCore
from kvguard.vllm.protocol import Abort, Renew, Result
from kvguard.vllm.states import LinkEvent, LoadEnd

pytestmark = pytest.mark.usefixtures("all_levels")


def test_the_prefill_logs_each_refusal_duplicate_and_end_of_a_hold() -> None:
    core = PrefillCore(renew_s=30.0, max_hold_s=60.0, block_bytes=LAYOUT.block_bytes)
    with capture_logs() as logs:
        core.hold("r", [1, 2], 105.0, now=100.0)
        core.hold("r", [1], 105.0, now=100.0)
        core.receive(D, Renew("r"), 100.0, 100.0)  # to 130
        core.receive(D, push(compat="x"), 100.0, 100.0)
        core.receive(D, push(compat="x"), 100.0, 100.0)
        core.receive(D, push(load="e"), 100.0, 100.0)
        core.submit_failed("r", "e", "boom", 100.5)
        core.receive(D, push("s", "f"), 100.0, 100.0)
        core.receive(D, push("s", "f"), 100.0, 100.0)
        core.hold("t", [3], 140.0, now=100.0)
        core.receive(D, push("t", "g"), 100.0, 100.0)
        core.released("t", "g", LoadEnd.TRANSFER_ERROR, "e", 101.0)
        core.step(130.0)
        core.step(400.0)
        core.step(400.5)
    assert logs == [
        {"event": "hold_duplicate", "log_level": "warning", "request": "r"},
        {"event": "hold_renewed", "log_level": "debug", "request": "r", "left_s": 5.0},
        {
            "event": "push_refused",
            "log_level": "warning",
            "request": "r",
            "load": "d",
            "error": "KV layouts differ: decode 'x', prefill ''",
        },
        {"event": "push_duplicate", "log_level": "warning", "request": "r", "load": "d"},
        {
            "event": "push_refused",
            "log_level": "warning",
            "request": "r",
            "load": "e",
            "error": "boom",
        },
        {"event": "push_duplicate", "log_level": "warning", "request": "s", "load": "f"},
        {
            "event": "hold_released",
            "log_level": "debug",
            "request": "t",
            "how": "failed",
            "reason": "transfer_error",
        },
        {"event": "hold_expired", "log_level": "info", "request": "r"},
        {
            "event": "hold_released",
            "log_level": "debug",
            "request": "r",
            "how": "expired",
            "reason": "",
        },
        {"event": "peer_forgotten", "log_level": "info", "peer": "decode:1"},
    ]


def test_the_prefill_logs_a_hold_its_decodes_gave_up_and_nothing_for_stale_events() -> None:
    core = PrefillCore()
    core.hold("r", [1], 130.0, now=100.0)
    with capture_logs() as logs:
        core.receive(D, Renew("r"), 90.0, 90.0)  # extends nothing
        core.submit_failed("r", "nope", "x", 100.0)
        core.released("r", "nope", LoadEnd.LOADED, "", 100.0)
        core.receive(D, Abort("r"), 101.0, 101.0)
    assert logs == [
        {
            "event": "hold_released",
            "log_level": "debug",
            "request": "r",
            "how": "aborted",
            "reason": "",
        }
    ]


def test_the_decode_logs_each_link_transition_and_each_stray_verdict() -> None:
    core = decode()
    other = "tcp://127.0.0.1:7001"
    with capture_logs() as logs:
        core.expect("d", EP, "r", [5], 200.0, 1, now=100.0, wall=1000.0)
        core.expect("d", EP, "r", [5], 200.0, 1, now=100.0, wall=1000.0)
        core.opened(EP, 1, 100.0)
        core.link_event(EP, 1, LinkEvent.CONNECTED, 100.0)
        core.step(103.2504)  # stalled: remade
        core.open_failed(EP, 2, "EMFILE", 103.5)
        core.link_event(EP, 1, LinkEvent.HANDSHAKE, 104.0)
        core.link_event(EP, 1, LinkEvent.DROPPED, 105.0)
        core.result(other, Result("r", "d", True), 105.5)
        core.link_event(EP, 1, LinkEvent.HANDSHAKE, 106.0)
        core.result(EP, Result("r", "d", False, "aborted"), 106.5)
        core.step(160.0)
    assert logs == [
        {"event": "expect_duplicate", "log_level": "error", "request": "d", "remote": "r"},
        {
            "event": "prefill_link_stalled",
            "log_level": "warning",
            "endpoint": EP,
            "waits": 1,
            "after_s": 3.25,
            "last_event": "connected",
        },
        {
            "event": "prefill_link_reopen_failed",
            "log_level": "warning",
            "endpoint": EP,
            "error": "EMFILE",
        },
        {
            "event": "prefill_link_up",
            "log_level": "info",
            "endpoint": EP,
            "was": "DIALING",
            "was_lost": False,
            "waits": 1,
        },
        {"event": "prefill_link_lost", "log_level": "info", "endpoint": EP, "waits": 1},
        {"event": "result_unexpected", "log_level": "info", "endpoint": other, "load": "d"},
        {
            "event": "prefill_link_up",
            "log_level": "info",
            "endpoint": EP,
            "was": "LOST",
            "was_lost": True,
            "waits": 1,
        },
        {"event": "kv_load_released", "log_level": "info", "request": "d", "reason": "aborted"},
        {"event": "prefill_link_closed", "log_level": "info", "endpoint": EP, "state": "UP"},
    ]


def test_a_renewal_logs_how_much_of_the_hold_it_found_left() -> None:
    """``left_s`` near 0: the decode's renewals barely keep up (a slow path to it)."""
    core = PrefillCore(renew_s=30.0, max_hold_s=60.0)
    core.hold("r", [1], 105.0, now=100.0)
    with capture_logs() as logs:
        core.receive(D, Renew("r"), 101.23456, 101.23456)
    assert logs == [
        {"event": "hold_renewed", "log_level": "debug", "request": "r", "left_s": 3.765}
    ]
