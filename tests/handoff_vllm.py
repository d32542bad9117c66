"""The hand-off simulation's vLLM: clients, and each decode server's scheduler.

``World`` (``handoff_world``) is this and the engines' processes: here are
the clients' requests, each prefill request's decode requests arriving,
queued for blocks (renewing their prefill's hold), allocated and loaded
through every worker, given up, sent again, and told back as the worker
tells vLLM (``_verdict``). The process side (``_hold``, ``_d_apply``,
``_w_wake``) is ``World``'s.
"""

from __future__ import annotations

from handoff_model import (
    DEAD,
    DONE,
    LOADING,
    QUEUED,
    STEP_S,
    Child,
    DRank,
    DServer,
    Group,
    PRank,
)
from handoff_net import Network

from kvguard.vllm.actions import DecodeAction
from kvguard.vllm.decode_legs import Verdict
from kvguard.vllm.params import Source

__all__ = ["VLLM"]


class VLLM(Network):
    """vLLM's part of the world; ``World`` adds the engines' processes."""

    made: int  # client requests
    children: int  # decode requests
    loads: int  # decode requests loading
    progress: int  # decode requests handed back and holds released
    declared: dict[str, bool]  # prefill request -> its n > 1 declared
    kids: dict[str, Child]  # decode requests loading, by id

    def _hold(self, pr: PRank, rid: str, n: int, deadline: float) -> None:
        raise NotImplementedError

    def _d_apply(self, dr: DRank, acts: list[DecodeAction]) -> None:
        raise NotImplementedError

    def _w_wake(self, dr: DRank) -> None:
        raise NotImplementedError

    # -- vLLM: clients, the decode scheduler -----------------------------------

    def _client(self) -> None:
        cfg, rng, now = self.cfg, self.rng, self.now
        if self.made >= cfg.requests:
            return
        self.made += 1
        self.at(now + rng.expovariate(cfg.rate), self._client)
        s, ds = rng.randrange(len(self.pservers)), rng.choice(self.dservers)
        n = rng.randint(2, cfg.max_n) if rng.random() < cfg.p_group else 1
        rid = f"p{s}-{self.made}"
        self.declared[rid] = n > 1 and rng.random() < cfg.p_declared
        self.at(now + rng.uniform(0.001, 0.01), self._prefilled, s, rid, ds, n)

    def _prefilled(self, s: int, rid: str, ds: DServer, n: int) -> None:
        ranks, rng, now = self.pservers[s], self.rng, self.now
        if all(pr.state == DEAD for pr in ranks):
            return  # the client's prefill request failed
        size = rng.randint(1, self.cfg.hold_blocks)
        for pr in ranks:
            if pr.state != DEAD:  # the worker holds it one engine step later
                self.pat(
                    now + rng.uniform(*STEP_S), pr, self._hold, pr, rid, size, now + self.cfg.hold_s
                )
        t = now + rng.uniform(0.0005, 0.003)
        for i in range(n):
            self.children += 1
            ch = Child(f"{rid}.{i}", rid, s, ds.idx, n, rng.randint(1, size))
            ch.declared, ch.prefix = self.declared[rid], rng.random() < self.cfg.p_prefix
            t += rng.uniform(0.0, 0.01)
            self.at(t, self._arrive, ds, ch)

    def _arrive(self, ds: DServer, ch: Child) -> None:
        g = ds.groups.setdefault(ch.src, Group())
        g.waiting.add(ch.rid)
        if ch.declared:
            g.declared = max(g.declared, ch.n)
        ds.queue.append(ch)
        if self.rng.random() < self.cfg.p_abort:
            self.at(
                self.now + self.rng.uniform(0.0, 1.5 * self.cfg.deadline_s), self._client_abort, ch
            )
        self._schedule(ds)
        # As the scheduler side: one not allocated in its first step renews then.
        self.at(self.now, self._renew, ch)

    def _source(self, ch: Child) -> Source:
        """``ch``'s prefill request as its ``kv_transfer_params`` name it."""
        ranks = self.pservers[ch.pserver]
        return Source(ranks[0].url, ch.src, len(ranks))

    def _schedule(self, ds: DServer) -> None:
        while ds.queue:
            ch = ds.queue[0]
            if not ch.prefix and len(ds.free) < ch.k:
                return
            ds.queue.popleft()
            if ch.prefix:
                ch.state = DONE
                self._not_loading(ds, ch)
            else:
                self._alloc(ds, ch)

    def _alloc(self, ds: DServer, ch: Child) -> None:
        now = self.now
        ch.blocks = [ds.free.pop() for _ in range(ch.k)]
        for b in ch.blocks:
            ds.owner[b] = ch.rid
        g = ds.groups.get(ch.src)
        if g is None:
            g = ds.groups[ch.src] = Group()
            g.declared = ch.n if ch.declared else 0
        size = g.size()
        g.waiting.discard(ch.rid)
        g.live.add(ch.rid)
        g.pushed += 1
        ch.state, ch.deadline = LOADING, now + self.cfg.deadline_s
        self.kids[ch.rid] = ch
        self.loads += 1
        self.check.loading(self, ch, len(ds.ranks))
        src = self._source(ch)
        for dr in ds.ranks:  # the worker's _expect
            asks = dr.pairing.asks(ch.rid, src)
            dr.legs.start(ch.rid, ch.blocks, [a.leg_id for a in asks])
            self._w_wake(dr)
            ch.legs += len(asks)
            for a in asks:
                acts = dr.core.expect(
                    a.leg_id, a.url, ch.src, ch.blocks, ch.deadline, size * a.fan_in, now,
                    now + dr.skew,
                )  # fmt: skip
                self._d_apply(dr, acts)
        ch.group = size

    def _not_loading(self, ds: DServer, ch: Child) -> None:
        """The connector's ``_not_loading``: tell the prefill (with the group's
        size, this one counted), or shrink later pushes."""
        g = ds.groups.get(ch.src)
        tell, size = True, 1
        if g is not None:
            size = max(g.size(), 1)
            g.waiting.discard(ch.rid)
            if not (g.pushed or not g.waiting):
                tell, g.left = False, g.left + 1
            if not g.waiting and not g.live:
                del ds.groups[ch.src]
        if tell:
            for dr in ds.ranks:
                for url, fan_in in dr.pairing.ranks_of(self._source(ch)):
                    self._d_apply(dr, dr.core.forget(url, ch.src, self.now, size * fan_in))

    def _renew(self, ch: Child) -> None:
        if ch.state != QUEUED:
            return
        ds = self.dservers[ch.server]
        for dr in ds.ranks:
            for url in dr.pairing.urls(self._source(ch)):
                self._d_apply(dr, dr.core.renew(url, ch.src, self.now))
        self.at(self.now + max(self.cfg.hold_s / 3, 0.1), self._renew, ch)

    def _client_abort(self, ch: Child) -> None:
        ds = self.dservers[ch.server]
        if ch.state == QUEUED:
            ds.queue.remove(ch)
            ch.state = DONE
            self._not_loading(ds, ch)
        elif ch.state == LOADING and not ch.cancelled and ch.finals < len(ds.ranks):
            ch.cancelled = True  # request_finished while loading: the connector's cancels
            self.check.cancel(ch)
            for dr in ds.ranks:
                for leg in dr.legs.legs(ch.rid):
                    self._d_apply(dr, dr.core.cancel(leg, self.now))

    def _verdict(self, dr: DRank, v: Verdict | None) -> None:
        if v is None:
            return
        ch = self.kids[v.request_id]
        ds = self.dservers[ch.server]
        self.check.verdict(self, dr, ch, v)
        if not v.final:  # load errors: vLLM fails the request now, keeps the blocks
            if not ch.failed:
                ch.failed = True
                self.at(self.now + self.rng.uniform(*STEP_S), self._client_abort, ch)
            return
        ch.finals += 1
        ch.failed |= not v.outcome.ok
        if not v.outcome.end.keeps_hold:  # the worker's _let_go
            for url in dr.pairing.spare_urls(self._source(ch)):
                self._d_apply(dr, dr.core.forget(url, ch.src, self.now, ch.group))
        # Every leg refused: the prefill keeps the blocks for another decode (the
        # docs' promise), and the client sends the request again, once.
        if ch.refused == ch.legs and not ch.retry and self.rng.random() < self.cfg.p_retry:
            ch.retry = True
            again = Child(f"{ch.rid}r", ch.src, ch.pserver, self.rng.randrange(len(self.dservers)),
                          ch.n, ch.k)  # fmt: skip
            again.declared, again.retry = ch.declared, True
            self.children += 1
            self.at(self.now + self.rng.uniform(0.001, 0.01), self._arrive,
                    self.dservers[again.server], again)  # fmt: skip
        if ch.finals == len(ds.ranks):  # finished_recving from every worker
            ok = not (ch.failed or ch.cancelled)
            self.at(self.now + (self.rng.uniform(0.0, 0.02) if ok else 0.0), self._finish, ch)

    def _finish(self, ch: Child) -> None:
        """The request is done: vLLM has its blocks back."""
        ds = self.dservers[ch.server]
        self.progress += 1
        self.check.handback(self, ch)
        for b in ch.blocks:
            del ds.owner[b]
            ds.free.append(b)
        ch.state = DONE
        del self.kids[ch.rid]
        g = ds.groups.get(ch.src)
        if g is not None:
            g.live.discard(ch.rid)
            if not g.waiting and not g.live:
                del ds.groups[ch.src]
        self._schedule(ds)
