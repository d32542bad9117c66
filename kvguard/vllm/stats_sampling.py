"""The worker's side of kvguard's stats: each step's change, read from the sender or the legs.

The prefill's figures come from ``PrefillSender`` (its hold and push
counters) and its kvguard ``Scheduler`` (bytes, quarantine, the oldest live
transfer, each push's time); the decode's from its loads' outcomes as vLLM
hears of them (``DecodeLegs``). Counters go out as deltas, gauges when they
changed (``stats``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from lifecycle import TransferState
from scheduler import Finished
from transfer import KVLayout

from .actions import LoadOutcome
from .prefill_pushes import PrefillSender, SenderStats
from .stats import FAILED, KVGuardConnectorStats

__all__ = ["PrefillSample", "WorkerStats"]


class _Outcomes(Protocol):
    """A decode's loads as vLLM hears of them (``DecodeLegs``, ``DecodeReceiver``)."""

    def recent_outcomes(self) -> list[LoadOutcome]: ...


@dataclass(frozen=True, slots=True)
class PrefillSample:
    """One reading of the prefill side; counters cumulative since start."""

    stats: SenderStats
    bytes_done: int  # kvguard's bytes moved by pushes that ended done
    held_blocks: int
    quarantined_blocks: int
    oldest_live_s: float

    @classmethod
    def of(cls, sender: PrefillSender, block_bytes: int) -> PrefillSample:
        """Read ``sender``; ``block_bytes``: one block over every layer."""
        stats, held = sender.snapshot()
        m = sender.scheduler.metrics()
        return cls(
            stats, m.bytes_done, held, m.quarantined_bytes // block_bytes, m.oldest_live_age_s
        )


