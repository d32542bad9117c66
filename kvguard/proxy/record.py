"""A proxied request's one log event: its outcome, each leg's URL, status and time.

The legs (``legs``) note what they did here as they go; the server emits
the event once, when the request ends, however it ends.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

import structlog

from .protocol import Served

__all__ = ["Record"]

log = structlog.get_logger("kvguard.proxy")


class Leg(Protocol):
    """A leg as the record names it (``legs.Leg``; a protocol, so the legs import this)."""

    @property
    def name(self) -> str: ...

    @property
    def url(self) -> str: ...


@dataclass
class Record:
    """What a request's one log event says: its outcome and each leg's URL, status, time."""

    request_id: str
    endpoint: str
    started: float = field(default_factory=time.monotonic)
    legs: dict[str, object] = field(default_factory=dict)
    served: Served | None = None  # how, once the prefill answered

    def left(self, allowed: float | None) -> float | None:
        """Seconds left of the ``allowed`` the client gave the request (None: no limit)."""
        return None if allowed is None else allowed - (time.monotonic() - self.started)

    @contextlib.contextmanager
    def leg(self, leg: Leg) -> Iterator[None]:
        self.legs[leg.name] = leg.url
        start = time.monotonic()
        try:
            yield
        finally:
            self.legs[f"{leg.name}_s"] = round(time.monotonic() - start, 6)

    def status(self, leg: Leg, status: int) -> None:
        self.legs[f"{leg.name}_status"] = status

    def emit(self, outcome: str, status: int | None, error: str | None = None) -> None:
        level = log.info if outcome in ("ok", "client_disconnected") else log.warning
        extra = {} if error is None else {"error": error}
        level(
            "proxy_request",
            request_id=self.request_id,
            endpoint=self.endpoint,
            outcome=outcome,
            status=status,
            total_s=round(time.monotonic() - self.started, 6),
            **({} if self.served is None else {"served": self.served.value}),
            **self.legs,
            **extra,
        )
