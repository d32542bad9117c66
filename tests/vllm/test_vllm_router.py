"""Two prefills and two decodes behind vLLM's own router (``vllm-router``, PD mode).

The module starts docs/vllm.md's "Behind vllm-router" block as it stands
(``tests/vllm/docs.py``): its ports replaced by free ones, each server its
own process group so one can be killed, and the decodes' connector swapped
for the canary's logging subclass (``tests/vllm/canary_connector.py``: the
same connector, plus a record of every block allocation and fence). The
router runs exactly the block's command.

Each scenario sends 64 completions through the router from an HTTP client,
0.05 s apart (most in flight at once), and compares every answer with a
non-PD request of the same prompt. Mid-run (after ``FAULT_AFTER`` answers)
one server is faulted; once the router's health check has marked it down,
16 more requests go; then the fault is undone (a frozen server thawed).

vllm-router 0.1.17's PD mode retries nothing (its ``--retry-*`` and
``--cb-*`` settings do not apply there: checked with backends answering 503
and with dead ones), so what it sends to a dead server before its health
check saw it fails with its own HTTP 500 naming that server. The tests
hold each scenario to exactly that:

* clean: 64/64 answered, equal; both decodes served, every prompt token of
  theirs came over the transfer;
* a prefill SIGKILLed: every load from it fails ``peer_lost`` and the
  decode computes the prompt itself (policy ``recompute``): answered, equal;
  the only failures are the router's for legs it sent to the dead prefill;
* a decode SIGKILLed: the only failures are the router's for requests it
  sent to the dead decode;
* a prefill frozen (SIGSTOP): its loads fail at the heartbeat timeout and
  are computed on the decode; its prefill legs wait for it (the router has
  no per-leg timeout), and once it is thawed are answered or reset (the
  router's error again);
* in each: the 16 requests after detection are answered, equal, and none
  went to the faulted server (the route the router wrote into each answer's
  id); the surviving servers are idle after; no block a fence held was
  allocated to another request while fenced (the canary's check).

The faulted server is restarted for the next scenario. The table of
outcomes is printed (``-s``) and written to ``.venv-vllm/vllm-router-table.md``.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.vllm import servers as harness
from tests.vllm.client import Outcome, ask, complete, http_session, prompts_of, run
from tests.vllm.cluster import first_done, spread
from tests.vllm.diagnosis import state_of
from tests.vllm.docs import checked_block, jobs_of, local
from tests.vllm.ports import free_port
from tests.vllm.servers import LOGS, Server, start_all

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(2400)]

MARK = "<!-- checked by tests/vllm/test_vllm_router.py -->"
EXAMPLE_PORTS = ("8100", "8101", "8200", "8201", "8000", "17600", "17610", "29000")
MODEL = ".venv-vllm/tiny-llama"  # the name the block's servers serve (its MODEL)
REQUESTS = 64
MAX_TOKENS = 8
# Requests arrive SPACING_S apart (all 64 within 3.2 s, most at once in
# flight); the fault comes after FAULT_AFTER answers, while some have their
# prefill leg, some their load and some their decode under way.
SPACING_S = 0.05
FAULT_AFTER = 16
AFTER_DETECTION = 16  # requests sent once the router's health check saw the fault
# The router's detection: a check each second, two failed in a row, each
# failing at its timeout (2 s) when the server is frozen; slack for a
# loaded host.
DETECT_S = 30.0
REQUEST_S = 300.0  # the client's own bound on one request: a hang guard
# A prefill holds the KV of a request whose decode died until its hold
# (kvguard_hold_s, 30 s by default) ends.
SETTLE_S = 30.0 + 20.0
CANARY = {
    '"kv_connector": "KVGuardConnector"': '"kv_connector": "CanaryKVGuardConnector"',
    '"kvguard.vllm.connector"': '"tests.vllm.canary_connector"',
}
START_S = 900.0  # five processes start side by side on two cores


@dataclass
class Deployment:
    prefills: list[Server]
    decodes: list[Server]
    router: Server
    metrics_port: int
    canaries: dict[str, Path]  # decode name -> its canary's folder
    refs: dict[tuple[int, ...], tuple[int, ...]] = field(default_factory=dict)
    rows: list[str] = field(default_factory=list)

    @property
    def servers(self) -> list[Server]:
        return [*self.prefills, *self.decodes]

    def router_counts(self, name: str) -> Counter[str]:
        """A counter of the router's /metrics by its ``worker`` label."""
        text = harness._get(f"http://127.0.0.1:{self.metrics_port}/metrics", 10).decode()
        out: Counter[str] = Counter()
        for line in text.splitlines():
            found = re.match(rf'{name}\{{worker="([^"]+)"[^}}]*\}} (\S+)$', line)
            if found:
                out[found.group(1)] += int(float(found.group(2)))
        return out

    def router_total(self, name: str) -> int:
        text = harness._get(f"http://127.0.0.1:{self.metrics_port}/metrics", 10).decode()
        return sum(
            int(float(line.rpartition(" ")[2]))
            for line in text.splitlines()
            if line.startswith((name + " ", name + "{"))
        )

    def logs(self) -> str:
        """Each server's log tail, then each live server's kvguard state."""
        tails = [f"--- {s.name}\n{s.log_tail(20)}" for s in [*self.servers, self.router]]
        live = [s for s in self.servers if s.proc is not None and s.proc.poll() is None]
        return "\n".join(tails + [state_of(s) for s in live])