class WorkerStats:
    """The worker side: turns the sender's or receiver's state into per-step deltas.

    Not thread-safe: vLLM calls ``get_kv_connector_stats`` from the worker's
    step, one at a time.
    """

    def __init__(self, layout: KVLayout) -> None:
        self.block_bytes = layout.num_buffers * layout.block_bytes  # one block, every layer
        self._prefill: PrefillSample | None = None  # the last reading: counter baseline
        self._gauges: dict[str, int | float] | None = None  # the last gauges reported
        # Decode: loads without an outcome yet, id -> (blocks, first seen at).
        self._live: dict[str, tuple[int, float]] = {}
        self._fenced: set[str] = set()  # decode: failed fenced, blocks not yet back
        self._last: LoadOutcome | None = None  # the newest outcome already counted
        # Prefill: (outcome, seconds) of pushes kvguard ended; its callback
        # thread appends, the step drains (deque appends and pops are atomic).
        self._times: deque[tuple[str, float]] = deque()
        self._observed: PrefillSender | None = None

    def sample(
        self,
        sender: PrefillSender | None,
        receiver: _Outcomes | None,
        loads: Iterable[tuple[str, int]],
        in_use: Mapping[str, int],
        now: float,
    ) -> KVGuardConnectorStats | None:
        """This step's stats; the decode's ``loads`` and ``in_use`` as ``decode``'s."""
        if sender is not None:
            if self._observed is not sender:
                # From the first step on: a hold, hence a push, comes a step later.
                sender.scheduler.add_observer(self._on_finished)
                self._observed = sender
            # The reading first: a push's observer runs before its hold is
            # released, so a reading that shows the hold gone is followed
            # by a drain that holds the push's time.
            cur = PrefillSample.of(sender, self.block_bytes)
            times = [self._times.popleft() for _ in range(len(self._times))]
            return self.prefill(cur, times)
        if receiver is not None:
            return self.decode(loads, receiver.recent_outcomes(), in_use, now)
        return None

    def _on_finished(self, fin: Finished) -> None:
        self._times.append(("done" if fin.state is TransferState.DONE else FAILED, fin.latency_s))

    def prefill(
        self, cur: PrefillSample, times: Iterable[tuple[str, float]] = ()
    ) -> KVGuardConnectorStats | None:
        """The change since the last reading (the first is against zero);
        ``times``: (done or failed, seconds) of the pushes ended since."""
        last = self._prefill or PrefillSample(SenderStats(), 0, 0, 0, 0.0)
        self._prefill = cur
        out = KVGuardConnectorStats()
        a, b = last.stats, cur.stats
        counts = {
            "done": b.done - a.done,
            "expired": b.expired - a.expired,
            "aborted": b.aborted - a.aborted,
            "refused": b.refused - a.refused,
        }
        for outcome, n in counts.items():
            if n:
                out.data["transfers"][f"prefill/{outcome}/"] = n
        for reason, n in b.by_reason.items():  # reasons are LoadEnd values, never ""
            if grew := n - a.by_reason.get(reason, 0):
                out.data["transfers"][f"prefill/failed/{reason}"] = grew
        if cur.bytes_done != last.bytes_done:
            out.data["bytes"]["prefill"] = cur.bytes_done - last.bytes_done
        for outcome, seconds in times:
            out.data["seconds"].setdefault(f"prefill/{outcome}", []).append(max(0.0, seconds))
        gauges = {
            "held_blocks": cur.held_blocks,
            "quarantined_blocks": cur.quarantined_blocks,
            "oldest_live_load_seconds": cur.oldest_live_s,
        }
        return self._finish(out, gauges)

    def decode(
        self,
        loads: Iterable[tuple[str, int]],
        outcomes: Sequence[LoadOutcome],
        in_use: Mapping[str, int],
        now: float,
    ) -> KVGuardConnectorStats | None:
        """``loads``: the step's new loads (id, blocks). ``outcomes``: the
        receiver's recent outcomes, oldest first; those after the newest one
        already counted are new (more than it keeps between two steps would be
        undercounted). ``in_use``: the loads whose blocks vLLM has not got
        back (id, blocks): in flight, or failed fenced (the prefill may still
        write them)."""
        for rid, blocks in loads:
            self._live.setdefault(rid, (blocks, now))
        fresh: list[LoadOutcome] = []
        for o in reversed(outcomes):
            if o is self._last:
                break
            fresh.append(o)
        if outcomes:
            self._last = outcomes[-1]
        out = KVGuardConnectorStats()
        d = out.data
        for o in reversed(fresh):
            blocks, _ = self._live.pop(o.request_id, (0, now))
            if o.fenced:
                self._fenced.add(o.request_id)
            outcome = "loaded" if o.ok else FAILED
            key = f"decode/{outcome}/{o.reason}"  # "" for a load that loaded
            d["transfers"][key] = d["transfers"].get(key, 0) + 1
            d["seconds"].setdefault(f"decode/{outcome}", []).append(max(0.0, o.latency_s))
            if o.ok and blocks:
                d["bytes"]["decode"] = d["bytes"].get("decode", 0) + blocks * self.block_bytes
        # What vLLM got back is neither held nor quarantined any more.
        self._fenced &= in_use.keys()
        for rid in self._live.keys() - in_use.keys():
            del self._live[rid]
        oldest = max((now - t for _, t in self._live.values()), default=0.0)
        gauges = {
            "held_blocks": sum(n for rid, n in in_use.items() if rid not in self._fenced),
            "quarantined_blocks": sum(in_use[rid] for rid in self._fenced),
            "oldest_live_load_seconds": max(0.0, oldest),
        }
        return self._finish(out, gauges)

    def _finish(
        self, out: KVGuardConnectorStats, gauges: dict[str, int | float]
    ) -> KVGuardConnectorStats | None:
        # Gauges go out when they changed, so an idle step costs nothing and
        # the last step before idling still reports where they settled.
        if gauges != self._gauges:
            self._gauges = gauges
            out.data["gauges"] = dict(gauges)
        return None if out.is_empty() else out
