"""The engine core's doorbell (``kvguard.vllm.idle``): the sender and receiver
threads ring it once a release or a load can be taken, never before, and a
ring is a hint that cannot block them or be lost to the next wait."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import zmq
from structlog.testing import capture_logs

from kvguard.vllm.decode_loads import DecodeReceiver
from kvguard.vllm.idle import Bell, Doorbell, bell_endpoint, doorbell_route
from kvguard.vllm.prefill_pushes import PrefillSender
from transfer import FaultInjectingBackend, FaultKind, FaultPlan, KVCache, KVLayout, LocalBackend
from transfer.peer_protocol import peer_message_of

LAYOUT = KVLayout(num_layers=2, num_blocks=16, block_bytes=256)
LONG = 30.0  # a hang guard: every wait below that should end ends at once


@pytest.fixture
def endpoint(tmp_path: Path) -> str:
    return f"ipc://{tmp_path}/bell"


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    c: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield c
    c.term()


def test_each_engine_and_role_has_its_own_abstract_endpoint() -> None:
    a = bell_endpoint("engine-a", producer=False)
    others = {bell_endpoint("engine-a_dp1", False), bell_endpoint("engine-a", True)}
    assert a == bell_endpoint("engine-a", False) and a not in others and len(others) == 2
    assert a.startswith("ipc://@kvguard-")  # no file, wherever TMPDIR points
    assert len(bell_endpoint("x" * 500, True)) == len(a) < 100  # IPC names are short


def _config(batches: int = 1, dp: int = 1, engine_id: str | None = "e1") -> Any:
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(engine_id=engine_id),
        max_concurrent_batches=batches,
        parallel_config=SimpleNamespace(data_parallel_size=dp),
    )


@pytest.mark.parametrize(
    ("config", "wait_ms", "why"),
    [
        (_config(), 0.0, "kvguard_idle_wait_ms is 0"),
        (_config(batches=2), 5.0, "vLLM's batch queue reads a step's output late"),
        (_config(dp=2), 5.0, "data parallel ranks step together"),
        (_config(engine_id=None), 5.0, "no engine id"),
    ],
)
def test_no_doorbell_where_a_wait_could_hold_up_a_step_that_runs(
    config: Any, wait_ms: float, why: str
) -> None:
    assert doorbell_route(config, False, wait_ms) == ("", why)


def test_an_engine_one_batch_at_a_time_has_a_doorbell_per_role() -> None:
    assert doorbell_route(_config(), True, 5.0) == (bell_endpoint("e1", True), "")
    assert doorbell_route(_config(), False, 0.5) == (bell_endpoint("e1", False), "")


def test_a_second_engine_with_the_same_id_and_role_cannot_take_the_doorbell() -> None:
    where = bell_endpoint(f"twice-{uuid.uuid4()}", False)
    first = Doorbell(where)
    try:
        with pytest.raises(OSError, match="kvguard doorbell cannot listen on " + where):
            Doorbell(where)
    finally:
        first.close()


@pytest.mark.usefixtures("all_levels")
def test_a_bell_that_cannot_connect_is_logged_and_rings_nothing(
    tmp_path: Path, ctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    where = f"ipc://{tmp_path}/{'x' * 200}"  # longer than an IPC path may be
    with capture_logs() as logs:
        bell = Bell(ctx, where)
    bell.ring()
    bell.close()
    (event,) = [e for e in logs if e["event"] == "idle_bell_unavailable"]
    assert event["endpoint"] == where and event["error"]


def test_a_ring_before_the_wait_counts_and_many_count_once(
    endpoint: str, ctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    door, bell = Doorbell(endpoint), Bell(ctx, endpoint)
    try:
        assert door.wait(0) is False
        for _ in range(50):  # never blocks, whoever reads
            bell.ring()
        t0 = time.monotonic()
        assert door.wait(LONG) is True
        assert time.monotonic() - t0 < LONG / 2
        assert door.wait(0.05) is False  # drained: the next wait waits
    finally:
        bell.close()
        door.close()


def test_a_ring_from_another_thread_ends_a_wait(
    endpoint: str, ctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    door, bell = Doorbell(endpoint), Bell(ctx, endpoint)
    ringer = threading.Thread(target=bell.ring)
    try:
        t0 = time.monotonic()
        ringer.start()
        assert door.wait(LONG) is True
        assert time.monotonic() - t0 < LONG / 2
    finally:
        ringer.join()
        bell.close()
        door.close()


def test_a_bell_rings_before_anyone_listens_and_without_an_endpoint(
    endpoint: str, ctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    early = Bell(ctx, endpoint)  # the workers start before the engine core's scheduler
    early.ring()
    early.ring()
    nothing = Bell(ctx, "")
    nothing.ring()
    nothing.close()
    door = Doorbell(endpoint)
    try:
        early.ring()
        assert door.wait(LONG) is True
    finally:
        early.close()
        door.close()


def test_a_doorbell_that_cannot_listen_says_where(tmp_path: Path) -> None:
    where = f"ipc://{tmp_path}/no/such/dir/bell"
    with pytest.raises(OSError, match="kvguard doorbell cannot listen on " + where):
        Doorbell(where)


class Rung:
    """A prefill and a decode whose threads ring doorbells of their own."""

    def __init__(self, tmp: Path, hang: bool = False) -> None:
        self.src, self.dst = KVCache(LAYOUT), KVCache(LAYOUT)
        self.src.fill_seeded(3)
        self.backend = LocalBackend(workers=2)
        self.backend.register_source(self.src)
        info = self.backend.register_peer("decode:1", self.dst)
        self.hanging = FaultInjectingBackend(self.backend, FaultPlan.script([FaultKind.HANG]))
        self.prefill_door = Doorbell(f"ipc://{tmp}/prefill")
        self.decode_door = Doorbell(f"ipc://{tmp}/decode")
        self.sender = PrefillSender(
            self.hanging if hang else self.backend,
            self.src,
            "tcp://127.0.0.1:0",
            bell=f"ipc://{tmp}/prefill",
        )
        self.receiver = DecodeReceiver(
            peer_message_of(info),
            heartbeat_s=0.2,
            heartbeat_timeout_s=0.6,
            bell=f"ipc://{tmp}/decode",
        )

    def close(self) -> None:
        self.receiver.close()
        self.sender.close(timeout=2.0)
        self.backend.close()
        self.prefill_door.close()
        self.decode_door.close()


def test_each_side_rings_once_what_it_rings_for_can_be_taken(tmp_path: Path) -> None:
    r = Rung(tmp_path)
    try:
        r.sender.hold("r1", [1, 2], time.monotonic() + LONG)
        assert r.prefill_door.wait(0.2) is False  # held: nothing to take yet
        assert r.decode_door.wait(0) is False
        r.receiver.expect("d1", r.sender.endpoint, "r1", [3, 4], time.monotonic() + LONG)
        assert r.decode_door.wait(LONG) is True
        (out,) = r.receiver.take_finished()  # rung after it was there
        assert (out.request_id, out.ok) == ("d1", True)
        assert r.prefill_door.wait(LONG) is True
        assert r.sender.take_released() == {"r1"}
        assert r.prefill_door.wait(0) is False and r.decode_door.wait(0) is False
    finally:
        r.close()


def test_a_failed_load_rings_when_reported_and_again_when_its_blocks_are_free(
    tmp_path: Path,
) -> None:
    """The prefill's engine hangs: the load fails at its deadline, fenced (a
    ring); its blocks are named free only once the engine let go (another)."""
    r = Rung(tmp_path, hang=True)
    try:
        r.sender.hold("r1", [1], time.monotonic() + LONG)
        r.receiver.expect("d1", r.sender.endpoint, "r1", [2], time.monotonic() + 0.5)
        assert r.decode_door.wait(LONG) is True
        (out,) = r.receiver.take_finished()
        assert (out.ok, out.reason, out.fenced) == (False, "timeout", True)
        assert r.receiver.take_released() == []
        assert r.decode_door.wait(0.3) is False  # the engine still writes the blocks
        r.hanging.release_hangs()
        assert r.decode_door.wait(LONG) is True
        assert r.receiver.take_released() == ["d1"]
        assert r.prefill_door.wait(LONG) is True
        assert r.sender.take_released() == {"r1"}
    finally:
        r.close()