@pytest.fixture(scope="module")
def deployment(monkeypatch_module: pytest.MonkeyPatch) -> Iterator[Deployment]:
    monkeypatch_module.setattr(harness, "START_S", START_S)
    ports = {p: free_port() for p in EXAMPLE_PORTS}
    jobs = jobs_of(local(checked_block(MARK), ports))
    assert f"MODEL={MODEL}\n" in jobs.preamble, jobs.preamble
    assert len(jobs.commands) == 5, jobs.commands
    roles = ["kv_producer", "kv_producer", "kv_consumer", "kv_consumer", "vllm-router"]
    for command, role in zip(jobs.commands, roles, strict=True):
        assert role in command, (role, command)
    canaries: dict[str, Path] = {}
    servers: list[Server] = []
    for i, port in enumerate(("8100", "8101", "8200", "8201")):
        script, env = jobs.script(i), {}
        name = f"router-{'prefill' if i < 2 else 'decode'}-{i % 2}"
        if i >= 2:
            for old, new in CANARY.items():
                assert old in script, (old, script)
                script = script.replace(old, new)
            folder = LOGS / f"{name}-canary"
            folder.mkdir(parents=True, exist_ok=True)
            for stale in folder.iterdir():
                stale.unlink()
            canaries[name], env = folder, {"KVGUARD_CANARY_DIR": str(folder)}
        servers.append(Server(name, port=ports[port], shell=script, env=env))
    router = Server("router", port=ports["8000"], shell=jobs.script(4))
    d = Deployment(servers[:2], servers[2:], router, ports["29000"], canaries)
    try:
        start_all(d.servers)
        router.start()
        yield d
    finally:
        for s in [router, *d.servers]:
            s.stop()
        text = "\n".join([TABLE_HEADER, *d.rows])
        (LOGS / "vllm-router-table.md").write_text(text + "\n")
        print("\n" + text)


@pytest.fixture(scope="module")
def monkeypatch_module() -> Iterator[pytest.MonkeyPatch]:
    with pytest.MonkeyPatch.context() as mp:
        yield mp


TABLE_HEADER = (
    "| scenario | requests | answered | equal | lost (the router's error) | router retries "
    "| max s | after detection: answered, legs to the faulted one |"
    "\n|---|---|---|---|---|---|---|---|"
)


def references(d: Deployment, prompts: list[list[int]]) -> list[tuple[int, ...]]:
    """Each prompt's non-PD greedy tokens on the first decode."""
    missing = [tuple(p) for p in prompts if tuple(p) not in d.refs]

    async def go() -> list[tuple[Outcome, Any]]:
        async with http_session() as http:
            return list(
                await asyncio.gather(
                    *(
                        complete(
                            http, d.decodes[0], list(p), MAX_TOKENS, timeout_s=300, model=MODEL
                        )
                        for p in missing
                    )
                )
            )

    for p, (out, _) in zip(missing, run(go()) if missing else [], strict=True):
        assert out.kind == "ok" and out.tokens, out
        d.refs[p] = tuple(out.tokens)
    return [d.refs[tuple(p)] for p in prompts]


@dataclass
class Wave:
    outs: list[Outcome]
    want: list[tuple[int, ...]]

    @property
    def equal(self) -> int:
        return sum(
            o.kind == "ok" and tuple(o.tokens or ()) == w
            for o, w in zip(self.outs, self.want, strict=True)
        )

    def failed(self) -> list[Outcome]:
        return [o for o in self.outs if o.kind != "ok"]


@dataclass
class Found:
    first: Wave  # REQUESTS, the fault among them
    second: Wave | None  # AFTER_DETECTION more, once the router saw the fault
    legs: int  # of the second wave's, sent to the faulted server (``legs_to``)
    retries: int  # the router's own count (vllm_router_retries_total) over both waves


