"""The connector's engine settings: transfers in flight and Mooncake's protocol.

Runs in ``.venv-vllm`` (the connector imports vLLM); its conftest
gates the import.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvguard.vllm.settings import Settings
from transfer.mooncake import engine_peer_budget

pytestmark = [pytest.mark.vllm, pytest.mark.mooncake]

_QUEUED = "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER"
_PENDING = "MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER"


def test_inflight_defaults_to_the_engines_per_peer_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(_QUEUED, raising=False)
    monkeypatch.delenv(_PENDING, raising=False)
    s = Settings.of({})
    assert s.max_inflight == 0
    assert s.inflight() == engine_peer_budget() == 1024 + 1024


def test_inflight_default_follows_the_engines_own_limits(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(_QUEUED, "100")
    monkeypatch.setenv(_PENDING, "7")
    assert Settings.of({}).inflight() == 107


def test_loads_are_verified_unless_turned_off() -> None:
    assert Settings.of({}).verify is True
    assert Settings.of({"kvguard_verify": False}).verify is False


def test_max_inflight_overrides_the_budget() -> None:
    s = Settings.of({"kvguard_max_inflight": "16"})
    assert (s.max_inflight, s.inflight()) == (16, 16)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"kvguard_max_inflight": -1}, "kvguard_max_inflight must be >= 0, got -1"),
        (
            {"kvguard_protocol": "udp"},
            "kvguard_protocol must be one of ('tcp', 'rdma'), got 'udp'",
        ),
        # The old fixed-count setting is gone, not silently ignored.
        ({"kvguard_workers": 4}, "unknown kvguard setting 'kvguard_workers'"),
        # bool("false") is True: a flag takes a JSON boolean only.
        ({"kvguard_verify": "false"}, "kvguard_verify must be true or false, got 'false'"),
        ({"kvguard_verify": 0}, "kvguard_verify must be true or false, got 0"),
    ],
)
def test_bad_engine_settings_name_the_key_and_value(extra: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError) as info:
        Settings.of(extra)
    assert str(info.value) == message


_MAKE = """
import sys
from kvguard.vllm.settings import Settings
extra = {"kvguard_protocol": sys.argv[1]} if len(sys.argv) > 1 else {}
Settings.of(extra).make_backend().close()
"""


def _engine_log(*protocol: str) -> str:
    """The engine's own log lines while the connector's backend is built."""
    env = {k: v for k, v in os.environ.items() if k != "MC_FORCE_TCP"}
    env.update(KVGUARD_ENGINE_LOG="1", MC_LOG_LEVEL="INFO")
    proc = subprocess.run(
        [sys.executable, "-c", _MAKE, *protocol],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return proc.stderr


def test_tcp_is_the_default_and_forced() -> None:
    log = _engine_log()
    assert "for protocol: tcp" in log
    assert "MC_FORCE_TCP is set, using TCP transport only" in log


def test_rdma_reaches_the_engine_unforced() -> None:
    # This host has no RDMA NIC: the engine looks for one, finds none and
    # serves over its TCP transport; the RDMA data path is not exercised here.
    log = _engine_log("rdma")
    assert "for protocol: rdma" in log
    assert "Auto-discovering topology" in log
    assert "MC_FORCE_TCP is set" not in log


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            {"kvguard_deadline_s": 0},
            "kvguard_deadline_s must be > 0 and <= kvguard_max_deadline_s (60.0), got 0.0",
        ),
        (
            {"kvguard_deadline_s": 90},
            "kvguard_deadline_s must be > 0 and <= kvguard_max_deadline_s (60.0), got 90.0",
        ),
        (
            {"kvguard_hold_s": 400},
            "kvguard_hold_s must be > 0 and <= kvguard_max_hold_s (300.0), got 400.0",
        ),
        ({"kvguard_cpus": "2-1"}, "kvguard_cpus: bad CPU list '2-1': range '2-1' is empty"),
    ],
)
def test_bad_deadline_hold_and_cpu_settings_name_the_value(
    extra: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError) as info:
        Settings.of(extra)
    assert str(info.value).startswith(message)


@pytest.mark.parametrize(
    ("asked", "used"),
    [(5, 5.0), ("7.5", 7.5), (600, 20.0), (0, 10.0), (-3, 10.0), ("soon", 10.0), (None, 10.0)],
)
def test_a_clients_deadline_is_capped_by_the_server_and_junk_gets_the_default(
    asked: object, used: float
) -> None:
    """A client's kvguard_deadline_s pins blocks on both engines: the server's
    cap bounds it; what is not a number > 0 gets the server's default."""
    from kvguard.vllm.params import deadline_s

    s = Settings.of({"kvguard_max_deadline_s": 20})
    assert deadline_s({"kvguard_deadline_s": asked}, s.deadline_s, s.max_deadline_s) == used
