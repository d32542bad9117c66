"""Which backend a leg goes to: round-robin over those not known to be down.

A small deployment's proxy, not a router: each role's backends in turn, a
backend skipped while its last ``/health`` probe (every
``health_interval_s``, in the background) or its last connect failed, and
taken back once a probe answers 200. When every backend of a role is down
the rotation goes on as if none were: the leg's own error then says why.
``vllm-router`` does the rest (load-aware policies, circuit breakers,
retries of requests already sent): docs/vllm.md.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

import structlog

__all__ = ["Pool"]

log = structlog.get_logger("kvguard.proxy")


class _HasUrl(Protocol):
    @property
    def url(self) -> str: ...


L = TypeVar("L", bound=_HasUrl)


@dataclass
class Pool(Generic[L]):
    """One role's backends (``legs``) in round-robin order."""

    role: str
    legs: Sequence[L]
    down: dict[str, str] = field(default_factory=dict)  # url -> why, while down
    _cursor: itertools.cycle[int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._cursor = itertools.cycle(range(len(self.legs)))

    def pick(self, tried: Collection[str] = ()) -> L | None:
        """The next backend not in ``tried``, one that is up if any is; None
        once every one was tried."""
        fallback = None
        for _ in range(len(self.legs)):
            leg = self.legs[next(self._cursor)]
            if leg.url in tried:
                continue
            if leg.url not in self.down:
                return leg
            fallback = fallback or leg
        return fallback

    def mark(self, url: str, why: str | None) -> None:
        """``url`` is down for ``why``, or up (None); each change logged once."""
        was = self.down.get(url)
        if why is None and was is not None:
            del self.down[url]
            log.info("backend_up", role=self.role, url=url)
        elif why is not None and was is None:
            self.down[url] = why
            log.warning("backend_down", role=self.role, url=url, why=why)
