"""What the docs promise on each fault, checked in the deployment users run.

The session's cluster (tests/vllm/cluster.py: OpenAI servers, vLLM's
multiprocessing, a real HTTP client) meets the faults of docs/vllm.md's
"What a user sees on each failure", each against its promised bound and
reason, never a deadline that would pass a regression:

* prefill SIGKILL: every decode load waiting on it ends ``peer_lost``
  within ``KILL_S`` (1 s) of the kill, the connection's drop, not a timer;
* prefill SIGSTOP: every load ends ``peer_lost`` once the heartbeat timeout
  passes (3 s; ZeroMQ pings every 0.5 s, so between 3 and 3.5 s after the
  freeze): on kvguard's record, within the timeout plus 1 s of its ask on
  average and the next histogram bucket (5 s) each; the client's replies
  not before the timeout, within 3.5 s plus the kill's 1 s reaction; a
  recompute decode keeps the blocks fenced until the thaw, then recomputes;
* a client that leaves mid-load: its request ends at once, its blocks stay
  fenced while the frozen prefill may write them;
* decode SIGKILL: the prefill's held blocks come back within its hold.

Each scenario's detection times (min/median/max from the fault to each
request's HTTP reply) go into the table (``-s``; ``.venv-vllm/vllm-server-table.md``).
"""

from __future__ import annotations

import asyncio
import signal
import time

import pytest

from scheduler.metrics import LATENCY_BUCKETS
from tests.vllm.client import Outcome, complete, http_session, prefill_step, prompts_of, run
from tests.vllm.cluster import (
    DEADLINE_S,
    FAILED,
    FREEZE_S,
    HEARTBEAT_S,
    HEARTBEAT_TIMEOUT_S,
    KILL_S,
    MAX_TOKENS,
    SETTLE_S,
    Cluster,
    assert_outcomes,
    decode_step,
    ended_as,
    fresh,
    idle_after,
    in_flight,
    load_seconds,
    references,
    settle,
    spread,
    spread_tokens,
    timed,
    transfers,
    wait_loading,
)
from tests.vllm.report import Row
from tests.vllm.sessions import PortClosed

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]

WAVE = 8  # loads per decode that meet the fault
# The latency histogram's first bound at or past FREEZE_S: each frozen load within it.
FREEZE_BUCKET_S = min(b for b in LATENCY_BUCKETS if b >= FREEZE_S)


