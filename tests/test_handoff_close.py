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


def test_a_sender_whose_thread_will_not_end_leaves_its_inbox_and_socket_to_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    backend = LocalBackend(workers=1)
    src = KVCache(LAYOUT)
    backend.register_source(src)
    sender = PrefillSender(backend, src, "tcp://127.0.0.1:0")
    fd = sender._inbox.fileno()
    try:
        gate = stuck(monkeypatch, sender)
        with capture_logs() as logs:
            sender.close(timeout=0.1)
        assert [e for e in logs if e["event"] == "sender_thread_not_ended"] == [
            {"event": "sender_thread_not_ended", "log_level": "error", "timeout_s": 0.1}
        ]
        assert sender._thread.is_alive() and not sender._inbox._closed and fd_open(fd)
        assert not sender._sock.closed and not sender._ctx.closed
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
        backend.close()


def test_a_sender_closes_everything_once_its_thread_ends() -> None:
    backend = LocalBackend(workers=1)
    src = KVCache(LAYOUT)
    backend.register_source(src)
    sender = PrefillSender(backend, src, "tcp://127.0.0.1:0")
    with capture_logs() as logs:
        sender.close(timeout=2.0)
    assert not sender._thread.is_alive() and sender._sock.closed and sender._inbox._closed
    assert sender._ctx.closed and [e for e in logs if "not_ended" in e["event"]] == []
    backend.close()


def test_a_receiver_whose_thread_will_not_end_leaves_its_inbox_to_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    backend = LocalBackend(workers=1)
    info = backend.register_peer("decode:1", KVCache(LAYOUT))
    receiver = DecodeReceiver(peer_message_of(info))
    fd = receiver._inbox.fileno()
    try:
        gate = stuck(monkeypatch, receiver)
        with capture_logs() as logs:
            receiver.close(timeout=0.1)
        assert [e for e in logs if e["event"] == "receiver_thread_not_ended"] == [
            {"event": "receiver_thread_not_ended", "log_level": "error", "timeout_s": 0.1}
        ]
        assert receiver._thread.is_alive() and not receiver._inbox._closed and fd_open(fd)
        assert not receiver._ctx.closed
        gate.set()
        receiver._thread.join(5)
        assert not receiver._thread.is_alive()
        assert receiver._inbox._closed and receiver._ctx.closed  # by the thread, at its end
    finally:
        gate.set()
        backend.close()