class Fault:
    """What is done to the target: ``apply`` mid-run; ``recover`` once the
    second wave is answered (before the first wave is awaited)."""

    def apply(self, server: Server) -> None:
        raise NotImplementedError

    def recover(self, server: Server) -> None:
        pass


class Kill(Fault):
    def apply(self, server: Server) -> None:
        server.signal(signal.SIGKILL)
        server.wait_gone(30)


class Freeze(Fault):
    def apply(self, server: Server) -> None:
        server.signal(signal.SIGSTOP)

    def recover(self, server: Server) -> None:
        server.signal(signal.SIGCONT)


def scenario(
    d: Deployment, name: str, seed: int, target: Server | None = None, fault: Fault | None = None
) -> Found:
    """``REQUESTS`` through the router, ``SPACING_S`` apart. With a fault:
    ``fault.apply(target)`` after ``FAULT_AFTER`` answers; once the router
    marks the target unhealthy, ``AFTER_DETECTION`` more requests (awaited);
    then ``fault.recover(target)`` and the first wave's end."""
    prompts = prompts_of(REQUESTS + AFTER_DETECTION, seed=seed)
    want = references(d, prompts)
    for s in d.servers:
        s.reset_prefix_cache(within_s=SETTLE_S)
    retries = d.router_total("vllm_router_retries_total")

    async def go() -> tuple[list[Outcome], list[Outcome] | None]:
        async with http_session() as http:

            async def one(i: int, prompt: list[int]) -> Outcome:
                await asyncio.sleep(i * SPACING_S)
                return await ask(http, d.router.url, prompt, MAX_TOKENS, REQUEST_S, model=MODEL)

            tasks = [asyncio.create_task(one(i, p)) for i, p in enumerate(prompts[:REQUESTS])]
            if fault is None or target is None:
                return list(await asyncio.gather(*tasks)), None
            await first_done(tasks, FAULT_AFTER)
            await asyncio.to_thread(fault.apply, target)
            await asyncio.to_thread(wait_health, d, target, 0)
            second = list(
                await asyncio.gather(
                    *(
                        ask(http, d.router.url, p, MAX_TOKENS, REQUEST_S, model=MODEL)
                        for p in prompts[REQUESTS:]
                    )
                )
            )
            await asyncio.to_thread(fault.recover, target)
            return list(await asyncio.gather(*tasks)), second

    first, second = run(go())
    legs = 0 if second is None or target is None else legs_to(second, target, d)
    found = Found(
        Wave(first, want[:REQUESTS]),
        None if second is None else Wave(second, want[REQUESTS:]),
        legs,
        d.router_total("vllm_router_retries_total") - retries,
    )
    after = "-" if found.second is None else f"{found.second.equal}/{AFTER_DETECTION}, {legs}"
    d.rows.append(
        f"| {name} | {REQUESTS} | {REQUESTS - len(found.first.failed())} | {found.first.equal} "
        f"| {len(found.first.failed())} | {found.retries} | {max(o.seconds for o in first):.1f} "
        f"| {after} |"
    )
    print(f"\n{d.rows[-1]}\ntook {spread([o.seconds for o in first])}")
    for o in found.first.failed():
        print(f"  {o.kind} after {o.seconds:.2f}s: {o.error[:160]}")
    return found


# vllm-router names the pair it chose in the request id it gives both legs
# (X-Request-Id), which vLLM answers as the completion's id. Its counters
# cannot say this: it counts a prefill leg only once the decode has
# answered, so a leg sent before the fault may be counted after it.
ROUTE = re.compile(r"___prefill_addr_(?P<prefill>\S+?)___decode_addr_(?P<decode>\S+?)_[0-9a-f]{32}")


def legs_to(wave: list[Outcome], target: Server, d: Deployment) -> int:
    """How many requests of ``wave`` the router sent to ``target``: an
    answer whose route names it, or the router's own error naming it."""
    role = "prefill" if target in d.prefills else "decode"
    address = target.url.removeprefix("http://")

    def sent(o: Outcome) -> bool:
        if o.kind != "ok":
            return target.url in o.error
        found = ROUTE.search(o.id)
        assert found, f"no route in the answer's id {o.id!r}"
        return found[role] == address

    return sum(map(sent, wave))


def wait_health(d: Deployment, target: Server, health: int) -> None:
    """The router's health gauge for ``target`` reads ``health`` (1 healthy, 0 not)."""
    until = time.monotonic() + DETECT_S
    while d.router_counts("vllm_router_worker_health")[target.url] != health:
        assert time.monotonic() < until, f"the router's health of {target.name} not {health}"
        time.sleep(0.2)


