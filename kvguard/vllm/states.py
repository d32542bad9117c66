"""The hand-off's state machines, each a table, and every reason a load ends.

Five machines, each changed only through its table's ``move``
(``lifecycle.StateTable``, checked at import, drawn by ``kvguard diagram``):

prefill (``prefill_core``)
    ``HOLD``   a finished prefill request's blocks, held for its decodes
    ``PUSH``   one decode load of a held request, as the prefill serves it
decode (``decode_core``, ``decode_legs``)
    ``LOAD``   one leg's load, from the push until nothing of the prefill writes
    ``LINK``   the connection to one prefill endpoint
    ``REQUEST`` a decode request's load over its legs, until vLLM has it back

``LoadEnd`` names every way a load ends; it is mapped once from the wire
(``LoadEnd.of_result``) and from kvguard's ``FailureReason``
(``LoadEnd.of_failure``). Stats and logs read it.
"""

from __future__ import annotations

import enum
from typing import Final

from lifecycle import Edge, FailureReason, StateTable

__all__ = [
    "HOLD",
    "LINK",
    "LOAD",
    "PUSH",
    "REQUEST",
    "TABLES",
    "HoldEnd",
    "HoldState",
    "LinkEvent",
    "LinkState",
    "LoadEnd",
    "LoadState",
    "PushState",
    "RequestState",
]


class LoadEnd(enum.Enum):
    """How a load ended. The value is what the wire and the stats carry."""

    __hash__ = object.__hash__

    LOADED = "loaded"  # every byte landed and the prefill released the transfer
    # decode side
    TIMEOUT = "timeout"  # no verdict by the deadline (also kvguard's own TIMEOUT)
    PEER_LOST = "peer_lost"  # the prefill's link dropped or nothing listens there
    BAD_ENDPOINT = "bad_endpoint"  # the prefill's address is not tcp://HOST:PORT
    BAD_REQUEST = "bad_request"  # ids or sizes the protocol's bounds refuse
    INCOMPATIBLE = "incompatible"  # layouts or tensor parallel sizes cannot pair
    INTEGRITY = "integrity"  # the blocks' digest is not the one of what the prefill wrote
    DENIED = "denied"  # the prefill refused this decode's CURVE key: nothing was sent
    # prefill side, on the wire
    ABORTED = "aborted"  # the decode gave the load up (also kvguard's ABORTED)
    UNKNOWN_REQUEST = "unknown_request"  # not held there (expired, released, never)
    REFUSED = "refused"  # the prefill could not start the transfer
    TRANSFER_ERROR = "transfer_error"  # kvguard's FailureReason values from here on
    WORKER_CRASHED = "worker_crashed"
    WORKER_EXITED = "worker_exited"
    WORKER_DROPPED = "worker_dropped"
    INVALID_REQUEST = "invalid_request"
    SHUTDOWN = "shutdown"
    PREFILL_ERROR = "prefill_error"  # a reason this side does not know (detail has it)

    @property
    def ok(self) -> bool:
        return self is LoadEnd.LOADED

    @property
    def reason(self) -> str:
        """What stats label a failure with: "" for a load that loaded."""
        return "" if self is LoadEnd.LOADED else self.value

    @property
    def keeps_hold(self) -> bool:
        """A refusal before any transfer: the prefill (if it heard the push
        at all) keeps the request held for another decode, which the client
        may send it to. Any other end settled this load's share of the hold."""
        return self in _KEEPS_HOLD

    @classmethod
    def of_result(cls, ok: bool, reason: str) -> LoadEnd:
        """A prefill's ``Result`` (untrusted): LOADED only when ``ok``; a
        reason this side does not know is PREFILL_ERROR, never a success."""
        if ok:
            return cls.LOADED
        end = _BY_VALUE.get(reason, cls.PREFILL_ERROR)
        return cls.PREFILL_ERROR if end is cls.LOADED else end

    @classmethod
    def of_failure(cls, reason: FailureReason | None) -> LoadEnd:
        """kvguard's transfer ended FAILED with ``reason`` (None: DONE)."""
        return cls.LOADED if reason is None else _BY_FAILURE[reason]


