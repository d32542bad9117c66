"""The hand-off simulation's clock, network and faults: ``handoff_world``'s base.

``Network`` is the half of ``handoff_world.World`` that keeps time, carries
messages and breaks things; the other half runs the engines and vLLM
(``_boot``, ``_p_receive``, ``_d_apply``). Events run at their simulated
time, in the order they were scheduled; one inside a prefill process runs
only in the incarnation it was meant for, and waits out a freeze.

ZeroMQ over TCP, as modelled: a DEALER's pipe queues what it is sent until
its connection's handshake; a connection is FIFO, and loses nothing while it
lives; a heartbeat timeout drops it (a frozen or partitioned peer), and
ZeroMQ dials again; a socket closed loses what it queued, though what it
already wrote still arrives; the decode's identity is one across its
connections, and a ROUTER routes by it to the latest (ROUTER_HANDOVER: the
old one's unread data is dropped), dropping a reply with no live one; a
frozen prefill's kernel accepts connections but nothing handshakes, and on
thaw the process reads what waited in any interleaving across connections;
a partition holds packets until it heals (TCP retransmits, even a closed
socket's); a probe answers "gone" only where nothing listens and the
network answers. The monitor's events reach the core up to
``Config.monitor_s`` late, in order.
"""

from __future__ import annotations

import heapq
import itertools
import os
import random
from collections import Counter, deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

from handoff_model import (
    DEAD,
    FROZEN,
    NET_S,
    PROBE_TIMEOUT_S,
    RECONNECT_S,
    TURN_S,
    UP,
    Config,
    Conn,
    DRank,
    DServer,
    Part,
    PRank,
    Sock,
)

from kvguard.vllm.actions import DecodeAction, Open
from kvguard.vllm.protocol import Abort, Push, Renew, Result
from kvguard.vllm.states import LinkEvent

if TYPE_CHECKING:
    from handoff_sim import Checker
    from handoff_world import World

__all__ = ["Network"]


