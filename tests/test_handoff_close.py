"""Closing the hand-off's threads: ``close`` never closes what a sender's or
a receiver's thread may still poll or send on.

ZeroMQ sockets are not thread-safe, and an eventfd closed under a poll may
be another file's number by the next one. Each thread closes its inbox and
sockets (and its ZeroMQ context) itself as it ends; a ``close`` whose
thread does not end in time says so (``sender_thread_not_ended``,
``receiver_thread_not_ended``) and leaves them to it.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from structlog.testing import capture_logs

from kvguard.vllm.decode_loads import DecodeReceiver
from kvguard.vllm.prefill_pushes import PrefillSender
from transfer import KVCache, KVLayout, LocalBackend
from transfer.peer_protocol import peer_message_of

LAYOUT = KVLayout(num_layers=2, num_blocks=4, block_bytes=64, kv_split=False)

pytestmark = pytest.mark.usefixtures("all_levels")


def stuck(monkeypatch: pytest.MonkeyPatch, owner: Any) -> threading.Event:
    """Stop ``owner``'s thread at its next turn until the event returned is set."""
    gate, entered = threading.Event(), threading.Event()
    turn = owner._turn

    def held() -> None:
        entered.set()
        gate.wait(30)  # a hang guard: the test sets it within a second
        turn()

    monkeypatch.setattr(owner, "_turn", held)
    owner._inbox.wake()
    assert entered.wait(5), "the thread never took a turn"
    return gate


def fd_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def close_unended(owner: Any, event: str) -> None:
    """Close ``owner`` with its thread held: ``event`` is logged, once, and
    the thread keeps its inbox, whose fd stays open."""
    fd = owner._inbox.fileno()
    with capture_logs() as logs:
        owner.close(timeout=0.1)
    assert [e for e in logs if e["event"] == event] == [
        {"event": event, "log_level": "error", "timeout_s": 0.1}
    ]
    assert owner._thread.is_alive() and not owner._inbox._closed and fd_open(fd)
    assert not owner._ctx.closed


@pytest.fixture
def backend() -> Iterator[LocalBackend]:
    b = LocalBackend(workers=1)
    yield b
    b.close()


@pytest.fixture
def sender(backend: LocalBackend) -> PrefillSender:
    src = KVCache(LAYOUT)
    backend.register_source(src)
    return PrefillSender(backend, src, "tcp://127.0.0.1:0")


def test_a_sender_whose_thread_will_not_end_leaves_its_inbox_and_socket_to_it(
    monkeypatch: pytest.MonkeyPatch, sender: PrefillSender
) -> None:
    gate = stuck(monkeypatch, sender)
    try:
        close_unended(sender, "sender_thread_not_ended")
        assert not sender._sock.closed
        gate.set()
        sender._thread.join(5)
        assert not sender._thread.is_alive()
        # closed by the thread, at its end
        assert sender._sock.closed and sender._inbox._closed and sender._ctx.closed
        with capture_logs() as logs:
            sender.close(timeout=0.1)  # again: nothing left to do, nothing said
        assert logs == []
    finally:
        gate.set()


def test_a_sender_closes_everything_once_its_thread_ends(sender: PrefillSender) -> None:
    with capture_logs() as logs:
        sender.close(timeout=2.0)
    assert not sender._thread.is_alive() and sender._sock.closed and sender._inbox._closed
    assert sender._ctx.closed and [e for e in logs if "not_ended" in e["event"]] == []


def test_a_receiver_whose_thread_will_not_end_leaves_its_inbox_to_it(
    monkeypatch: pytest.MonkeyPatch, backend: LocalBackend
) -> None:
    receiver = DecodeReceiver(peer_message_of(backend.register_peer("decode:1", KVCache(LAYOUT))))
    gate = stuck(monkeypatch, receiver)
    try:
        close_unended(receiver, "receiver_thread_not_ended")
        gate.set()
        receiver._thread.join(5)
        assert not receiver._thread.is_alive()
        assert receiver._inbox._closed and receiver._ctx.closed  # by the thread, at its end
    finally:
        gate.set()
