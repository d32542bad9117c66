"""I6 across engines, in the deployment users run: no decode block is written by a
prefill after vLLM may reuse it.

Two vLLM OpenAI servers (``tests/vllm/servers.py``), both with the canary
connector (``tests/vllm/canary_connector.py``). The prefill's next transfer is
armed to reach the real Mooncake engine only ``DELAY_S`` seconds after kvguard
submitted it, well past the decode's ``DEADLINE_S``; in one scenario the
prefill's whole process group is also frozen (SIGSTOP) while that write is
pending and thawed (SIGCONT) after the decode gave up. The decode (a KV cache
of 16 blocks, no prefix caching, so freed blocks come back into use at once)
serves other, non-PD requests all the while and logs every block allocation,
every fenced load and every lifted fence; the prefill logs when its late write
was issued and when it landed.

Each scenario checks: the PD request ends with policy ``fail``'s HTTP error
within its deadline and a small slack; the write was issued after the decode
gave up and landed before the fence was lifted (the fenced blocks' bytes
changed to exactly the prefill's during the fence); no allocation made while
the fence was up holds a fenced block; every other request's tokens equal its
non-PD reference; then the decode is idle and serves one more PD request
equal to its reference. The negative control bypasses the fence (the failed
load's blocks go back to vLLM at once, as before the fence) and the same
canary must find a fenced block handed to another request before the late
write landed in it.

The result table is printed at the end (``-s``) and written to
``.venv-vllm/vllm-canary-table.md``.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.vllm import servers as harness
from tests.vllm.client import Outcome, complete, http_session, pd, prefill_step, run
from tests.vllm.ports import free_port
from tests.vllm.servers import LOGS, SERVES_KV, Server, kv_config, start_all

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]

DEADLINE_S = 5.0  # kvguard_deadline_s on both servers (a loaded machine needs the room)
DELAY_S = 9.0  # the armed write reaches the engine this long after its submit
SLACK_S = 3.0  # the PD request's error may come this long after its deadline
FREEZE_AT_S = 0.3  # the frozen scenario stops the prefill this long after the submit
THAW_AFTER_S = 1.0  # ... and resumes it this long after the decode gave up
NUM_BLOCKS = 16  # the decode's KV cache, in blocks of 32 tokens
FAIL_KIND = "http 500 InternalServerError"  # kv_load_failure_policy "fail", as the client sees it
# Other requests on the decode during a scenario: more than its blocks hold,
# so some always wait for blocks and take any block vLLM frees at once.
BG_WORKERS = 6
BG_TOKENS = 16
PD_TOKENS = 8
CANARY = "canary"
CONNECTOR = "tests.vllm.canary_connector"

_rng = random.Random(6)
BG_PROMPTS = [[_rng.randrange(1, 256) for _ in range(_rng.randrange(50, 90))] for _ in range(12)]


def fresh_prompt(seed: int) -> list[int]:
    """A prompt of 65-96 tokens (three decode blocks) no other request uses."""
    rng = random.Random(1000 + seed)
    return [rng.randrange(1, 256) for _ in range(rng.randrange(65, 97))]


def canary_config(role: str) -> dict[str, Any]:
    extra: dict[str, Any] = {"kvguard_deadline_s": DEADLINE_S}
    if role == "kv_producer":
        extra["kvguard_control_port"] = free_port()
    cfg = kv_config(role, "fail", **extra)
    cfg["kv_connector"] = "CanaryKVGuardConnector"
    cfg["kv_connector_module_path"] = CONNECTOR
    return cfg


# ==== the servers ==============================================================


@dataclass
class Canary:
    prefill: Server
    decode: Server
    dir: Path
    refs: dict[tuple[int, ...], tuple[int, ...]] = field(default_factory=dict)

    @property
    def events(self) -> Path:
        return self.dir / "events.jsonl"

    def logs(self) -> str:
        return "\n".join(f"--- {s.name} log\n{s.log_tail(30)}" for s in (self.prefill, self.decode))

    def read(self) -> list[dict[str, Any]]:
        try:
            text = self.events.read_text()
        except FileNotFoundError:
            return []
        return [json.loads(line) for line in text.splitlines() if line]


@pytest.fixture(scope="module")
def canary() -> Iterator[Canary]:
    path = LOGS / "vllm-canary"
    path.mkdir(parents=True, exist_ok=True)
    for stale in path.iterdir():
        stale.unlink()
    prefill = Server("canary-prefill", canary_config("kv_producer"))
    decode = Server(
        "canary-decode",
        canary_config("kv_consumer"),
        ["--num-gpu-blocks-override", str(NUM_BLOCKS), "--no-enable-prefix-caching"],
    )
    old = os.environ.get("KVGUARD_CANARY_DIR")
    os.environ["KVGUARD_CANARY_DIR"] = str(path)  # Server.start passes os.environ on
    c = Canary(prefill, decode, path)
    start_s = harness.START_S
    # Other helpers' servers share the 2 cores: a start may take longer than usual.
    harness.START_S = max(start_s, 600.0)
    try:
        start_all([prefill, decode])
        yield c
    finally:
        harness.START_S = start_s
        if old is None:
            os.environ.pop("KVGUARD_CANARY_DIR", None)
        else:
            os.environ["KVGUARD_CANARY_DIR"] = old
        for s in (prefill, decode):
            s.stop()


ROWS: list[str] = []
TABLE_HEADER = (
    "| scenario | PD outcome (s) | fence window (s) | write issued / landed (s) "
    "| allocations during fence | fenced blocks reused before the write landed "
    "| other requests ok and equal |\n|---|---|---|---|---|---|---|"
)


@pytest.fixture(scope="module", autouse=True)
def table() -> Iterator[None]:
    yield
    text = "\n".join([TABLE_HEADER, *ROWS])
    (LOGS / "vllm-canary-table.md").write_text(text + "\n")
    print("\n" + text)


async def references(c: Canary, http: aiohttp.ClientSession, prompts: Sequence[list[int]]) -> None:
    """Each prompt's non-PD greedy tokens on the decode."""
    missing = [p for p in prompts if tuple(p) not in c.refs]
    outs = await asyncio.gather(*(complete(http, c.decode, p, BG_TOKENS) for p in missing))
    for p, (out, _) in zip(missing, outs, strict=True):
        assert out.kind == "ok", out
        c.refs[tuple(p)] = out.choices[0]