class Network:
    """A world's clock, network and faults; see the module docstring."""

    def __init__(self, seed: int, cfg: Config, check: Checker) -> None:
        self.seed, self.cfg, self.check = seed, cfg, check
        self.rng = rng = random.Random(seed)
        self.now = 0.0
        self._q: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._seq = itertools.count()
        self.trail: deque[tuple[float, str, tuple[Any, ...]]] = deque(
            maxlen=int(os.environ.get("KVGUARD_SIM_TRAIL", "40"))
        )
        self.events = 0
        self.seen: Counter[str] = Counter()  # what happened, for coverage
        self.stopping = False  # no more faults (a drain)
        uids = itertools.count()
        self.pservers = [
            [PRank(next(uids), s, r, tp) for r in range(tp)] for s, tp in enumerate(cfg.prefills)
        ]
        self.pranks = [pr for ranks in self.pservers for pr in ranks]
        self.by_url = {pr.url: pr for pr in self.pranks}
        for pr in self.pranks:
            pr.skew = rng.uniform(-cfg.skew_s, cfg.skew_s)
            self._boot(pr)
        self.dservers = [DServer(d, tp, cfg, rng) for d, tp in enumerate(cfg.decodes)]
        self.parts: dict[tuple[int, int], Part] = {}
        n_pairs = len(self.dservers) * len(self.pservers)
        self._fault_rate = (cfg.crash + cfg.freeze) * len(self.pranks) + cfg.partition * n_pairs

    # -- the other half --------------------------------------------------------

    def _boot(self, pr: PRank) -> None:
        """Start ``pr``'s next incarnation."""
        raise NotImplementedError

    def _p_receive(self, c: Conn, msg: Push | Abort | Renew) -> None:
        """``c``'s prefill reads ``msg``."""
        raise NotImplementedError

    def _d_apply(self, dr: DRank, acts: list[DecodeAction]) -> None:
        """Carry out ``dr``'s core's actions."""
        raise NotImplementedError

    # -- the clock -------------------------------------------------------------

    def at(self, t: float, fn: Callable[..., None], *args: Any) -> None:
        heapq.heappush(self._q, (t, next(self._seq), fn, args))

    def run_until(self, end: float) -> None:
        """Run every event due by ``end``, the invariants checked after each."""
        q, trail, check, world = self._q, self.trail, self.check, cast("World", self)
        while q and q[0][0] <= end:
            t, _, fn, args = heapq.heappop(q)
            self.now = t
            trail.append((t, fn.__name__, args))
            self.events += 1
            fn(*args)
            check.after(world)
        self.now = end

    def turn(self, wake: float) -> float:
        """When a driver steps a core that wants to be stepped at ``wake``: then,
        or its next turn if that is now (a real driver's clock moves on between
        turns; a core may want a step at the instant it last stepped)."""
        return wake if wake > self.now else self.now + TURN_S

    def net(self) -> float:
        return self.now + self.rng.uniform(*NET_S)

    def pat(self, t: float, pr: PRank, fn: Callable[..., None], *args: Any) -> None:
        """``fn(*args)`` at ``t`` inside ``pr``'s current incarnation."""
        self.at(t, self._in_prefill, pr, pr.inc, fn, args)

    def _in_prefill(
        self, pr: PRank, inc: int, fn: Callable[..., None], args: tuple[Any, ...]
    ) -> None:
        if pr.inc != inc or pr.state == DEAD:
            return
        if pr.state == FROZEN:
            pr.deferred.append((fn, args, None))
        else:
            fn(*args)

    def part(self, d: int, s: int) -> Part | None:
        p = self.parts.get((d, s))
        return p if p is not None and p.until > self.now else None

    # -- faults ----------------------------------------------------------------

    def start_faults(self) -> None:
        if self._fault_rate > 0:
            self.at(self.rng.expovariate(self._fault_rate), self._fault)

    def _fault(self) -> None:
        if self.stopping:
            return
        cfg, rng = self.cfg, self.rng
        self.at(self.now + rng.expovariate(self._fault_rate), self._fault)
        r = rng.random() * self._fault_rate
        pr = rng.choice(self.pranks)
        if r < cfg.crash * len(self.pranks):
            if pr.state != DEAD:
                self.seen["prefill killed"] += 1
                self._kill(pr)
        elif r < (cfg.crash + cfg.freeze) * len(self.pranks):
            if pr.state == UP:
                self.seen["prefill frozen"] += 1
                pr.state, pr.since = FROZEN, self.now
                pr.freeze_no += 1
                hbs = (
                    rng.uniform(2.0, cfg.max_freeze_hb)
                    if rng.random() < 0.3
                    else rng.uniform(0.1, 2.0)
                )
                dur = hbs * cfg.hb_s
                self.at(self.now + dur, self._thaw, pr, pr.freeze_no)
                for c in pr.conns:
                    self.at(self.now + cfg.hb_s, self._hb_check, c)
        else:
            d, s = rng.randrange(len(self.dservers)), rng.randrange(len(self.pservers))
            if self.part(d, s) is None:
                self.seen["partition"] += 1
                p = self.parts[d, s] = Part(
                    self.now, self.now + rng.uniform(0.05, cfg.max_partition_s)
                )
                self.at(p.until, self._heal, d, s, p)
                for q in self.pservers[s]:
                    for c in q.conns:
                        if c.sock.drank.server == d:
                            self.at(self.now + cfg.hb_s, self._hb_check, c)

    def _heal(self, d: int, s: int, p: Part) -> None:
        if self.parts.get((d, s)) is p:
            del self.parts[d, s]

    def _kill(self, pr: PRank) -> None:
        self.check.crashed(pr)
        pr.state, pr.core = DEAD, None
        pr.deferred.clear()
        pr.xfers.clear()
        pr.route.clear()
        for c in pr.conns:
            if not (c.dead or c.closing):
                c.dead = True
                silent = self.part(c.sock.drank.server, pr.server) is not None
                self.at(self.now + self.cfg.hb_s if silent else self.net(), self._conn_lost, c)
        pr.conns = {}
        self.at(self.now + self.rng.uniform(0.05, self.cfg.max_down_s), self._boot, pr)

    def _thaw(self, pr: PRank, freeze_no: int) -> None:
        if pr.state != FROZEN or pr.freeze_no != freeze_no:
            return
        pr.state, pr.since = UP, self.now
        # The process reads its connections, timers and engine in any
        # interleaving; each connection in order, the rest in order.
        streams: dict[object, deque[tuple[Callable[..., None], tuple[Any, ...]]]] = {}
        for fn, args, key in pr.deferred:
            streams.setdefault(key, deque()).append((fn, args))
        pr.deferred = []
        live = list(streams.values())
        while live:
            i = self.rng.randrange(len(live))
            fn, args = live[i].popleft()
            self.pat(self.now, pr, fn, *args)
            if not live[i]:
                live.pop(i)

    def thaw_all(self) -> None:
        self.stopping = True
        for pr in self.pranks:
            if pr.state == FROZEN:
                self._thaw(pr, pr.freeze_no)
        for p in self.parts.values():
            p.until = min(p.until, self.now)

    # -- the network -----------------------------------------------------------

    def _silent_since(self, c: Conn) -> float | None:
        pr, starts = c.prank, []
        if pr.state == FROZEN:
            starts.append(pr.since)
        p = self.part(c.sock.drank.server, pr.server)
        if p is not None:
            starts.append(p.since)
        return min(starts) if starts else None

    def _hb_check(self, c: Conn) -> None:
        if c.dead or c.closing or not c.up:
            return
        since = self._silent_since(c)
        if since is None:
            return
        if self.now + 1e-9 >= since + self.cfg.hb_s:
            self.seen["heartbeat drop"] += 1
            c.dead = True
            self._conn_lost(c)
        else:
            self.at(since + self.cfg.hb_s, self._hb_check, c)

    def _conn_lost(self, c: Conn) -> None:
        """The decode's side of ``c`` dropped (heartbeats, RST, handshake limit)."""
        c.dead = True
        c.prank.conns.pop(c, None)
        s = c.sock
        if s.open and s.conn is c:
            s.conn = None
            self._monitor(s, LinkEvent.DROPPED)
            s.dial0 = self.now + RECONNECT_S
            self.at(s.dial0, self._connect, s)

    def _connect(self, s: Sock) -> None:
        if not s.open or s.conn is not None:
            return
        pr, now, hb = self.by_url[s.url], self.now, self.cfg.hb_s
        p = self.part(s.drank.server, pr.server)
        if self.rng.random() < self.cfg.p_connect_error:  # ZeroMQ says "retried", as if refused
            self.seen["connect error"] += 1
            self._monitor(s, LinkEvent.REFUSED)
            s.dial0 = now + RECONNECT_S
            self.at(s.dial0, self._connect, s)
        elif p is not None:  # SYNs unanswered until it heals or TCP gives up
            limit = s.dial0 + 40 * hb
            if now >= limit:
                self._monitor(s, LinkEvent.REFUSED)
                s.dial0 = now + RECONNECT_S
                self.at(s.dial0, self._connect, s)
            else:
                self.at(min(p.until + self.rng.uniform(0.0, 0.3), limit), self._connect, s)
        elif pr.state == DEAD:
            self._monitor(s, LinkEvent.REFUSED)
            s.dial0 = now + RECONNECT_S
            self.at(s.dial0, self._connect, s)
        else:
            c = s.conn = Conn(s, pr)
            pr.conns[c] = None
            self.pat(self.net(), pr, self._accept, c)  # a frozen one's kernel accepts; no handshake
            self.at(now + 10 * hb, self._hs_timeout, c)  # ZeroMQ's handshake limit

    def _accept(self, c: Conn) -> None:
        """The prefill's side of ``c``'s handshake (its ROUTER hands the identity over)."""
        if c.dead or c.closing:
            return
        p = self.part(c.sock.drank.server, c.prank.server)
        if p is not None:
            self.pat(p.until, c.prank, self._accept, c)
            return
        route, ident = c.prank.route, c.sock.drank.ident
        old = route.get(ident)
        if old is not None and old is not c:
            self.seen["identity handed over"] += 1
            old.handed = True
        route[ident] = c
        self.at(self.net(), self._hs_done, c)

    def _hs_done(self, c: Conn) -> None:
        """The decode's side: the handshake is done, its pipe flows."""
        if c.dead or c.closing:
            return
        c.up = True
        s = c.sock
        for msg in s.outq:
            self._d2p(c, msg)
        s.outq.clear()
        self._monitor(s, LinkEvent.HANDSHAKE)

    def _hs_timeout(self, c: Conn) -> None:
        if not (c.up or c.dead or c.closing):
            self._conn_lost(c)

    def _monitor(self, s: Sock, ev: LinkEvent) -> None:
        s.mon = t = max(self.now + self.rng.uniform(0.0, self.cfg.monitor_s), s.mon)
        self.at(t, self._mon_event, s, ev)

    def _mon_event(self, s: Sock, ev: LinkEvent) -> None:
        if s.open:  # a closed socket's monitor closed with it
            self.seen[f"link {ev.name}"] += 1
            dr = s.drank
            self._d_apply(dr, dr.core.link_event(s.url, s.gen, ev, self.now))

    def _d2p(self, c: Conn, msg: Push | Abort | Renew) -> None:
        c.d2p = t = max(self.net(), c.d2p)
        self.at(t, self._arrive_p, c, msg)

    def _arrive_p(self, c: Conn, msg: Push | Abort | Renew) -> None:
        pr = c.prank
        if pr.inc != c.inc or pr.state == DEAD or c.handed:
            return
        p = self.part(c.sock.drank.server, pr.server)
        if p is not None:  # retransmitted once it heals (even by a closed socket's kernel)
            self.seen["held by a partition"] += 1
            c.d2p = t = max(p.until + self.rng.uniform(0.0, 0.3), c.d2p)
            self.at(t, self._arrive_p, c, msg)
        elif pr.state == FROZEN:
            self.seen["read on thaw"] += 1
            pr.deferred.append((self._p_receive, (c, msg), c))
        else:
            self._p_receive(c, msg)

    def _arrive_d(self, c: Conn, res: Result) -> None:
        if c.dead or c.closing:
            return  # the decode's side of it is gone: ZeroMQ drops it
        p = self.part(c.sock.drank.server, c.prank.server)
        if p is not None:
            c.p2d = t = max(p.until + self.rng.uniform(0.0, 0.3), c.p2d)
            self.at(t, self._arrive_d, c, res)
            return
        s = c.sock
        self._d_apply(s.drank, s.drank.core.result(s.url, res, self.now))

    # -- sockets --------------------------------------------------------------

    def _probe(self, dr: DRank, url: str) -> None:
        """A TCP connect to ``url``'s port: refused only where nothing listens."""
        pr = self.by_url[url]
        self.seen[f"probe {'gone' if pr.state == DEAD else 'alive'}"] += 1
        if self.part(dr.server, pr.server) is not None:
            self.at(self.now + PROBE_TIMEOUT_S, self._probed, dr, url, False)  # silence
        else:
            self.at(self.net(), self._probed, dr, url, pr.state == DEAD)

    def _probed(self, dr: DRank, url: str, gone: bool) -> None:
        self._d_apply(dr, dr.core.probed(url, gone, self.now))

    def _open(self, dr: DRank, a: Open) -> None:
        if self.rng.random() < self.cfg.p_open_fail:
            self._d_apply(dr, dr.core.open_failed(a.endpoint, a.gen, "sim: no socket", self.now))
            return
        if a.endpoint in dr.socks:
            self.seen["link remade"] += 1
        self._close(dr, a.endpoint)  # the old one closes once the new one is made
        s = dr.socks[a.endpoint] = Sock(dr, a.endpoint, a.gen, self.now)
        self.at(self.net(), self._connect, s)
        self._d_apply(dr, dr.core.opened(a.endpoint, a.gen, self.now))

    def _close(self, dr: DRank, url: str) -> None:
        s = dr.socks.pop(url, None)
        if s is not None:
            s.open = False
            s.outq.clear()  # LINGER 0: what it queued is lost; what it wrote goes on
            if s.conn is not None:
                s.conn.closing = True
                s.conn.prank.conns.pop(s.conn, None)
