"""A deterministic simulation of the whole KV hand-off, in the style of
FoundationDB's simulator and TigerBeetle's VOPR: the real sans-I/O cores
(``kvguard.vllm.prefill_core``, ``decode_core``, ``decode_legs``) in one
process, driven by a seeded world (``handoff_world``: engines, vLLM's
scheduler, ZeroMQ over TCP, crashes, freezes, restarts, partitions) on a
simulated clock, with the invariants below checked after every event.

``run(seed, config)`` is one world: clients send ``config.requests``
requests, faults strike until the last has had its deadline, then the
world drains (no more faults, every frozen prefill thawed, every partition
healed) and must come to rest. The same seed and config replay the same
events. A violation raises ``InvariantViolated`` naming the invariant, the
seed, the simulated time and the last events.

Invariants (the ``invariant`` names):

* ``deadline``: every decode request vLLM still waits on is told to it by
  its deadline (plus ``TOL`` and the worker's step that takes it) on every
  worker: finished (loaded or failed) or its blocks as load errors. One
  vLLM gave up first (a client abort, or failed on another worker's load
  errors) waits for the prefill's verdict instead, as ``DecodeCore.cancel``
  says: its blocks may be written until then (``drain`` checks it ends);
* ``I6``: no decode block is written by a prefill engine after vLLM got it
  back (freed it, or gave it to another request);
* ``release``: a prefill releases each hold once, never with a transfer of
  it in flight (submitted and not yet released by kvguard, quiesced);
* ``group``: a hold released before its deadline had its group settled: no
  new load of a declared group (n > 1, ``kvguard_loads``) is pushed after;
* ``max_hold``: no hold outlives ``max_hold_s`` but for a transfer in flight;
* ``renew``: no hold expires before its deadline as the decodes' renewals
  set it (one read before the hold began included);
* ``once``: each worker tells vLLM of a request at most once as load
  errors and exactly once finished, and vLLM frees its blocks only then;
* ``drain``: at rest nothing is held, waited on, in flight or out of its pool;
* ``crash``: a core raised.
"""

from __future__ import annotations

import heapq
import traceback
from dataclasses import dataclass, field

from handoff_model import FROZEN, STEP_S, Child, Config, DRank, PRank, Xfer
from handoff_world import World

from kvguard.vllm.decode_legs import Verdict
from kvguard.vllm.protocol import Abort, Push, Renew, Result
from kvguard.vllm.states import HoldEnd

__all__ = ["TOL", "Checker", "Config", "InvariantViolated", "Outcome", "run"]

TOL = 0.01  # simulated seconds a timed duty may run late (the cores step at their wake)


def drain_s(cfg: Config) -> float:
    """The most a drain may go without progress (a decode request handed
    back, a hold released), simulated: twice the longest any one thing takes
    to end once nothing is frozen or cut off -- a transfer hung past its
    deadline, a hold, an early push (by its expiry), a link backing off (16
    stalls), packets a partition held, a restart -- and a probe's period."""
    longest = max(
        cfg.deadline_s + 3 * cfg.hb_s,
        cfg.max_hold_s,
        32 * cfg.hb_s,
        cfg.max_partition_s + 0.3,
        cfg.max_down_s,
    )
    return 2 * (longest + 1.0)


class InvariantViolated(AssertionError):
    def __init__(self, invariant: str, message: str) -> None:
        super().__init__(message)
        self.invariant = invariant


_Key = tuple[int, int, str]  # (prefill rank uid, its incarnation, request id)


