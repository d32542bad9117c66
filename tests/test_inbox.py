"""The inbox that wakes the sender's and receiver's polls (kvguard.vllm.inbox)."""

from __future__ import annotations

import os
import threading

import pytest
import zmq

from kvguard.vllm import decode_loads, prefill_pushes
from kvguard.vllm.inbox import Inbox, poll_ms
from tests.pd_pair import Pair


def readable(poller: zmq.Poller, inbox: Inbox[int]) -> bool:
    return dict(poller.poll(0)).get(inbox.fileno(), 0) == zmq.POLLIN  # polled as its fd


def test_a_put_makes_the_poll_readable_until_the_owner_drains() -> None:
    inbox: Inbox[int] = Inbox()
    poller = zmq.Poller()
    poller.register(inbox, zmq.POLLIN)
    try:
        assert not readable(poller, inbox)
        assert inbox.drain() == []  # nothing put: the drain does not block either
        for i in range(3):
            inbox.put(i)
        assert readable(poller, inbox)
        assert inbox.drain() == [0, 1, 2]  # oldest first
        assert not readable(poller, inbox)
        inbox.wake()  # a stop flag to see: readable, nothing queued
        assert readable(poller, inbox)
        assert inbox.drain() == []
        assert not readable(poller, inbox)
    finally:
        inbox.close()


def test_puts_from_many_threads_all_arrive_and_leave_it_readable() -> None:
    inbox: Inbox[int] = Inbox()
    poller = zmq.Poller()
    poller.register(inbox, zmq.POLLIN)
    got: list[int] = []
    try:
        workers = [
            threading.Thread(target=lambda k=k: [inbox.put(k * 1000 + i) for i in range(500)])
            for k in range(4)
        ]
        for w in workers:
            w.start()
        while any(w.is_alive() for w in workers) or readable(poller, inbox):
            got += inbox.drain()
        for w in workers:
            w.join()
        got += inbox.drain()
        assert sorted(got) == sorted(k * 1000 + i for k in range(4) for i in range(500))
        for k in range(4):  # each thread's items in the order it put them
            assert [v for v in got if v // 1000 == k] == [k * 1000 + i for i in range(500)]
    finally:
        inbox.close()


def test_after_close_a_put_only_queues() -> None:
    """The eventfd's number may belong to another file by then: nothing is
    written to it (a new eventfd, likely on the same number, stays unread)."""
    inbox: Inbox[str] = Inbox()
    inbox.close()
    inbox.close()  # twice: nothing more
    other = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
    try:
        inbox.put("late")
        inbox.wake()
        assert inbox.drain() == ["late"]
        with pytest.raises(BlockingIOError):  # zero: nothing was written to it
            os.eventfd_read(other)
    finally:
        os.close(other)


@pytest.mark.parametrize(
    ("wake", "now", "want"),
    [
        (None, 5.0, 5),
        (4.0, 5.0, 0),
        (5.0, 5.0, 0),
        (5.0021, 5.0, 3),
        (5.004, 5.0, 4),
        (9.0, 5.0, 5),
    ],
)
def test_the_poll_lasts_until_the_next_timer_rounded_up_and_at_most_the_cap(
    wake: float | None, now: float, want: int
) -> None:
    assert poll_ms(wake, now, 5) == want


def test_a_handover_waits_for_no_poll_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    """With both threads' polls a minute long, a load is still asked, pushed,
    answered and verified at once, and both threads stop at close: each hop
    wakes its thread (the engine's hold, the decode's expect, kvguard's
    release, close). A queue read between polls would wait out the minute."""
    monkeypatch.setattr(prefill_pushes, "_POLL_MS", 60_000)
    monkeypatch.setattr(decode_loads, "_POLL_MS", 60_000)
    pair = Pair()
    try:
        for i in range(3):
            out = pair.load(f"r{i}", [1 + i, 5], [9, 2 + i])  # its hang guard: 10 s
            assert out.ok, out
    finally:
        pair.close()
    assert not pair.sender._thread.is_alive()
    assert not pair.receiver._thread.is_alive()
