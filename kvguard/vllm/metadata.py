"""What the connector's scheduler side tells its worker side, once per step.

vLLM carries one ``KVGuardMetadata`` from the engine core's scheduler
(``scheduler_side``) to every worker rank (``worker``), pickled, each step:

* ``holds`` (prefill): finished requests whose blocks wait for a decode;
* ``loads`` (decode): requests whose blocks were just allocated, to load;
* ``forgets``, ``renews`` (decode): prefill requests no request here will
  load, or that requests queued here still will (keep them held);
* ``cancels`` (decode): requests aborted while their load runs.

Deadlines are ``time.monotonic()``: the engine core and its workers share
one host.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from .params import Source

__all__ = ["ForgetMeta", "HoldMeta", "KVGuardMetadata", "LoadMeta", "Source"]


@dataclass(frozen=True, slots=True)
class HoldMeta:
    """Prefill: hold ``block_ids`` of ``request_id`` for a decode until ``deadline``."""

    request_id: str
    block_ids: list[int]
    deadline: float  # time.monotonic()


@dataclass(frozen=True, slots=True)
class LoadMeta:
    """Decode: load ``source``'s KV into ``block_ids`` of ``request_id`` by ``deadline``."""

    request_id: str  # the decode's own request (n > 1: one of the children)
    block_ids: list[int]
    source: Source
    deadline: float  # time.monotonic()
    group: int  # decode requests that load ``source``: the prefill holds it for all, >= 1


@dataclass(frozen=True, slots=True)
class ForgetMeta:
    """Decode: one request of ``source``'s group (``group`` requests as the
    client declared or this side counted) will never load it."""

    source: Source
    group: int  # >= 1: the prefill holds for the whole group, not just this forget


@dataclass
class KVGuardMetadata(KVConnectorMetadata):
    """Scheduler -> worker, once per step."""

    holds: list[HoldMeta] = field(default_factory=list)
    loads: list[LoadMeta] = field(default_factory=list)
    forgets: list[ForgetMeta] = field(default_factory=list)
    cancels: list[str] = field(default_factory=list)  # decode request ids
    renews: list[Source] = field(default_factory=list)

    def empty(self) -> bool:
        """Nothing for the workers to start or tell a prefill this step."""
        return not (self.holds or self.loads or self.forgets or self.cancels or self.renews)