_BY_VALUE: Final = {e.value: e for e in LoadEnd}
_KEEPS_HOLD: Final = frozenset(
    {
        LoadEnd.REFUSED,
        LoadEnd.INCOMPATIBLE,
        LoadEnd.BAD_REQUEST,
        LoadEnd.BAD_ENDPOINT,
        LoadEnd.DENIED,
    }
)
_BY_FAILURE: Final = {r: LoadEnd(r.value) for r in FailureReason}  # each has its member


# -- the prefill ---------------------------------------------------------------


class HoldState(enum.IntEnum):
    """A prefill request's blocks, from the engine's hold to their release."""

    HELD = 0  # waiting for its decodes' pushes; no transfer in flight
    LOADING = 1  # one or more transfers in flight into decode blocks
    RELEASED = 2  # handed back to the engine (take_released): nothing touches them


class HoldEnd(enum.Enum):
    """Why a hold was released (answers a push that comes after)."""

    DONE = "done"  # its last load loaded
    FAILED = "failed"  # its last load failed or was refused
    ABORTED = "aborted"  # its decodes gave it up
    EXPIRED = "expired"  # its deadline passed with nothing in flight


HOLD: Final = StateTable(
    "hold",
    "Prefill: a held request",
    HoldState,
    [
        Edge(HoldState.HELD, "push started", HoldState.LOADING),
        Edge(HoldState.LOADING, "last load over, group not settled", HoldState.HELD),
        Edge(HoldState.HELD, "group settled | deadline", HoldState.RELEASED),
        Edge(HoldState.LOADING, "last load over: group settled | deadline", HoldState.RELEASED),
    ],
    HoldState.HELD,
    [HoldState.RELEASED],
)


class PushState(enum.IntEnum):
    """One decode load (request id, load id) as the prefill serves it."""

    NEW = 0  # named by a message, nothing decided yet
    EARLY = 1  # the push came before the engine's hold: waits for it, briefly
    IN_FLIGHT = 2  # a kvguard transfer writes its blocks; only its release ends it
    SETTLED = 3  # answered (loaded, failed, aborted): counts for the group
    REFUSED = 4  # answered without a transfer; settles nothing (another may ask)


PUSH: Final = StateTable(
    "push",
    "Prefill: one load of a held request",
    PushState,
    [
        Edge(PushState.NEW, "push before the hold", PushState.EARLY),
        Edge(PushState.NEW, "push", PushState.IN_FLIGHT),
        Edge(PushState.NEW, "push refused", PushState.REFUSED),
        Edge(PushState.NEW, "abort", PushState.SETTLED),
        Edge(PushState.EARLY, "hold", PushState.IN_FLIGHT),
        Edge(PushState.EARLY, "hold, push refused", PushState.REFUSED),
        Edge(PushState.EARLY, "abort | no hold in time", PushState.SETTLED),
        Edge(PushState.IN_FLIGHT, "released", PushState.SETTLED),
        Edge(PushState.IN_FLIGHT, "submit failed", PushState.REFUSED),
    ],
    PushState.NEW,
    [PushState.SETTLED, PushState.REFUSED],
)


# -- the decode ----------------------------------------------------------------


class LoadState(enum.IntEnum):
    """One leg's load on the decode, from its push to the prefill's last word."""

    ASKED = 0  # pushed (or queued on its link); nothing reported yet
    FENCED = 1  # reported failed, but the prefill may still write: verdict awaited
    CANCELLED = 2  # the engine gave it up first: reported once the verdict comes
    OVER = 3  # the verdict, or proof the prefill is gone: nothing writes its blocks


