"""The prefill's records: a held request and each load of it.

``states.HOLD`` and ``states.PUSH`` govern their ``state`` fields; only
``prefill_core.PrefillCore`` changes them. Each field's invariant is written
next to it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from .protocol import Push
from .states import HoldState, PushState

__all__ = ["Bounded", "EarlyPushes", "Hold", "PushRecord"]

K = TypeVar("K")
V = TypeVar("V")


@dataclass(slots=True)
class PushRecord:
    """One load of a request, as this side serves it (``states.PUSH``)."""

    request_id: str
    load_id: str
    ident: bytes  # the decode's ROUTER identity, for the Result
    push: Push | None  # None: named by an Abort only
    state: PushState = PushState.NEW
    until: float = 0.0  # EARLY: the latest its hold may come (monotonic)
    expires: float = 0.0  # EARLY: the push's own expiry, on the monotonic clock
    transfer: str = ""  # IN_FLIGHT: the kvguard request id
    peer: str = ""  # IN_FLIGHT: the decode's Mooncake session


@dataclass(slots=True)
class Hold:
    """A held request (``states.HOLD``). Its group settles when
    ``settled + forgotten >= group``: each decode request loads at most once."""

    request_id: str
    blocks: list[int]
    deadline: float  # monotonic; the hold ends then unless a load is in flight
    last: float  # the latest a renewal may push ``deadline`` to
    state: HoldState = HoldState.HELD
    pushes: dict[str, PushRecord] = field(default_factory=dict)  # load id -> record, every state
    in_flight: int = 0  # pushes IN_FLIGHT; LOADING iff > 0
    settled: int = 0  # pushes SETTLED
    forgotten: int = 0  # decode requests of the group that will never push
    group: int = 1  # the group's size: the largest a push said

    def group_settled(self) -> bool:
        return self.settled + self.forgotten >= self.group


class Bounded(OrderedDict[K, V], Generic[K, V]):
    """A memory of the last ``limit`` keys set (the oldest forgotten first):
    what a prefill remembers of requests it no longer (or not yet) holds."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit

    def __setitem__(self, key: K, value: V) -> None:
        super().__setitem__(key, value)
        while len(self) > self.limit:
            self.popitem(last=False)


class EarlyPushes:
    """Pushes read before the engine's hold of their request (EARLY), by
    request then load: the hold starts them, or their wait ends."""

    __slots__ = ("_by_request", "count")

    def __init__(self) -> None:
        self._by_request: dict[str, dict[str, PushRecord]] = {}
        self.count = 0  # records held, all requests together

    def get(self, rid: str, load_id: str) -> PushRecord | None:
        return self._by_request.get(rid, {}).get(load_id)

    def add(self, rec: PushRecord) -> None:
        self._by_request.setdefault(rec.request_id, {})[rec.load_id] = rec
        self.count += 1

    def take(self, rec: PushRecord) -> None:
        waiting = self._by_request[rec.request_id]
        del waiting[rec.load_id]
        if not waiting:
            del self._by_request[rec.request_id]
        self.count -= 1

    def take_request(self, rid: str) -> list[PushRecord]:
        """Every EARLY push of ``rid``, taken out (its hold came)."""
        recs = list(self._by_request.pop(rid, {}).values())
        self.count -= len(recs)
        return recs
