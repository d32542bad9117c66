"""The hand-off simulation's world, as data: its settings (``Config``) and
its records -- processes, sockets, connections, transfers, decode requests --
with the constants the world is timed by. ``handoff_net`` and
``handoff_world`` move them; ``handoff_sim`` checks them.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvguard.vllm.actions import LoadOutcome, Submit
from kvguard.vllm.decode_core import DecodeCore
from kvguard.vllm.decode_legs import DecodeLegs
from kvguard.vllm.prefill_core import PrefillCore
from kvguard.vllm.protocol import Abort, Push, Renew
from kvguard.vllm.ranks import Pairing, RankHeads
from kvguard.vllm.states import LoadEnd
from transfer import KVCache, KVLayout
from transfer.peer_protocol import PeerMessage, peer_message_of

HEADS, BLOCK_BYTES, COMPAT = 4, 256, "sim/4 heads"
NET_S = (0.0002, 0.002)  # one way, a message or a TCP segment
RECONNECT_S = 0.1  # ZeroMQ's reconnect interval
PROBE_TIMEOUT_S = 0.2
TURN_S = 1e-6  # a driver's next turn, at the soonest
STEP_S = (0.0005, 0.002)  # one engine step: vLLM's scheduler to its workers
RETRIED = (LoadEnd.REFUSED, LoadEnd.INCOMPATIBLE)  # loads a client sends again elsewhere
FAILS = (LoadEnd.TRANSFER_ERROR, LoadEnd.PEER_LOST, LoadEnd.TIMEOUT, LoadEnd.WORKER_CRASHED)
UP, FROZEN, DEAD = 0, 1, 2
QUEUED, LOADING, DONE = 0, 1, 2
_PEERS: dict[str, PeerMessage] = {}  # Mooncake session -> advertisement, made once


def peer_message(session: str) -> PeerMessage:
    if session not in _PEERS:
        layout = KVLayout(num_layers=2, num_blocks=64, block_bytes=BLOCK_BYTES, kv_split=False)
        _PEERS[session] = peer_message_of(KVCache(layout).peer_info(session))
    return _PEERS[session]


@dataclass(frozen=True)
class Config:
    prefills: tuple[int, ...] = (1, 2)  # tensor parallel size of each prefill server
    decodes: tuple[int, ...] = (1, 2)  # ... of each decode server
    heads: int = HEADS  # the model's KV heads (1: MLA's latent head, on every rank)
    requests: int = 500  # client requests, each a prefill request loaded by n decode requests
    rate: float = 150.0  # client requests per simulated second
    p_group: float = 0.3  # n > 1 ...
    max_n: int = 3
    p_declared: float = 0.9  # ... declared by the client (kvguard_loads)
    pool: int = 48  # decode blocks per server
    hold_blocks: int = 8  # a prefill request's blocks, at most
    deadline_s: float = 2.0
    hold_s: float = 1.5
    max_hold_s: float = 4.0
    hb_s: float = 0.5  # heartbeat timeout: the decode's stall_s
    margin_s: float = 0.05
    monitor_s: float = 0.005  # the receiver thread reads its monitor up to this late (the GIL)
    # The worker takes the receiver's releases up to this long after its
    # reports (one step's logging between): the receiver may add to both.
    take_gap_s: float = 0.01
    skew_s: float = 0.005  # wall clocks differ by up to this
    p_fail: float = 0.05  # a transfer fails ...
    p_hang: float = 0.02  # ... hangs past its deadline ...
    p_late: float = 0.03  # ... or writes late after it
    p_submit_fail: float = 0.02
    p_open_fail: float = 0.01
    p_connect_error: float = 0.01  # a connect fails locally (DNS, no fd): "retried"
    p_abort: float = 0.1  # the client gives a decode request up
    p_retry: float = 0.5  # ... or sends it again to a decode when the prefill refused its load
    p_prefix: float = 0.03  # a full local prefix hit: nothing to load
    crash: float = 0.02  # faults per prefill rank (partitions: per pair) per simulated second
    freeze: float = 0.05
    partition: float = 0.03
    # A long freeze, in heartbeat timeouts (ZeroMQ's handshake limit: 10 of them).
    max_freeze_hb: float = 30.0
    max_partition_s: float = 3.0
    max_down_s: float = 2.0


class PRank:
    """A prefill worker process (one tensor parallel rank)."""

    def __init__(self, uid: int, server: int, rank: int, tp: int) -> None:
        self.uid, self.server, self.rank, self.tp = uid, server, rank, tp
        self.url = f"tcp://10.0.1.{server}:{17600 + rank}"
        self.state, self.inc, self.freeze_no = UP, 0, 0
        self.since = 0.0  # frozen, or thawed, at
        self.core: PrefillCore | None = None
        self.deferred: list[tuple[Callable[..., None], tuple[Any, ...], object]] = []
        self.route: dict[bytes, Conn] = {}  # ROUTER: identity -> its latest connection
        self.conns: dict[Conn, None] = {}  # (ordered: the run replays exactly)
        self.xfers: dict[str, Xfer] = {}
        self.wake = float("inf")
        self.skew = 0.0

    def __repr__(self) -> str:
        return f"prefill{self.server}.{self.rank}#{self.inc}"


class DRank:
    """A decode worker process: its core and legs."""

    def __init__(self, server: int, rank: int, tp: int, cfg: Config, skew: float) -> None:
        self.server, self.rank, self.skew = server, rank, skew
        self.ident = f"d{server}.{rank}".encode()
        heads = RankHeads(rank, tp, cfg.heads)
        # The connector's own pairing: legs, their ids and each prefill rank's endpoint.
        self.pairing = Pairing(heads, head_major=True, block_bytes=BLOCK_BYTES)
        self.core = DecodeCore(
            peer_message(self.ident.decode()),
            stall_s=cfg.hb_s,
            margin_s=cfg.margin_s,
            compat=COMPAT,
            heads=(heads.first, heads.count),
        )
        self.legs = DecodeLegs()
        # The receiver thread's lists, until the worker's step takes them.
        self.finished: list[LoadOutcome] = []
        self.unfenced: list[str] = []
        self.taking = False  # a worker step is due to take them
        self.socks: dict[str, Sock] = {}
        self.wake = float("inf")

    def __repr__(self) -> str:
        return f"decode{self.server}.{self.rank}"


class Sock:
    """A decode's DEALER socket to one prefill endpoint (the core's ``gen``)."""

    __slots__ = ("conn", "dial0", "drank", "gen", "mon", "open", "outq", "url")

    def __init__(self, drank: DRank, url: str, gen: int, now: float) -> None:
        self.drank, self.url, self.gen, self.open = drank, url, gen, True
        self.outq: list[Push | Abort | Renew] = []  # its pipe, until a handshake
        self.conn: Conn | None = None
        self.mon = 0.0  # its monitor's events arrive in order
        self.dial0 = now

    def __repr__(self) -> str:
        return f"{self.drank}/{self.url[-7:]}/gen{self.gen}"


class Conn:
    """One TCP connection of a socket to one prefill incarnation."""

    __slots__ = ("closing", "d2p", "dead", "handed", "inc", "p2d", "prank", "sock", "up")

    def __init__(self, sock: Sock, prank: PRank) -> None:
        self.sock, self.prank, self.inc = sock, prank, prank.inc
        self.up = self.closing = self.dead = self.handed = False
        self.d2p = self.p2d = 0.0  # the last delivery time each way: FIFO

    def __repr__(self) -> str:
        return f"conn({self.sock}->{self.prank})"


class Xfer:
    __slots__ = ("dserver", "dst", "end", "hung", "load", "prank", "quiesce", "rid", "term")

    def __init__(self, prank: PRank, sub: Submit, dserver: int) -> None:
        self.prank, self.rid, self.load, self.dst = prank, sub.request_id, sub.load_id, sub.dst
        self.dserver = dserver
        self.end, self.term, self.quiesce, self.hung = LoadEnd.LOADED, 0.0, 0.0, False

    def __repr__(self) -> str:
        return f"xfer({self.load} {self.end.value} q={self.quiesce:.6f})"


class Child:
    """A decode request: one of the n loading prefill request ``src``."""

    __slots__ = (*("abort_at", "blocks", "cancelled", "deadline", "declared", "failed"),
                 *("finals", "group", "k", "legs", "n", "prefix", "pserver", "refused", "retry"),
                 "rid",
                 *("server", "src", "state"))  # fmt: skip

    def __init__(self, rid: str, src: str, pserver: int, server: int, n: int, k: int) -> None:
        self.rid, self.src, self.pserver, self.server, self.n, self.k = (
            rid,
            src,
            pserver,
            server,
            n,
            k,
        )
        self.declared = self.prefix = self.cancelled = self.failed = self.retry = False
        self.state, self.finals, self.deadline = QUEUED, 0, 0.0
        self.group = 1  # its group's size as its pushes told the prefill
        self.legs = self.refused = 0  # legs of all its workers; of which refused
        self.blocks: list[int] = []

    def __repr__(self) -> str:
        return self.rid


class Group:
    """The connector's ``_Group``: decode requests loading one prefill request."""

    __slots__ = ("declared", "left", "live", "pushed", "waiting")

    def __init__(self) -> None:
        self.waiting: set[str] = set()
        self.live: set[str] = set()
        self.pushed = self.declared = self.left = 0

    def size(self) -> int:
        return max(self.pushed + len(self.waiting), self.declared - self.left)


class DServer:
    def __init__(self, idx: int, tp: int, cfg: Config, rng: random.Random) -> None:
        self.idx, self.tp = idx, tp
        self.ranks = [
            DRank(idx, r, tp, cfg, rng.uniform(-cfg.skew_s, cfg.skew_s)) for r in range(tp)
        ]
        self.free = list(range(cfg.pool))
        self.owner: dict[int, str] = {}  # block -> the decode request vLLM gave it to
        self.queue: deque[Child] = deque()
        self.groups: dict[str, Group] = {}

    def __repr__(self) -> str:
        return f"decode{self.idx}"


class Part:
    __slots__ = ("since", "until")

    def __init__(self, since: float, until: float) -> None:
        self.since, self.until = since, until