def canary_check(d: Deployment) -> None:
    """No allocation on a decode gave another request a block that one of
    its loads held fenced (from the fence until it was lifted)."""
    for name, folder in d.canaries.items():
        path = folder / "events.jsonl"
        events = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
        lifted = {e["rid"]: e["t"] for e in events if e["event"] == "released"}
        for f in (e for e in events if e["event"] == "fenced"):
            until = lifted.get(f["rid"], time.time())
            reused = [
                e
                for e in events
                if e["event"] == "alloc"
                and e["rid"] != f["rid"]
                and f["t"] < e["t"] < until
                and set(e["blocks"]) & set(f["blocks"])
            ]
            assert not reused, f"{name}: fenced {f} reused by {reused[:3]}"


def assert_settled(d: Deployment, skip: Server | None = None) -> None:
    """Every live server idle (nothing running or waiting, no KV block in
    use), and no fenced block handed out (the canary)."""
    for s in d.servers:
        if s is not skip:
            s.wait_idle(SETTLE_S)
    canary_check(d)


def assert_equal_or(wave: Wave, lost: str, d: Deployment) -> None:
    """Every answer equals its reference; every other outcome is the
    router's own error naming ``lost`` (its PD mode retries nothing)."""
    assert wave.equal == len(wave.outs) - len(wave.failed()), "an answer differs from its reference"
    other = [o for o in wave.failed() if not (o.status == 500 and lost in o.error)]
    assert not other, f"failures not of the router's own kind ({lost!r}): {other[:4]}\n{d.logs()}"


def test_clean_requests_are_answered_equal(deployment: Deployment) -> None:
    d = deployment
    references(d, prompts_of(REQUESTS + AFTER_DETECTION, seed=300))  # the decode computes those
    before = [s.tokens_by_source() for s in d.decodes]
    f = scenario(d, "clean", seed=300)
    assert f.first.equal == REQUESTS, [o for o in f.first.outs if o.kind != "ok"][:4]
    for role in (d.prefills, d.decodes):  # each answer names one of each; all served
        legs = [legs_to(f.first.outs, s, d) for s in role]
        assert sum(legs) == REQUESTS and min(legs) > 0, (legs, f.first.outs[0].id)
    moved = [s.tokens_by_source() - b for s, b in zip(d.decodes, before, strict=True)]
    assert all(m["external_kv_transfer"] > 0 for m in moved), moved  # both decodes served
    assert all(m["local_compute"] == 0 for m in moved), moved  # every prompt token came over
    assert_settled(d)


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_server_killed_mid_run(deployment: Deployment, role: str) -> None:
    """The loads from a killed prefill are computed on the decode (policy
    recompute): answered, equal. What the router sent to the dead server
    before its health check saw it fails with the router's error; after
    that every request goes to the live ones and is answered."""
    d = deployment
    target = (d.prefills if role == "prefill" else d.decodes)[0]
    lost = f"Prefill request to {target.url}" if role == "prefill" else f"to {target.url}"
    try:
        f = scenario(d, f"{role} SIGKILL mid-run", seed=310, target=target, fault=Kill())
        assert_equal_or(f.first, lost, d)
        assert f.second is not None and f.second.equal == AFTER_DETECTION, f.second
        assert f.legs == 0, f"the router sent {f.legs} legs to the dead {target.name}"
        assert_settled(d, skip=target)
    finally:
        target.restart()
        wait_health(d, target, 1)


def test_a_prefill_frozen_mid_run(deployment: Deployment) -> None:
    """A frozen prefill: the decodes' loads from it fail at the heartbeat
    timeout and are computed there; its prefill legs wait for it (the
    router has no per-leg timeout); the router's health check takes it out,
    and the requests after that are answered by the other prefill. Thawed,
    it answers its waiting legs, or resets them: its server's keep-alive
    timer, overdue, may close a kept-alive connection whose new request it
    has not read yet (a reset), and the router retries nothing."""
    d = deployment
    target = d.prefills[0]
    try:
        f = scenario(d, "prefill SIGSTOP mid-run", seed=320, target=target, fault=Freeze())
    finally:
        target.signal(signal.SIGCONT)
    assert_equal_or(f.first, f"Prefill request to {target.url}", d)
    assert f.second is not None and f.second.equal == AFTER_DETECTION, f.second
    assert f.legs == 0, f"the router sent {f.legs} legs to the frozen {target.name}"
    assert_settled(d)
    wait_health(d, target, 1)