class Checker:
    """The invariants, fed by the world as things happen; O(1) per event."""

    def __init__(self, seed: int, cfg: Config) -> None:
        self.seed, self.cfg = seed, cfg
        self.holds: dict[_Key, list[float]] = {}  # held: [deadline, max_hold deadline]
        self.inflight: dict[_Key, int] = {}  # transfers submitted, not yet released
        self.seen: dict[_Key, set[str]] = {}  # loads a prefill heard of, per request
        self.early: dict[_Key, tuple[float, float]] = {}  # released before its deadline: when, it
        self.renewed: dict[_Key, float] = {}  # a Renew read before its hold began: when
        self.cancelled: set[str] = set()  # decode requests vLLM gave up while loading
        self.told: dict[
            str, list[int]
        ] = {}  # decode request -> per worker: 0, 1 load errors, 2 final
        self.deadlines: list[tuple[float, str]] = []
        self.max_holds: list[tuple[float, _Key]] = []

    def fail(self, world: World, invariant: str, what: str) -> None:
        trail = "\n".join(_line(t, name, args) for t, name, args in world.trail)
        raise InvariantViolated(
            invariant,
            f"{invariant}: {what} (seed {self.seed}, t={world.now:.6f}s, after "
            f"{world.loads} loads)\nlast events:\n{trail}",
        )

    # -- the prefill -----------------------------------------------------------

    def hold(self, world: World, pr: PRank, rid: str, deadline: float) -> None:
        key = (pr.uid, pr.inc, rid)
        last = world.now + self.cfg.max_hold_s
        renewed = self.renewed.pop(key, None)
        if renewed is not None:  # the decode queued first: the hold starts renewed
            deadline = max(deadline, min(renewed + self.cfg.hold_s, last))
        self.holds[key] = [deadline, last]
        heapq.heappush(self.max_holds, (last + TOL, key))

    def message(self, world: World, pr: PRank, msg: Push | Abort | Renew) -> None:
        key = (pr.uid, pr.inc, msg.request_id)
        if isinstance(msg, Renew):
            held = self.holds.get(key)
            if held is not None:
                held[0] = max(held[0], min(world.now + self.cfg.hold_s, held[1]))
            else:  # not begun (or ended: a key is held once, so never used then)
                self.renewed[key] = world.now
            return
        if isinstance(msg, Abort) and not msg.load_id:
            return
        seen = self.seen.setdefault(key, set())
        if isinstance(msg, Push) and msg.load_id in seen:
            world.seen["push of a known load"] += 1
        if isinstance(msg, Push):
            early = self.early.get(key)
            if (
                early is not None
                and msg.load_id not in seen
                and world.now < early[1]
                and world.declared[msg.request_id]
            ):
                self.fail(
                    world,
                    "group",
                    f"{pr.url} released {msg.request_id} at t={early[0]:.6f}s, before its "
                    f"deadline t={early[1]:.6f}s, and then load {msg.load_id} of its group "
                    f"(declared n) pushed",
                )
        seen.add(msg.load_id)

    def submitted(self, pr: PRank, rid: str) -> None:
        key = (pr.uid, pr.inc, rid)
        self.inflight[key] = self.inflight.get(key, 0) + 1

    def landed(self, pr: PRank, rid: str) -> None:
        key = (pr.uid, pr.inc, rid)
        left = self.inflight[key] - 1
        if left:
            self.inflight[key] = left
        else:
            del self.inflight[key]

    def release(self, world: World, pr: PRank, rid: str) -> None:
        key = (pr.uid, pr.inc, rid)
        held = self.holds.pop(key, None)
        if held is None:
            self.fail(world, "release", f"{pr.url} released {rid}, which it does not hold")
            return
        if key in self.inflight:
            self.fail(
                world,
                "release",
                f"{pr.url} released {rid} with {self.inflight[key]} transfer(s) of it in flight",
            )
        if world.now < held[0]:
            if pr.core is not None and pr.core._recent.get(rid) == HoldEnd.EXPIRED.value:
                self.fail(
                    world,
                    "renew",
                    f"{pr.url} let {rid}'s hold expire at t={world.now:.6f}s, before "
                    f"t={held[0]:.6f}s, which renewals had set",
                )
            self.early[key] = (world.now, held[0])
        else:
            world.seen["hold ran out"] += 1

    def crashed(self, pr: PRank) -> None:
        for table in (self.holds, self.inflight):
            for key in [k for k in table if k[0] == pr.uid]:
                del table[key]

    def write(self, world: World, x: Xfer) -> None:
        owner = world.dservers[x.dserver].owner
        rid = x.load.split("#")[0]
        if rid in self.told and 1 in self.told[rid]:
            world.seen["write into fenced blocks"] += 1
        for b in x.dst:
            if owner.get(b) != rid:
                self.fail(
                    world,
                    "I6",
                    f"{x.prank.url} wrote block {b} of decode {x.dserver} for {x.load}, but "
                    f"vLLM has it back ({owner.get(b) or 'free'})",
                )

    # -- the decode ------------------------------------------------------------

    def loading(self, world: World, ch: Child, workers: int) -> None:
        self.told[ch.rid] = [0] * workers
        # vLLM hears it at the worker's next step: up to one step and a take's gap later.
        due = ch.deadline + TOL + STEP_S[1] + self.cfg.take_gap_s
        heapq.heappush(self.deadlines, (due, ch.rid))

    def verdict(self, world: World, dr: DRank, ch: Child, v: Verdict) -> None:
        told = self.told.get(ch.rid)
        if told is None:
            self.fail(world, "once", f"worker {dr.ident!r} told vLLM of {ch.rid}, not loading")
            return
        was = told[dr.rank]
        if was == 2 or (was == 1 and not v.final):
            what = "finished" if was == 2 else "as load errors"
            self.fail(
                world, "once", f"worker {dr.ident!r} told vLLM of {ch.rid} again ({what} before)"
            )
        told[dr.rank] = 2 if v.final else 1

    def cancel(self, ch: Child) -> None:
        self.cancelled.add(ch.rid)

    def handback(self, world: World, ch: Child) -> None:
        self.cancelled.discard(ch.rid)
        told = self.told.pop(ch.rid)
        if told != [2] * len(told):
            self.fail(world, "once", f"vLLM freed {ch.rid}'s blocks with workers at {told}")

    # -- after every event -----------------------------------------------------

    def after(self, world: World) -> None:
        now, deadlines, max_holds = world.now, self.deadlines, self.max_holds
        while deadlines and deadlines[0][0] < now:
            due, rid = heapq.heappop(deadlines)
            told = self.told.get(rid)
            if told is not None and 0 in told and rid not in self.cancelled:
                self.fail(
                    world,
                    "deadline",
                    f"decode request {rid} not told to vLLM by its deadline and a step, "
                    f"t={due:.6f}s "
                    f"(workers {told})",
                )
        while max_holds and max_holds[0][0] < now:
            due, key = heapq.heappop(max_holds)
            if key not in self.holds:
                continue
            pr = world.pranks[key[0]]
            if pr.state == FROZEN or key in self.inflight or pr.since + TOL > now:
                heapq.heappush(max_holds, (now + 0.05, key))
                continue
            self.fail(
                world,
                "max_hold",
                f"{pr.url} still holds {key[2]} at t={now:.6f}s, past its max_hold_s "
                f"(t={due - TOL:.6f}s), nothing in flight",
            )

    def leftovers(self, world: World) -> list[str]:
        """What is not at rest (empty: drained)."""
        out = []
        for ds in world.dservers:
            for dr in ds.ranks:
                if not dr.core.drained() or dr.legs.in_use():
                    out.append(f"decode {dr.ident!r} waits on {dr.core.waiting()} loads, "
                               f"legs {dr.legs.in_use()}")  # fmt: skip
            if len(ds.free) != world.cfg.pool or ds.queue:
                out.append(f"decode {ds.idx}: {len(ds.free)}/{world.cfg.pool} blocks free, "
                           f"{len(ds.queue)} queued")  # fmt: skip
        for pr in world.pranks:
            if pr.core is not None and (not pr.core.drained() or pr.xfers):
                out.append(f"prefill {pr.url} holds {pr.core.holding()}, {len(pr.xfers)} in flight")
        if self.holds or self.inflight:
            out.append(f"holds never released {sorted(self.holds)[:5]}, in flight {self.inflight}")
        return out