async def wait_event(
    c: Canary, kind: str, within_s: float, pd_load: bool = False
) -> dict[str, Any]:
    """The first ``kind`` event (``pd_load``: an allocation for a PD load)."""
    end = time.monotonic() + within_s
    while True:
        for e in c.read():
            if e["event"] == kind and (not pd_load or e.get("external", 0) > 0):
                return e
        if time.monotonic() > end:
            raise AssertionError(f"no {kind!r} event within {within_s}s\n{c.logs()}")
        await asyncio.sleep(0.05)


# ==== one scenario =============================================================


@dataclass
class Found:
    """What the event log says about one scenario."""

    pd: Outcome
    others: list[tuple[tuple[int, ...], Outcome]]  # (non-PD reference, outcome)
    fenced: dict[str, Any]
    released: dict[str, Any]
    submitted: dict[str, Any]
    issued: dict[str, Any]
    landed: dict[str, Any]
    during_fence: list[dict[str, Any]]  # allocations between the fence and its lifting
    reused: list[dict[str, Any]]  # of those, the ones holding a fenced block
    overlaps: list[dict[str, Any]]  # allocations of a fenced block before the write landed

    @property
    def others_equal(self) -> int:
        return sum(o.kind == "ok" and o.choices[0] == want for want, o in self.others)

    def row(self, name: str) -> str:
        t0 = self.fenced["t"]
        return (
            f"| {name} | {self.pd.kind} ({self.pd.seconds:.2f}) "
            f"| {self.released['t'] - t0:.2f} "
            f"| +{self.issued['t'] - t0:.2f} / +{self.landed['t'] - t0:.2f} "
            f"| {len(self.during_fence)} | {len(self.overlaps)} "
            f"| {self.others_equal}/{len(self.others)} |"
        )


def scenario(c: Canary, seed: int, *, freeze: bool = False, bypass: bool = False) -> Found:
    """One PD request whose write lands late, with other requests on the decode meanwhile."""
    c.events.unlink(missing_ok=True)
    (c.dir / "bypass").unlink(missing_ok=True)
    if bypass:
        (c.dir / "bypass").write_text("1")
    prompt = fresh_prompt(seed)

    async def go() -> tuple[Outcome, list[tuple[list[int], Outcome]]]:
        async with http_session() as http:
            await references(c, http, BG_PROMPTS)
            first, params = await prefill_step(http, c.prefill, prompt)
            assert first.kind == "ok" and params is not None, f"{first}\n{c.logs()}"
            (c.dir / "arm").write_text(str(DELAY_S))
            stop = asyncio.Event()
            others: list[tuple[list[int], Outcome]] = []

            async def background(k: int) -> None:
                mine = BG_PROMPTS[k::BG_WORKERS]
                i = 0
                while not stop.is_set():
                    p = mine[i % len(mine)]
                    out, _ = await complete(http, c.decode, p, BG_TOKENS)
                    others.append((p, out))
                    i += 1

            leg = asyncio.create_task(
                complete(http, c.decode, prompt, PD_TOKENS, params, timeout_s=60)
            )
            # After the PD request has its blocks: it must not queue behind them.
            await wait_event(c, "alloc", DEADLINE_S, pd_load=True)
            workers = [asyncio.create_task(background(k)) for k in range(BG_WORKERS)]
            try:
                if freeze:
                    await wait_event(c, "write_submitted", DEADLINE_S)
                    await asyncio.sleep(FREEZE_AT_S)
                    c.prefill.signal(signal.SIGSTOP)
                    try:
                        await wait_event(c, "fenced", DEADLINE_S + SLACK_S)
                        await asyncio.sleep(THAW_AFTER_S)
                    finally:
                        c.prefill.signal(signal.SIGCONT)
                out, _ = await leg
                await wait_event(c, "released", DELAY_S + 30)
                await asyncio.sleep(1.0)  # allocations after the fence lifted, too
            finally:
                stop.set()
                await asyncio.gather(*workers)
            return out, others

    try:
        out, others = run(go())
    finally:
        for flag in ("arm", "bypass"):
            (c.dir / flag).unlink(missing_ok=True)
    events = c.read()
    c.events.rename(c.dir / f"events-{seed}.jsonl")  # kept for inspection

    def one(kind: str) -> dict[str, Any]:
        found = [e for e in events if e["event"] == kind]
        assert len(found) == 1, f"{kind}: {found}\n{c.logs()}"
        return found[0]

    fenced, released = one("fenced"), one("released")
    assert fenced["rid"] == released["rid"], (fenced, released)
    blocks = set(fenced["blocks"])
    assert blocks, fenced
    landed = one("write_landed")
    allocs = [e for e in events if e["event"] == "alloc" and e["rid"] != fenced["rid"]]
    during = [e for e in allocs if fenced["t"] < e["t"] < released["t"]]
    return Found(
        pd=out,
        others=[(c.refs[tuple(p)], o) for p, o in others],
        fenced=fenced,
        released=released,
        submitted=one("write_submitted"),
        issued=one("write_issued"),
        landed=landed,
        during_fence=during,
        reused=[e for e in during if blocks & set(e["blocks"])],
        overlaps=[
            e for e in allocs if fenced["t"] < e["t"] < landed["t"] and blocks & set(e["blocks"])
        ],
    )