def _prefill_fault(c: Cluster, sig: signal.Signals) -> None:
    """4 PD requests per decode load cleanly (links up), then the prefill
    freezes and 8 more per decode are asked; with ``SIGKILL`` the frozen
    prefill is killed once they all wait on it, before any heartbeat could
    drop the link. Every one of the 16 loads must end ``peer_lost``: the
    "fail" decode's requests with HTTP 500 within the bound from the fault,
    the "recompute" decode's recomputed and equal to their references."""
    name = {signal.SIGKILL: "prefill SIGKILL", signal.SIGSTOP: "prefill SIGSTOP"}[sig]
    decodes = [c.fail] * (4 + WAVE) + [c.recompute] * (4 + WAVE)
    prompts = prompts_of(len(decodes), seed=30 + sig)
    half = len(decodes) // 2
    want = references(c, c.fail, prompts[:half], [MAX_TOKENS] * half)
    want += references(c, c.recompute, prompts[half:], [MAX_TOKENS] * half)
    fresh(c.prefill, c.fail, c.recompute)
    first = [i for i in range(len(decodes)) if i % half < 4]
    second = [i for i in range(len(decodes)) if i % half >= 4]
    before = {d.name: transfers(d) for d in (c.fail, c.recompute)}
    failed_before = load_seconds(c.fail, "failed")
    within_before = load_seconds(c.fail, "failed", FREEZE_BUCKET_S)[0]
    r_before = c.recompute.tokens_by_source()

    control = int(c.prefill.kv["kv_connector_extra_config"]["kvguard_control_port"])  # type: ignore[index]
    closed = PortClosed(control)

    async def go() -> tuple[dict[int, tuple[Outcome, float]], float, float]:
        async with http_session() as http:
            steps = await asyncio.gather(*(prefill_step(http, c.prefill, p) for p in prompts))
            assert all(o.kind == "ok" and kv for o, kv in steps), steps

            def ask(i: int) -> asyncio.Task[tuple[Outcome, float]]:
                step = decode_step(http, decodes[i], prompts[i], MAX_TOKENS, steps[i][1])
                return asyncio.create_task(timed(step))

            outs = dict(zip(first, await asyncio.gather(*map(ask, first)), strict=True))
            c.prefill.signal(signal.SIGSTOP)
            t_stop = time.monotonic()
            later = {i: ask(i) for i in second}
            t_fault = t_stop
            if sig == signal.SIGKILL:
                for d in (c.fail, c.recompute):
                    await asyncio.to_thread(wait_loading, d, WAVE, HEARTBEAT_TIMEOUT_S)
                closed.start()
                c.prefill.signal(signal.SIGKILL)
                t_fault = time.monotonic()
                # Killed before a heartbeat could have dropped the link: the
                # earliest a ping goes unanswered for the timeout.
                assert t_fault - t_stop < HEARTBEAT_TIMEOUT_S - HEARTBEAT_S, (
                    f"the kill came {t_fault - t_stop:.2f}s after the freeze: a heartbeat "
                    "may have dropped the link first, so the kill would prove nothing"
                )
                assert not any(t.done() for t in later.values()), "a load ended before the kill"
            for i in second:
                if decodes[i] is c.fail:
                    outs[i] = await later[i]
            if sig == signal.SIGSTOP:
                # The recompute decode's loads failed too (fenced): thaw, so
                # the prefill answers and vLLM gets their blocks back.
                await asyncio.to_thread(
                    ended_as,
                    c.recompute,
                    before[c.recompute.name],
                    {("loaded", ""): 4, ("failed", "peer_lost"): WAVE},
                )
                c.prefill.signal(signal.SIGCONT)
            for i in second:
                outs[i] = await later[i]
            return outs, t_stop, t_fault

    try:
        outs, t_stop, t_fault = run(go())
    finally:
        if sig == signal.SIGSTOP:
            c.prefill.signal(signal.SIGCONT)  # again, should the run have failed early
        else:
            c.prefill.restart()  # this test's own fault, undone for the next
    fail_side = [i for i in second if decodes[i] is c.fail]
    took = [outs[i][1] - t_fault for i in fail_side]
    rows = [Row(f"{name}, policy fail"), Row(f"{name}, policy recompute")]
    rows[0].add([outs[i][0] for i in range(half)], want[:half])
    rows[1].add([outs[i][0] for i in range(half, 2 * half)], want[half:])
    recomputed = (c.recompute.tokens_by_source() - r_before)["local_compute"]
    rows[0].note = f"{len(took)} loads ended {spread(took)} after the {name.split()[1]}"
    if sig == signal.SIGKILL:
        dead_s = closed.at() - t_fault
        rows[0].note += f"; its control port closed {dead_s:.2f}s after it"
    rows[1].note = f"{recomputed} prompt tokens recomputed"
    c.rows.extend(rows)
    idle_after(c, rows[0])
    assert_outcomes(c, [outs[i][0] for i in first], [want[i] for i in first], set())
    assert [outs[i][0].kind for i in fail_side] == [FAILED] * WAVE, c.logs()
    assert_outcomes(c, [outs[i][0] for i in second if i >= half], want[half + 4 :], set())
    assert recomputed > 0, f"the {name} made the recompute decode recompute nothing"
    for d in (c.fail, c.recompute):
        ended_as(d, before[d.name], {("loaded", ""): 4, ("failed", "peer_lost"): WAVE})
    if sig == signal.SIGKILL:
        # Within 1 s of the prefill's exit (its connections drop then), and,
        # where the kernel closed them before a heartbeat could have dropped
        # the links, before that too: the close ended them, not the heartbeat.
        # (Reclaiming a killed server's memory took the kernel up to 6 s on
        # this host, past the heartbeat timeout: the heartbeat then rightly
        # comes first, and the first bound still holds.)
        assert min(took) >= 0 and max(took) <= dead_s + KILL_S, rows[0].note
        if dead_s + t_fault - t_stop < HEARTBEAT_TIMEOUT_S - HEARTBEAT_S:
            assert max(took) + t_fault - t_stop < HEARTBEAT_TIMEOUT_S - HEARTBEAT_S, rows[0].note
    else:
        # The promise is kvguard's detection, on kvguard's own record of each
        # load (asked after the freeze, so from its ask is no later than from
        # the freeze): within the timeout plus one interval, and the decode's
        # reaction (FREEZE_S) on average, each within the next bucket (5 s).
        # The client's replies add vLLM's step and the API server: a CI run
        # saw them 4.04-4.08 s after the freeze while kvguard failed the loads
        # 3.04 s after their ask (ZeroMQ drops a frozen peer 3.0-3.5 s after
        # the freeze, whenever the loads were sent: measured with these
        # heartbeats and a send 0, 1.5 or 2.5 s after it).
        count, total = load_seconds(c.fail, "failed")
        count -= failed_before[0]
        mean = (total - failed_before[1]) / max(count, 1)
        within = load_seconds(c.fail, "failed", FREEZE_BUCKET_S)[0] - within_before
        rows[0].note += (
            f"; kvguard's loads failed {mean:.2f}s after they were asked (mean of {count}, "
            f"{within} within {FREEZE_BUCKET_S:g}s)"
        )
        assert count == WAVE and within == WAVE and mean <= FREEZE_S, rows[0].note
        # The replies: not before the timeout (the prefill is only silent);
        # within the detection's promise plus the reaction the kill is given,
        # so a failure kvguard reports to vLLM late still fails this test.
        assert min(took) >= HEARTBEAT_TIMEOUT_S - HEARTBEAT_S, rows[0].note
        assert max(took) <= HEARTBEAT_TIMEOUT_S + HEARTBEAT_S + KILL_S, rows[0].note
    settle(c, rows[0])


