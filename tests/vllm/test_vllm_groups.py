"""The decode scheduler's load groups: n > 1 children load one prefill request.

vLLM splits a request with n > 1 into n engine requests that share one
``kvguard_request_id``. Its API server adds them one message at a time, so
the engine may allocate and push one before the next arrives, and the
scheduler may allocate them steps apart (token budget, free blocks): each
load must still tell the prefill the whole group, or the prefill ends its
hold after the first child and the others get ``unknown_request``. The
group's size is what the children seen say, or what the client declared
(``kvguard_loads``, which kvguard proxy sets to n), whichever is larger.

Runs the real scheduler-side connector in ``.venv-vllm``; the requests are
the fields vLLM's scheduler hands it.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from structlog.testing import capture_logs
from vllm.config import KVTransferConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.request import RequestStatus

from kvguard.vllm.connector import KVGuardConnector, KVGuardMetadata
from kvguard.vllm.metadata import ForgetMeta
from kvguard.vllm.params import PROMPT_DIGEST, TOKENS, Source, prompt_digest

pytestmark = [pytest.mark.vllm]

ENDPOINT = "tcp://127.0.0.1:17600"


@pytest.fixture(scope="module")
def connector() -> Iterator[KVGuardConnector]:
    kv = KVTransferConfig(
        kv_connector="KVGuardConnector",
        kv_connector_module_path="kvguard.vllm.connector",
        kv_role="kv_consumer",
        kv_connector_extra_config={},
    )
    c = KVGuardConnector(VllmConfig(kv_transfer_config=kv), KVConnectorRole.SCHEDULER)
    yield c
    c.shutdown()  # its doorbell's socket


def request(rid: str, remote: str, loads: object = None) -> Any:
    params: dict[str, Any] = {
        "do_remote_prefill": True,
        "kvguard_endpoint": ENDPOINT,
        "kvguard_request_id": remote,
        "kvguard_deadline_s": 10.0,
        "kvguard_hold_s": 30.0,
    }
    if loads is not None:
        params["kvguard_loads"] = loads
    return SimpleNamespace(
        request_id=rid,
        kv_transfer_params=params,
        prompt_token_ids=list(range(40)),
        status=RequestStatus.WAITING,
    )


def blocks(*ids: int) -> Any:
    return SimpleNamespace(get_unhashed_block_ids_all_groups=lambda: [list(ids)])


def allocate(c: KVGuardConnector, req: Any, *ids: int) -> None:
    c.update_state_after_alloc(req, blocks(*ids), 40)


def step(c: KVGuardConnector) -> KVGuardMetadata:
    meta = c.build_connector_meta(SimpleNamespace(total_num_scheduled_tokens=0))  # type: ignore[arg-type]
    assert isinstance(meta, KVGuardMetadata)
    return meta


def groups(c: KVGuardConnector) -> dict[tuple[str, str], Any]:
    """The scheduler side's load groups, by prefill request."""
    assert c.connector_scheduler is not None
    return c.connector_scheduler._groups


def finish(c: KVGuardConnector, req: Any) -> None:
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    assert c.request_finished(req, []) == (False, None)


def test_children_allocated_steps_apart_each_carry_the_whole_group(
    connector: KVGuardConnector,
) -> None:
    c = connector
    children = [request(f"{i}_cmpl-a", "prefill-a") for i in range(4)]
    for child in children:
        c.on_new_request(child)  # vLLM adds every child before its next step
    allocate(c, children[0], 1, 2)
    first = step(c)
    for i, child in enumerate(children[1:], start=1):
        allocate(c, child, 2 * i + 1, 2 * i + 2)
    rest = step(c)
    got = [(m.request_id, m.block_ids, m.source, m.group) for m in first.loads]
    assert got == [("0_cmpl-a", [1, 2], Source(ENDPOINT, "prefill-a", 1), 4)]
    assert [(load.request_id, load.group) for load in rest.loads] == [
        ("1_cmpl-a", 4),
        ("2_cmpl-a", 4),
        ("3_cmpl-a", 4),
    ]
    for child in children:
        finish(c, child)
    assert groups(c) == {}, "finished groups must not stay behind"


def test_a_later_request_for_the_same_prefill_request_is_a_group_of_its_own(
    connector: KVGuardConnector,
) -> None:
    """A repeated submission after the first finished: the prefill answers it
    (``unknown_request``: its hold ended), never the first load's Result."""
    c = connector
    one, two = request("cmpl-b1", "prefill-b"), request("cmpl-b2", "prefill-b")
    c.on_new_request(one)
    allocate(c, one, 7)
    assert [load.group for load in step(c).loads] == [1]
    finish(c, one)
    c.on_new_request(two)
    allocate(c, two, 8)
    assert [(load.request_id, load.group) for load in step(c).loads] == [("cmpl-b2", 1)]
    finish(c, two)
    assert groups(c) == {}