def assert_fence_held(c: Canary, f: Found) -> None:
    logs = c.logs()
    assert f.pd.kind == FAIL_KIND, f"{f.pd}\n{logs}"
    assert f.pd.seconds <= DEADLINE_S + SLACK_S, f"{f.pd}\n{logs}"
    assert f.fenced["bypass"] is False
    # The write really came late, through the real engine: issued after the
    # decode gave up, landed (no error) before the fence was lifted, and what
    # landed is the prefill's bytes, in exactly the fenced blocks.
    assert f.submitted["t"] < f.fenced["t"] < f.issued["t"], (f.submitted, f.fenced, f.issued)
    assert f.issued["t"] < f.landed["t"] < f.released["t"], (f.issued, f.landed, f.released)
    assert f.landed["error"] == "", f.landed
    assert f.fenced["digest"] != f.submitted["digest"], "the blocks held the KV before the write"
    assert f.released["digest"] == f.submitted["digest"], (
        f"the late write missed the blocks\n{logs}"
    )
    # vLLM kept allocating while the fence was up, never a fenced block.
    assert f.during_fence, "no allocation while the fence was up: nothing could reuse a block"
    assert f.reused == [], f"fenced blocks {f.fenced['blocks']} allocated: {f.reused}\n{logs}"
    assert f.overlaps == []
    bad = [(o, w) for w, o in f.others if not (o.kind == "ok" and o.choices[0] == w)]
    assert not bad and f.others, f"{len(bad)} of {len(f.others)} other requests: {bad[:3]}"


def assert_idle_and_serving(c: Canary, seed: int) -> None:
    c.decode.wait_idle(DEADLINE_S + 20)
    c.prefill.wait_idle(DEADLINE_S + 20)
    prompt = fresh_prompt(seed)

    async def go() -> tuple[Outcome, Outcome]:
        async with http_session() as http:
            ref, _ = await complete(http, c.decode, prompt, PD_TOKENS)
            return ref, await pd(http, c.prefill, c.decode, prompt, PD_TOKENS, kv=SERVES_KV)

    ref, got = run(go())
    assert ref.kind == "ok", ref
    assert got.kind == "ok" and got.tokens == ref.tokens, f"{got} != {ref}\n{c.logs()}"
    c.decode.wait_idle(DEADLINE_S + 20)


# ==== the scenarios ============================================================


def test_slow_prefill_write_lands_in_fenced_blocks_only(canary: Canary) -> None:
    f = scenario(canary, seed=1)
    ROWS.append(f.row("slow prefill (canary)"))
    assert_fence_held(canary, f)
    assert_idle_and_serving(canary, seed=101)


def test_prefill_frozen_mid_transfer_then_thawed(canary: Canary) -> None:
    f = scenario(canary, seed=2, freeze=True)
    ROWS.append(f.row("prefill SIGSTOP mid-transfer, SIGCONT after the deadline (canary)"))
    assert_fence_held(canary, f)
    assert_idle_and_serving(canary, seed=102)


def test_control_without_the_fence_is_caught(canary: Canary) -> None:
    """The same canary, the fence bypassed: it must see a fenced block reused while written."""
    f = scenario(canary, seed=3, bypass=True)
    ROWS.append(f.row("fence bypassed (negative control)"))
    assert f.fenced["bypass"] is True
    assert f.pd.kind == FAIL_KIND, f.pd
    assert f.fenced["t"] < f.issued["t"] < f.landed["t"]
    assert f.overlaps, (
        f"the control was not caught: no fenced block {f.fenced['blocks']} allocated "
        f"before the late write landed; allocations: {f.during_fence}"
    )
    assert_idle_and_serving(canary, seed=103)