def _arg(a: object) -> str:
    if isinstance(a, Push):
        return f"Push({a.load_id} of {a.request_id}, {len(a.blocks)} blocks, group {a.group})"
    if isinstance(a, Result):
        return f"Result({a.load_id}, {a.ok}, {a.reason!r})"
    return repr(a)


def _line(t: float, name: str, args: tuple[object, ...]) -> str:
    if name == "_in_prefill":  # (prank, incarnation, fn, args)
        fn, inner = args[2], args[3]
        assert isinstance(inner, tuple)
        who = str(args[0]).split("#")[0]
        name, args = f"{who}#{args[1]}:{getattr(fn, '__name__', fn)}", inner
    return f"  {t:.6f} {name}({', '.join(_arg(a) for a in args)})"[:220]


@dataclass
class Outcome:
    seed: int
    children: int  # decode requests made
    loads: int  # of which loaded (blocks allocated, legs expected)
    events: int
    sim_s: float
    violation: InvariantViolated | None
    seen: dict[str, int] = field(default_factory=dict)  # what happened, for coverage


def run(seed: int, cfg: Config, *, stop_on_violation: bool = True) -> Outcome:
    """One world on ``seed``; raises InvariantViolated, or returns it when
    ``stop_on_violation`` is False."""
    check = Checker(seed, cfg)
    world = World(seed, cfg, check)
    try:
        try:
            while world.made < cfg.requests:
                world.run_until(world.now + 1.0)
            world.run_until(world.now + cfg.deadline_s)  # faults go on for the last ones
            world.thaw_all()
            limit, progress = world.now + drain_s(cfg), world.progress
            while check.leftovers(world) and world.now < limit:
                world.run_until(world.now + 0.5)
                if world.progress != progress:  # (queued requests are served one by one)
                    limit, progress = world.now + drain_s(cfg), world.progress
            left = check.leftovers(world)
            if left:
                check.fail(world, "drain", "; ".join(left))
        except InvariantViolated:
            raise
        except Exception as exc:
            where = "".join(traceback.format_exception(exc)[-6:])
            check.fail(world, "crash", f"{type(exc).__name__}: {exc}\n{where}")
    except InvariantViolated as v:
        if stop_on_violation:
            raise
        return Outcome(
            seed, world.children, world.loads, world.events, world.now, v,
            dict(world.seen),
        )  # fmt: skip
    return Outcome(
        seed, world.children, world.loads, world.events, world.now, None,
        dict(world.seen),
    )  # fmt: skip
