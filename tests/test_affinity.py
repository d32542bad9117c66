"""transfer.affinity: kvguard's threads leave a host's pinned core.

Each case runs in a thread of its own pinned to one CPU, as vLLM's CPU
worker pins the thread that registers the KV caches, so pytest's own
threads keep their masks.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import TypeVar

import pytest

from transfer.affinity import parse_cpus, process_cpus, threads_on

T = TypeVar("T")
ALL = frozenset(os.sched_getaffinity(0))
needs_two = pytest.mark.skipif(len(ALL) < 2, reason="needs two CPUs to pin one")


def in_pinned_thread(body: Callable[[], T]) -> T:
    """Run ``body`` in a new thread whose mask is the lowest CPU only."""
    values: list[T] = []
    errors: list[BaseException] = []

    def run() -> None:
        os.sched_setaffinity(0, {min(ALL)})
        try:
            values.append(body())
        except BaseException as exc:  # re-raised in the test's thread
            errors.append(exc)

    t = threading.Thread(target=run)
    t.start()
    t.join(30)
    assert not t.is_alive()
    if errors:
        raise errors[0]
    return values[0]


def started_thread_mask() -> frozenset[int]:
    """The mask a thread started now gets."""
    seen: list[frozenset[int]] = []
    t = threading.Thread(target=lambda: seen.append(frozenset(os.sched_getaffinity(0))))
    t.start()
    t.join(30)
    return seen[0]


@needs_two
def test_threads_started_inside_get_every_cpu_of_the_process_and_the_caller_keeps_its_own() -> None:
    def body() -> tuple[frozenset[int], frozenset[int], frozenset[int], frozenset[int]]:
        before = started_thread_mask()
        with threads_on(parse_cpus("")):
            inside = started_thread_mask()
        return before, inside, started_thread_mask(), frozenset(os.sched_getaffinity(0))

    before, inside, after, caller = in_pinned_thread(body)
    assert before == after == caller == {min(ALL)}
    assert inside == ALL


@needs_two
def test_an_explicit_list_is_what_threads_get_and_inherit_changes_nothing() -> None:
    other = max(ALL)

    def body() -> tuple[frozenset[int], frozenset[int]]:
        with threads_on(parse_cpus(str(other))):
            listed = started_thread_mask()
        with threads_on(parse_cpus("inherit")):
            inherited = started_thread_mask()
        return listed, inherited

    assert in_pinned_thread(body) == (frozenset({other}), frozenset({min(ALL)}))


@needs_two
def test_the_caller_gets_its_mask_back_when_the_body_raises() -> None:
    def body() -> frozenset[int]:
        with pytest.raises(KeyError, match="boom"), threads_on(ALL):
            raise KeyError("boom")
        return frozenset(os.sched_getaffinity(0))

    assert in_pinned_thread(body) == {min(ALL)}


@needs_two
def test_process_cpus_is_the_union_of_every_thread_mask() -> None:
    # A pinned thread is alive while we look: the process still has every CPU.
    assert in_pinned_thread(process_cpus) == ALL


def test_a_cpu_set_the_process_may_not_use_is_an_os_error_naming_it() -> None:
    with pytest.raises(OSError, match=r"CPUs \[65535\]"), threads_on(frozenset({65535})):
        pass
    assert frozenset(os.sched_getaffinity(0)) == ALL


@pytest.mark.parametrize(
    ("text", "want"),
    [("0", {0}), ("0-2", {0, 1, 2}), (" 1,3-4 ", {1, 3, 4}), ("2-2,0", {0, 2}), ("65535", {65535})],
)
def test_cpu_lists_parse_as_linux_writes_them(text: str, want: set[int]) -> None:
    assert parse_cpus(text) == frozenset(want)


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("a", "'a' is not a CPU or a range"),
        ("0-", "'0-' is not a CPU or a range"),
        ("1,,2", "'' is not a CPU or a range"),
        ("3-1", "range '3-1' is empty or out of bounds"),
        ("-1", "'-1' is not a CPU or a range"),
        ("70000", "range '70000' is empty or out of bounds"),
        ("65536", "range '65536' is empty or out of bounds"),
    ],
)
def test_a_bad_cpu_list_is_a_value_error_naming_it(text: str, why: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_cpus(text)
    assert str(info.value) == f"bad CPU list {text.strip()!r}: {why}"