LOAD: Final = StateTable(
    "load",
    "Decode: one leg's load",
    LoadState,
    [
        Edge(LoadState.ASKED, "deadline | link lost", LoadState.FENCED),
        Edge(LoadState.ASKED, "cancel", LoadState.CANCELLED),
        Edge(LoadState.ASKED, "result | proof", LoadState.OVER),
        Edge(LoadState.FENCED, "result | proof", LoadState.OVER),
        Edge(LoadState.CANCELLED, "result | proof", LoadState.OVER),
    ],
    LoadState.ASKED,
    [LoadState.OVER],
)


class LinkState(enum.IntEnum):
    """The decode's connection to one prefill endpoint (one DEALER at a time)."""

    DIALING = 0  # never up: a drop or refusal proves nothing was delivered
    REDIALING = 1  # remade after a stall: the old socket may have delivered
    UP = 2  # handshake done, no drop since
    LOST = 3  # dropped since its handshake: what we asked may be lost; probed
    CLOSED = 4  # closed with whatever it queued


class LinkEvent(enum.Enum):
    """What a link's socket monitor reports (the driver maps ZeroMQ's events)."""

    HANDSHAKE = "handshake done"
    DROPPED = "connection dropped"
    REFUSED = "connection refused"
    CLOSED = "connection refused or closed"
    # Noted for a stalled link's log; they change nothing (TCP only: no
    # message flows before the handshake).
    CONNECTED = "connected"
    CONNECTING = "connecting"
    HANDSHAKE_FAILED = "handshake failed"
    HANDSHAKE_FAILED_PROTOCOL = "handshake failed (protocol)"
    DENIED = "handshake denied: this decode's CURVE key is not allowed there"

    @property
    def acted_on(self) -> bool:
        return self in _ACTED_ON


_ACTED_ON: Final = frozenset(
    {LinkEvent.HANDSHAKE, LinkEvent.DROPPED, LinkEvent.REFUSED, LinkEvent.CLOSED, LinkEvent.DENIED}
)


LINK: Final = StateTable(
    "link",
    "Decode: the link to a prefill",
    LinkState,
    [
        Edge(LinkState.DIALING, "handshake", LinkState.UP),
        Edge(LinkState.DIALING, "refused | dropped | denied | dial failed", LinkState.CLOSED),
        Edge(LinkState.DIALING, "stalled", LinkState.REDIALING),
        Edge(LinkState.DIALING, "idle | proof", LinkState.CLOSED),
        Edge(LinkState.REDIALING, "handshake", LinkState.UP),
        Edge(LinkState.REDIALING, "refused | dropped", LinkState.LOST),
        Edge(LinkState.REDIALING, "stalled", LinkState.REDIALING),
        Edge(LinkState.REDIALING, "idle | proof", LinkState.CLOSED),
        Edge(LinkState.UP, "dropped", LinkState.LOST),
        Edge(LinkState.UP, "idle | proof", LinkState.CLOSED),
        Edge(LinkState.LOST, "handshake", LinkState.UP),
        Edge(LinkState.LOST, "stalled", LinkState.LOST),
        Edge(LinkState.LOST, "idle | probe refused | proof", LinkState.CLOSED),
    ],
    LinkState.DIALING,
    [LinkState.CLOSED],
)


class RequestState(enum.IntEnum):
    """A decode request's load over its legs, until vLLM has its blocks back."""

    LOADING = 0  # legs pending; nothing told to vLLM
    INVALID = 1  # a leg failed while others run or are fenced: blocks told as load errors
    FINISHED = 2  # every leg over and none writes: finished_recving (failed or not)


REQUEST: Final = StateTable(
    "request",
    "Decode: a request's load over its legs",
    RequestState,
    [
        Edge(RequestState.LOADING, "a leg failed, others may write", RequestState.INVALID),
        Edge(RequestState.LOADING, "every leg over", RequestState.FINISHED),
        Edge(RequestState.INVALID, "every leg over", RequestState.FINISHED),
    ],
    RequestState.LOADING,
    [RequestState.FINISHED],
)

# Every hand-off machine, in the order the docs show them.
TABLES: Final = (HOLD, PUSH, LOAD, LINK, REQUEST)