def test_a_child_aborted_before_any_push_shrinks_the_group_it_never_joins(
    connector: KVGuardConnector,
) -> None:
    c = connector
    kept, dropped = request("0_cmpl-c", "prefill-c"), request("1_cmpl-c", "prefill-c")
    c.on_new_request(kept)
    c.on_new_request(dropped)
    dropped.status = RequestStatus.FINISHED_ABORTED
    assert c.request_finished(dropped, []) == (False, None)
    allocate(c, kept, 3)
    meta = step(c)
    # Nothing was pushed yet: the prefill need not hear of it, the push says 1.
    assert meta.forgets == []
    assert [(load.request_id, load.group) for load in meta.loads] == [("0_cmpl-c", 1)]
    finish(c, kept)
    assert groups(c) == {}


def test_a_child_aborted_after_a_sibling_pushed_is_forgotten_at_the_prefill(
    connector: KVGuardConnector,
) -> None:
    """The sibling's push said 2: the prefill counts the forget against it
    (sent after the push on the same link), so its hold ends with the push."""
    c = connector
    pushed, dropped = request("0_cmpl-d", "prefill-d"), request("1_cmpl-d", "prefill-d")
    c.on_new_request(pushed)
    c.on_new_request(dropped)
    allocate(c, pushed, 4)
    first = step(c)
    assert [(load.request_id, load.group) for load in first.loads] == [("0_cmpl-d", 2)]
    assert first.forgets == []
    dropped.status = RequestStatus.FINISHED_ABORTED
    assert c.request_finished(dropped, []) == (False, None)
    assert step(c).forgets == [ForgetMeta(Source(ENDPOINT, "prefill-d", 1), 2)]
    finish(c, pushed)
    assert groups(c) == {}


def test_a_lone_request_aborted_before_allocation_is_forgotten_at_once(
    connector: KVGuardConnector,
) -> None:
    c = connector
    alone = request("cmpl-e", "prefill-e")
    c.on_new_request(alone)
    alone.status = RequestStatus.FINISHED_ABORTED
    assert c.request_finished(alone, []) == (False, None)
    meta = step(c)
    assert (meta.forgets, meta.loads) == ([ForgetMeta(Source(ENDPOINT, "prefill-e", 1), 1)], [])
    assert groups(c) == {}


def test_a_declared_group_counts_children_not_yet_arrived(connector: KVGuardConnector) -> None:
    """The server run (n = 2 via the proxy) that failed before: child 0
    pushed alone said 1, the prefill ended its hold with that load, and
    child 1, added a step later, got ``unknown_request``."""
    c = connector
    first, second = request("0_cmpl-f", "prefill-f", 2), request("1_cmpl-f", "prefill-f", 2)
    c.on_new_request(first)
    allocate(c, first, 1)
    assert [(load.request_id, load.group) for load in step(c).loads] == [("0_cmpl-f", 2)]
    finish(c, first)  # even its group ended before the sibling arrived
    assert groups(c) == {}
    c.on_new_request(second)
    allocate(c, second, 2)
    assert [(load.request_id, load.group) for load in step(c).loads] == [("1_cmpl-f", 2)]
    finish(c, second)
    assert groups(c) == {}


def test_a_declared_childs_forget_before_any_sibling_arrived_names_the_group(
    connector: KVGuardConnector,
) -> None:
    """Found by the hand-off simulation: the first child of a declared n = 2
    leaves before its sibling arrived. Its forget must say 2, or the
    prefill (having heard no push) ends its hold on it, and the sibling's
    push gets ``unknown_request``."""
    c = connector
    first, second = request("0_cmpl-k", "prefill-k", 2), request("1_cmpl-k", "prefill-k", 2)
    c.on_new_request(first)
    first.status = RequestStatus.FINISHED_ABORTED
    assert c.request_finished(first, []) == (False, None)
    assert step(c).forgets == [ForgetMeta(Source(ENDPOINT, "prefill-k", 1), 2)]
    c.on_new_request(second)
    allocate(c, second, 2)
    assert [(load.request_id, load.group) for load in step(c).loads] == [("1_cmpl-k", 2)]
    finish(c, second)
    assert groups(c) == {}


