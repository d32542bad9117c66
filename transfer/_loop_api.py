"""The engine loop's interface: the op it tracks (``EngineOp``), the peer
checks it asks for (``PeerCheck``) and what it needs of its backend (``Hooks``).

The loop itself is ``_poller``'s. Fields marked (loop) are read and written
by the loop thread only; other threads reach the loop through ``post`` (a
new op, or a cancel).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from .backend import TransferOp, TransferPlan
from .errors import TransferError

__all__ = ["EngineOp", "Hooks", "PeerCheck", "Poster"]


class Poster(Protocol):
    """Where an op goes to be taken up by the loop (``EngineLoop.post``)."""

    def post(self, op: EngineOp) -> None: ...


class EngineOp(TransferOp):
    """A TransferOp as the loop tracks it. Fields (loop) belong to the loop thread.

    Its done and quiesce callbacks run on the loop thread: they must be short
    and must not block (every transfer of the backend waits meanwhile).
    """

    __slots__ = (
        "_loop",
        "batch",
        "completed",
        "entry",
        "failure",
        "inflight",
        "stale_at",
        "started_at",
        "stopped",
    )

    _loop: Poster  # the EngineLoop that runs it
    batch: int  # (loop) next entry to hand over is plan.batches[batch][entry]
    entry: int  # (loop)
    inflight: int  # (loop) accepted, no final status yet: the engine may touch the buffers
    completed: int  # (loop) entries with status 1
    failure: str | None  # (loop) first engine failure; the op fails once the peer is judged
    started_at: float  # (loop) monotonic time the engine accepted its first entry; 0.0 before
    stale_at: float  # (loop) when to ask the peer why no final status came; 0.0 before start
    stopped: bool  # (loop) no further entries go to the engine

    def __init__(self, plan: TransferPlan, loop: Poster) -> None:
        super().__init__(plan)
        self._loop = loop
        self.batch = self.entry = self.inflight = self.completed = 0
        self.failure = None
        self.started_at = self.stale_at = 0.0
        self.stopped = False

    def cancel(self) -> None:
        super().cancel()
        self._loop.post(self)  # the loop resolves it and hands over nothing more

    @property
    def moved(self) -> bool:
        """Whether the engine accepted an entry: bytes may have reached the peer."""
        return self.started_at > 0.0


@dataclass(slots=True)
class PeerCheck:
    """One bounded liveness probe of a peer, run off the loop thread."""

    done: threading.Event = field(default_factory=threading.Event)
    alive: bool = False  # the verdict, final once done is set
    verdict: Any = None  # the backend's ProbeVerdict, for its errors
    rc: int | None = None


class Hooks(Protocol):
    """What the loop needs from its backend."""

    def needs_check(self, peer: str) -> bool:
        """Whether ``peer`` must be probed before entries go to it (new or dead)."""

    def start_check(self, peer: str, wake: Callable[[], None]) -> PeerCheck:
        """Probe ``peer`` on another thread; set ``done`` then call ``wake``."""

    def failed(self, op: EngineOp, check: PeerCheck) -> TransferError:
        """The error of ``op`` (failure or not) given the verdict on its peer."""

    def stopped(self, op: EngineOp) -> TransferError | None:
        """Why ``op`` must not hand over more entries (cancelled, closed), if so.
        Once the backend is closing it must answer for every op: ``stop`` only
        wakes the loop, this decides."""

    def retire(self, op: EngineOp) -> None:
        """``op`` is quiesced: forget it."""