def test_prefill_sigkill_fails_waiting_loads_peer_lost_within_1s(cluster: Cluster) -> None:
    _prefill_fault(cluster, signal.SIGKILL)


def test_prefill_sigstop_fails_loads_peer_lost_at_the_heartbeat_timeout(cluster: Cluster) -> None:
    _prefill_fault(cluster, signal.SIGSTOP)


def test_client_disconnect_mid_load_leaves_decode_idle(cluster: Cluster) -> None:
    """The prefill is frozen after its step, so the decode's load waits; the client leaves.

    The request ends at once, but its blocks stay out of use while the frozen
    prefill may still write them (it has the push, unread): they come back
    once the thawed prefill answers the abort.
    """
    c = cluster
    (prompt,) = prompts_of(1, seed=6)
    references(c, c.fail, [prompt], [MAX_TOKENS])
    fresh(c.prefill, c.fail)
    row = Row("client disconnects mid-load (prefill frozen meanwhile)")

    async def go() -> tuple[float, float]:
        async with http_session() as http:
            first, params = await prefill_step(http, c.prefill, prompt)
            assert first.kind == "ok" and params is not None, first
            c.prefill.signal(signal.SIGSTOP)
            task = asyncio.create_task(complete(http, c.fail, prompt, MAX_TOKENS, params))
            end = time.monotonic() + HEARTBEAT_TIMEOUT_S
            while True:  # loading: its blocks are allocated while it waits
                load = await asyncio.to_thread(c.fail.load)
                if load.waiting == 1 and load.kv_usage > 0:
                    break
                assert time.monotonic() < end, f"the decode never started loading: {load}"
                await asyncio.sleep(0.05)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            t0 = time.monotonic()
            while True:  # vLLM ends the request; the fence keeps its blocks
                load = await asyncio.to_thread(c.fail.load)
                if load.running == 0 and load.waiting == 0:
                    break
                assert time.monotonic() - t0 < HEARTBEAT_TIMEOUT_S, f"request not ended: {load}"
                await asyncio.sleep(0.05)
            ended_s = time.monotonic() - t0
            await asyncio.sleep(HEARTBEAT_TIMEOUT_S + 1)  # past heartbeat loss: still fenced
            fenced = await asyncio.to_thread(c.fail.load)
            return ended_s, fenced.kv_usage

    try:
        ended_s, fenced_usage = run(go())
    finally:
        c.prefill.signal(signal.SIGCONT)
    t_thaw = time.monotonic()
    c.fail.wait_idle(SETTLE_S)
    idle_s = time.monotonic() - t_thaw
    row.requests, row.errors["client cancelled"] = 1, 1
    row.max_s = ended_s
    row.note = (
        f"request ended {ended_s:.1f}s after the disconnect; blocks fenced while the prefill "
        f"was frozen, back {idle_s:.1f}s after its thaw"
    )
    c.rows.append(row)
    idle_after(c, row)
    assert fenced_usage > 0, "blocks the frozen prefill may write went back to vLLM"
    assert idle_s <= DEADLINE_S + 2, row.note
    settle(c, row)