def test_a_declared_child_that_leaves_before_any_push_shrinks_the_group(
    connector: KVGuardConnector,
) -> None:
    c = connector
    kids = [request(f"{i}_cmpl-g", "prefill-g", 3) for i in range(3)]
    c.on_new_request(kids[0])
    c.on_new_request(kids[1])
    kids[0].status = RequestStatus.FINISHED_ABORTED
    assert c.request_finished(kids[0], []) == (False, None)
    c.on_new_request(kids[2])  # arrives after: the declared 3 less the one gone
    allocate(c, kids[1], 5)
    meta = step(c)
    assert meta.forgets == []
    assert [(load.request_id, load.group) for load in meta.loads] == [("1_cmpl-g", 2)]
    allocate(c, kids[2], 6)
    assert [(load.request_id, load.group) for load in step(c).loads] == [("2_cmpl-g", 2)]
    for kid in kids[1:]:
        finish(c, kid)
    assert groups(c) == {}


@pytest.mark.usefixtures("all_levels")
@pytest.mark.parametrize("loads", [0, -1, 1025, 2.0, "2", True, None])
def test_a_bad_declared_size_is_ignored_by_name_and_the_load_goes_on(
    connector: KVGuardConnector, loads: object
) -> None:
    c = connector
    req = request("cmpl-h", "prefill-h")
    req.kv_transfer_params["kvguard_loads"] = loads
    with capture_logs() as logs:
        c.on_new_request(req)
        allocate(c, req, 9)
    assert [(load.request_id, load.group) for load in step(c).loads] == [("cmpl-h", 1)]
    finish(c, req)
    assert groups(c) == {}
    assert logs == [
        {
            "event": "kv_loads_ignored",
            "key": "kvguard_loads",
            "value": repr(loads),
            "want": "int in [1, 1024]",
            "log_level": "warning",
        }
    ]


def test_a_queued_request_renews_its_hold_at_once_then_every_third_of_it(
    connector: KVGuardConnector, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The path to the decode (proxy, API servers) used part of the
    prefill's hold: a request not allocated in its first step renews it
    then, and every third of it (10 s of 30) after, until its blocks are
    allocated. One allocated in its first step never renews."""
    from kvguard.vllm import scheduler_side

    now = [1000.0]
    monkeypatch.setattr(scheduler_side, "time", SimpleNamespace(monotonic=lambda: now[0]))
    c = connector
    fast, slow = request("cmpl-r1", "prefill-r1"), request("cmpl-r2", "prefill-r2")
    c.on_new_request(fast)
    c.on_new_request(slow)
    allocate(c, fast, 9)
    src = Source(ENDPOINT, "prefill-r2", 1)
    first = step(c)
    assert ([m.request_id for m in first.loads], first.renews) == (["cmpl-r1"], [src])
    now[0] += 9.99
    assert step(c).renews == []
    now[0] += 0.01
    assert step(c).renews == [src]
    now[0] += 5
    allocate(c, slow, 10)
    assert [m.request_id for m in step(c).loads] == ["cmpl-r2"]
    now[0] += 30
    assert step(c).renews == []
    finish(c, fast)
    finish(c, slow)
    assert groups(c) == {}


@pytest.mark.usefixtures("all_levels")
def test_kv_of_another_prompt_is_never_asked_for_and_the_prefill_lets_go_at_once(
    connector: KVGuardConnector,
) -> None:
    """Checked as the request arrives: nothing renews the hold while it
    queues, no load is pushed, the prefill is told to let go in the next step."""
    c = connector
    other = request("cmpl-x", "prefill-x")
    other.kv_transfer_params |= {PROMPT_DIGEST: prompt_digest(range(1, 41)), TOKENS: 40}
    with capture_logs() as logs:
        c.on_new_request(other)
    assert [e["event"] for e in logs] == ["kv_prompt_mismatch"]
    assert step(c).forgets == [ForgetMeta(Source(ENDPOINT, "prefill-x", 1), 1)]
    assert c.get_num_new_matched_tokens(other, 0) == (0, False)
    c.update_state_after_alloc(other, blocks(), 0)
    meta = step(c)
    assert (meta.loads, meta.forgets) == ([], [])
    finish(c, other)
    assert groups(c) == {}


def test_a_prompt_one_token_longer_than_the_prefills_loads_the_prefills_tokens(
    connector: KVGuardConnector,
) -> None:
    """The proxy's early first token: the decode's prompt is the prefill's
    and the token the prefill sampled; it loads the prefill's 39 tokens."""
    c = connector
    longer = request("cmpl-y", "prefill-y")
    longer.kv_transfer_params |= {PROMPT_DIGEST: prompt_digest(range(39)), TOKENS: 39}
    c.on_new_request(longer)
    assert c.get_num_new_matched_tokens(longer, 0) == (39, True)
    assert c.get_num_new_matched_tokens(longer, 32) == (7, True)  # a local prefix hit
    allocate(c, longer, 4, 5)
    assert [(m.request_id, m.block_ids) for m in step(c).loads] == [("cmpl-y", [4, 5])]
    finish(c, longer)
    assert step(c).cancels == ["cmpl-y"]  # vLLM waits for the worker's word
