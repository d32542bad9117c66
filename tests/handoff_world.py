"""The hand-off simulation's world: prefill and decode processes, their
engines and vLLM, over ``handoff_net``'s network, on one simulated clock.

Everything real is the cores (``PrefillCore``, ``DecodeCore``, ``DecodeLegs``);
everything around them is modelled on what the deployment does:

* a prefill rank is a process: running, frozen (SIGSTOP: what reaches it
  waits in its kernel buffers and runs on thaw, its engine's pending writes
  land then) or dead (its state, writes and connections gone at once), and
  restarts as a fresh ``PrefillCore`` on the same endpoint; the engine tells
  each rank of a finished request one step after the client has it;
* a push becomes a kvguard transfer that writes the decode's blocks until it
  quiesces -- done, failed, hung past its deadline, or writing late after
  it -- and only then is the core told ``released``; an abort ends it once
  it quiesces; a submit may fail;
* a decode server is vLLM's scheduler (``handoff_vllm``): a block pool
  (blocks go back when every worker reported the request finished, and
  the request is done),
  requests queued for blocks (renewing their prefill's hold), n > 1 groups
  counted as the connector counts them (``_Group``, ``_not_loading``),
  full prefix hits and clients giving up (a forget, or a cancel while
  loading), load errors failing a request, and a client sending a refused
  request again; under it one ``DecodeCore`` and ``DecodeLegs`` per tensor
  parallel rank, with the connector's legs (``ranks.legs``); each engine
  step the worker takes what the receiver thread reported, and its
  releases a moment later, as ``worker.get_transfer_results`` does.

``handoff_sim`` owns the invariants (``Checker``) and runs worlds.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from handoff_model import (
    BLOCK_BYTES,
    COMPAT,
    FAILS,
    RETRIED,
    STEP_S,
    UP,
    Child,
    Config,
    Conn,
    DRank,
    PRank,
    Xfer,
)
from handoff_vllm import VLLM

from kvguard.vllm.actions import (
    AbortTransfer,
    Close,
    DecodeAction,
    LoadOutcome,
    Open,
    PrefillAction,
    Probe,
    Release,
    Reply,
    Report,
    Send,
    Submit,
    Unfence,
)
from kvguard.vllm.prefill_core import PrefillCore
from kvguard.vllm.protocol import Abort, Push, Renew
from kvguard.vllm.ranks import RankHeads
from kvguard.vllm.states import LoadEnd

if TYPE_CHECKING:
    from handoff_sim import Checker

__all__ = ["World"]


class World(VLLM):
    """Engines and vLLM over the network: a whole hand-off deployment."""

    def __init__(self, seed: int, cfg: Config, check: Checker) -> None:
        super().__init__(seed, cfg, check)
        self.made = self.children = self.loads = 0  # client requests, decode requests, loaded
        self.progress = 0  # decode requests handed back and holds released
        self.session = {dr.ident.decode(): ds.idx for ds in self.dservers for dr in ds.ranks}
        self.declared: dict[str, bool] = {}  # prefill request -> its n > 1 declared
        self.kids: dict[str, Child] = {}  # decode requests loading, by id
        self.at(0.0, self._client)
        self.start_faults()

    # -- prefill processes -----------------------------------------------------

    def _boot(self, pr: PRank) -> None:  # (Network's)
        cfg = self.cfg
        pr.inc += 1
        pr.state, pr.wake = UP, float("inf")
        pr.core = PrefillCore(
            compat=COMPAT,
            renew_s=cfg.hold_s,
            max_hold_s=cfg.max_hold_s,
            heads=RankHeads(pr.rank, pr.tp, cfg.heads),
            head_major=True,
            block_bytes=BLOCK_BYTES,
        )

    def _p_apply(self, pr: PRank, acts: list[PrefillAction]) -> None:
        for a in acts:
            if isinstance(a, Reply):
                c = pr.route.get(a.ident)
                if c is not None and not (c.dead or c.closing):
                    c.p2d = t = max(self.net(), c.p2d)
                    self.at(t, self._arrive_d, c, a.result)
                else:
                    self.seen["reply lost: no live route"] += 1
            elif isinstance(a, Submit):
                self._submit(pr, a)
            elif isinstance(a, AbortTransfer):
                self._abort_xfer(pr, a.transfer)
            elif isinstance(a, Release):
                self.progress += 1
                self.check.release(self, pr, a.request_id)
        assert pr.core is not None
        wake = pr.core.next_wake()
        if wake is not None and wake < pr.wake:
            pr.wake = wake
            self.pat(self.turn(wake), pr, self._p_step, pr, wake)

    def _p_step(self, pr: PRank, wake: float) -> None:
        if pr.wake == wake:
            pr.wake = float("inf")
        assert pr.core is not None
        self._p_apply(pr, pr.core.step(self.now))

    def _hold(self, pr: PRank, rid: str, n: int, deadline: float) -> None:
        assert pr.core is not None
        self.check.hold(self, pr, rid, deadline)
        self._p_apply(pr, pr.core.hold(rid, list(range(n)), deadline, self.now))

    def _p_receive(self, c: Conn, msg: Push | Abort | Renew) -> None:  # (Network's)
        pr = c.prank
        if c.handed or pr.inc != c.inc or pr.core is None:
            return  # ROUTER_HANDOVER: an old pipe's unread data is dropped
        if c.closing:
            self.seen["read from a closed socket's connection"] += 1
        self.check.message(self, pr, msg)
        self._p_apply(pr, pr.core.receive(c.sock.drank.ident, msg, self.now, self.now + pr.skew))

    def _submit(self, pr: PRank, sub: Submit) -> None:
        cfg, rng, now = self.cfg, self.rng, self.now
        self.check.submitted(pr, sub.request_id)
        if rng.random() < cfg.p_submit_fail:
            self.pat(now, pr, self._landed, pr, sub.request_id, sub.load_id, None)
            return
        x = Xfer(pr, sub, self.session[sub.peer.session_id])
        pr.xfers[sub.transfer] = x
        dur, d, r = rng.uniform(0.002, 0.03), sub.deadline_s, rng.random()
        if r < cfg.p_fail:
            x.term = x.quiesce = now + rng.uniform(0.0, min(dur, d))
            x.end = rng.choice(FAILS)
        elif r < cfg.p_fail + cfg.p_hang:  # an engine call stuck past the deadline
            x.hung, x.end, x.term = True, LoadEnd.TIMEOUT, now + d
            x.quiesce = now + d + rng.uniform(0.0, 3 * cfg.hb_s)
        elif r < cfg.p_fail + cfg.p_hang + cfg.p_late or dur > d:  # writes on past it
            x.end, x.term = LoadEnd.TIMEOUT, now + d
            x.quiesce = now + d + rng.uniform(0.0, cfg.hb_s)
        else:
            x.term = x.quiesce = now + dur
        for t in (rng.uniform(now, x.quiesce), x.quiesce):
            self.pat(t, pr, self._write, x, t)
        self.pat(x.quiesce, pr, self._quiesced, x, sub.transfer, x.quiesce)

    def _write(self, x: Xfer, t: float) -> None:
        if t <= x.quiesce:  # (an abort may have stopped it first)
            self.check.write(self, x)

    def _quiesced(self, x: Xfer, tid: str, t: float) -> None:
        if x.prank.xfers.get(tid) is x and x.quiesce == t:  # (not stopped earlier by an abort)
            del x.prank.xfers[tid]
            self._landed(x.prank, x.rid, x.load, x.end)

    def _landed(self, pr: PRank, rid: str, load: str, end: LoadEnd | None) -> None:
        assert pr.core is not None
        self.check.landed(pr, rid)
        if end is None:
            acts = pr.core.submit_failed(rid, load, "sim: submit failed", self.now)
        else:
            acts = pr.core.released(rid, load, end, "sim", self.now)
        self._p_apply(pr, acts)

    def _abort_xfer(self, pr: PRank, tid: str) -> None:
        x = pr.xfers.get(tid)
        if x is None or self.now >= x.term or x.end is LoadEnd.ABORTED:
            return  # terminal already: its release comes as it is
        self.seen["transfer aborted"] += 1
        x.end = LoadEnd.ABORTED
        if not x.hung:
            x.quiesce = min(x.quiesce, self.now + self.rng.uniform(0.0, 0.002))
            self.pat(x.quiesce, pr, self._quiesced, x, tid, x.quiesce)

    # -- decode processes ------------------------------------------------------

    def _d_apply(self, dr: DRank, acts: list[DecodeAction]) -> None:  # (Network's)
        for a in acts:
            if isinstance(a, Send):
                s = dr.socks.get(a.endpoint)
                if s is not None:
                    if s.conn is not None and s.conn.up:
                        self._d2p(s.conn, a.msg)
                    else:
                        s.outq.append(a.msg)
            elif isinstance(a, Report):
                out = a.outcome
                self.seen[f"load {'fenced ' if out.fenced else ''}{out.end.value}"] += 1
                if out.end in RETRIED and not out.fenced:
                    self.kids[out.request_id.split("#")[0]].refused += 1
                dr.finished.append(a.outcome)
                self._w_wake(dr)
            elif isinstance(a, Unfence):
                self.seen["load unfenced"] += 1
                dr.unfenced.append(a.request_id)
                self._w_wake(dr)
            elif isinstance(a, Open):
                self._open(dr, a)
            elif isinstance(a, Close):
                self._close(dr, a.endpoint)
            elif isinstance(a, Probe):
                self._probe(dr, a.endpoint)
        wake = dr.core.next_wake()
        if wake is not None and wake < dr.wake:
            dr.wake = wake
            self.at(self.turn(wake), self._d_step, dr, wake)

    def _w_wake(self, dr: DRank) -> None:
        if not dr.taking:
            dr.taking = True
            self.at(self.now + self.rng.uniform(*STEP_S), self._w_take, dr)

    def _w_take(self, dr: DRank) -> None:
        """The worker's step (``get_transfer_results``), every engine step
        while it loads: the receiver's reports, then its releases a moment
        later, each list taken whole."""
        outs, dr.finished = dr.finished, []
        self.at(self.now + self.rng.uniform(0.0, self.cfg.take_gap_s), self._w_taken, dr, outs)

    def _w_taken(self, dr: DRank, outs: list[LoadOutcome]) -> None:
        rids, dr.unfenced, dr.taking = dr.unfenced, [], False
        for out in outs:
            self._verdict(dr, dr.legs.reported(out))
        for rid in rids:
            self._verdict(dr, dr.legs.released(rid))
        if dr.legs.in_use() or dr.finished or dr.unfenced:  # vLLM steps while loads wait
            self._w_wake(dr)

    def _d_step(self, dr: DRank, wake: float) -> None:
        if dr.wake == wake:
            dr.wake = float("inf")
        self._d_apply(dr, dr.core.step(self.now))