def test_decode_sigkill_mid_run_returns_prefill_blocks(cluster: Cluster) -> None:
    """32 prompts prefilled; 2 asked of the decode and ended, 14 more asked
    and SIGKILL once the decode has one (loading or generating), then 16
    more asked."""
    c = cluster
    prompts = prompts_of(32, seed=2)
    tokens = spread_tokens(32)
    # The 14 asked with the kill run as long as --max-model-len allows, so
    # the kill, once the decode has one, finds them in flight. (Killed after
    # two one-token requests ended, as before, it found none in one run: a
    # slow load can end a one-token request after the long ones.)
    tokens[:16] = [1, 1] + [128 - len(p) for p in prompts[2:16]]
    want = references(c, c.fail, prompts, tokens)
    fresh(c.prefill, c.fail)
    row = Row("decode SIGKILL mid-run (16 asked, 16 held, not asked)")

    async def go() -> tuple[list[Outcome], float, float]:
        async with http_session() as http:
            steps = await asyncio.gather(*(prefill_step(http, c.prefill, p) for p in prompts))
            assert all(o.kind == "ok" and kv for o, kv in steps), steps
            # The hold the prefill applied, as it tells the decode.
            hold = max(float(kv["kvguard_hold_s"]) for _, kv in steps if kv)
            asked = list(zip(prompts[:16], tokens[:16], steps[:16], strict=True))
            first = (decode_step(http, c.fail, p, m, kv) for p, m, (_, kv) in asked[:2])
            outs = list(await asyncio.gather(*first))
            tasks = [
                asyncio.create_task(decode_step(http, c.fail, p, m, kv))
                for p, m, (_, kv) in asked[2:]
            ]
            await in_flight(c.fail, tasks)
            c.fail.signal(signal.SIGKILL)
            t_kill = time.monotonic()
            outs += await asyncio.gather(*tasks)
            await asyncio.to_thread(c.fail.wait_gone, SETTLE_S)
            # New connections: a pooled one to the dead server resets on
            # write, which says nothing about a server that is gone.
            async with http_session() as later:
                outs += await asyncio.gather(
                    *(
                        decode_step(later, c.fail, p, m, kv)
                        for p, m, (_, kv) in zip(prompts[16:], tokens[16:], steps[16:], strict=True)
                    )
                )
            return outs, t_kill, hold

    try:
        outs, t_kill, hold_s = run(go())
        c.prefill.wait_idle(SETTLE_S)
        back_s = time.monotonic() - t_kill
    finally:
        c.fail.restart()
    row.add(outs, want)
    row.note = f"prefill KV usage 0 within {back_s:.1f}s of the kill"
    c.rows.append(row)
    idle_after(c, row)
    assert_outcomes(c, outs[:2], want[:2], set())
    assert_outcomes(c, outs[2:16], want[2:16], {"disconnected"})
    assert_outcomes(c, outs[16:], want[16:], {"refused"})
    assert row.errors["disconnected"] > 0, "the kill ended no request in flight"
    assert row.errors["refused"] == 16, row
    # The 16 never asked are held at most the prefill's hold, from the end of their prefill.
    assert back_s <= hold_s + 2, row.note
    settle(c, row)
