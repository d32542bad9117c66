"""Tensor parallel ranks: which KV heads each rank holds, who writes whose, and where.

With tensor parallelism every worker rank holds an equal, contiguous share
of every layer's KV heads (vLLM's split: rank r of size t holds heads
``[r * H / t, (r + 1) * H / t)``), registers its own memory and runs its own
Mooncake engine and kvguard control endpoint (base port + rank). A decode
rank loads from every prefill rank whose heads overlap its own: a *leg* per
such rank, each writing the overlap into the same decode blocks.

* equal sizes: decode rank r has one leg, to prefill rank r, whole blocks;
* prefill 2, decode 1: the decode rank has two legs, each a half of its blocks;
* prefill 1, decode 2: each decode rank has one leg to prefill rank 0, which
  is asked twice per request (``fan_in`` 2) and writes a half each time;
* one latent head (MLA), replicated on every rank: decode rank r has one
  leg, whole blocks from prefill rank ``r % prefill size``. A prefill larger
  than the decode holds the same blocks on ranks no decode rank loads from
  (its *spares*, ``spares``): once a load is over, decode rank r tells
  those congruent to it to let go rather than wait for the hold's deadline
  (vLLM frees a request's blocks once every rank reported it); after a
  refusal it does not (``LoadEnd.keeps_hold``).

``Pairing`` turns a decode load's ``Source`` (rank 0's endpoint, the
prefill's size) into its legs, each with its prefill rank's endpoint
(``rank_endpoint``: rank 0's port + rank).

A slice of a block is contiguous only where a rank's heads are one run of
every unit of a block (``kv_views``: heads outermost in it, vLLM's ``LBHNC``
and ``BHLNC`` layouts); other layouts pair equal sizes only, and a pairing
of other sizes is refused naming both sizes and the layout. A size that
does not divide the head count pairs equal sizes only (vLLM replicates
heads across the extra ranks).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvguard.decode.control import tcp_address, tcp_url
from transfer.plan import BlockSlice

from .params import Source

__all__ = [
    "BadEndpoint",
    "Leg",
    "LegAsk",
    "Pairing",
    "RankHeads",
    "block_slice",
    "legs",
    "rank_endpoint",
    "spares",
]


@dataclass(frozen=True)
class RankHeads:
    """Rank ``rank`` of ``size`` holding its share of ``heads`` KV heads."""

    rank: int  # 0 <= rank < size
    size: int  # the tensor parallel size, > 0
    heads: int  # KV heads of the model, all ranks together, > 0

    def __post_init__(self) -> None:
        if not (self.size > 0 and 0 <= self.rank < self.size and self.heads > 0):
            raise ValueError(f"no such rank: {self}")

    @property
    def splits(self) -> bool:
        """Whether ranks hold disjoint head ranges (else vLLM replicates heads)."""
        return self.heads % self.size == 0

    @property
    def first(self) -> int:
        return self.rank * self.heads // self.size if self.splits else 0

    @property
    def count(self) -> int:
        return self.heads // self.size if self.splits else self.heads


@dataclass(frozen=True)
class Leg:
    """One prefill rank's share of a decode rank's load, in heads.

    The prefill rank writes ``count`` heads from head ``src_head`` of its own
    blocks (relative to its first) to head ``dst_head`` of the decode rank's;
    ``fan_in`` decode ranks ask it for each request.
    """

    prefill_rank: int
    src_head: int
    dst_head: int
    count: int
    fan_in: int
    whole: bool  # the same heads on both ranks: whole blocks


def legs(decode: RankHeads, prefill_size: int, head_major: bool, layout: str = "") -> list[Leg]:
    """The legs of a load on ``decode`` from a prefill of ``prefill_size`` ranks
    (``layout``: the KV cache layout's name, for the error).

    Raises ValueError naming both sizes (and the layout) for a pairing that cannot work.
    """
    if prefill_size == decode.size:
        return [Leg(decode.rank, 0, 0, decode.count, 1, True)]
    if decode.heads == 1:  # one latent head (MLA), whole on every rank of both sides
        return [_latent_leg(decode, prefill_size)]
    prefill = [RankHeads(p, prefill_size, decode.heads) for p in range(prefill_size)]
    if not (decode.splits and prefill[0].splits):
        raise ValueError(
            f"prefill tensor parallel size {prefill_size} and decode size {decode.size} "
            f"differ, and one does not divide the {decode.heads} KV heads"
        )
    if not head_major:
        raise ValueError(
            f"prefill tensor parallel size {prefill_size} and decode size {decode.size} "
            "differ: that needs a rank's KV heads to be one run inside a block, and they are "
            f"not in the {layout or 'resolved'} KV cache layout (they are in LBHNC and BHLNC "
            "without kernel blocks)"
        )
    ranks = [RankHeads(d, decode.size, decode.heads) for d in range(decode.size)]
    out = []
    for p in prefill:
        lo, hi = _overlap(p, decode)
        if lo < hi:
            # Every decode rank overlapping p asks p for each request.
            fan_in = sum(a < b for a, b in (_overlap(p, d) for d in ranks))
            out.append(Leg(p.rank, lo - p.first, lo - decode.first, hi - lo, fan_in, False))
    return out


def _latent_leg(decode: RankHeads, prefill_size: int) -> Leg:
    """MLA: decode rank r loads whole blocks from prefill rank ``r % prefill_size``
    alone (no block written twice), which every decode rank congruent to it asks."""
    p = decode.rank % prefill_size
    return Leg(p, 0, 0, 1, len(range(p, decode.size, prefill_size)), True)


def spares(decode: RankHeads, prefill_size: int) -> list[int]:
    """The prefill ranks that hold a load's blocks but are never asked for
    them, which ``decode`` tells to let go: with one latent head (MLA), the
    ranks of a prefill larger than the decode from ``decode.size`` on, each
    told by the one decode rank congruent to it. None elsewhere: split heads
    pair every prefill rank with some decode rank, and replicated heads pair
    equal sizes only."""
    if decode.heads != 1 or prefill_size <= decode.size:
        return []
    return list(range(decode.rank + decode.size, prefill_size, decode.size))


def block_slice(
    mine: RankHeads | None, first: int, count: int, head_major: bool, block_bytes: int
) -> BlockSlice | None:
    """What a prefill rank holding ``mine`` writes of each block to a decode
    rank holding heads ``[first, first + count)``: whole blocks (None) where
    both hold the same heads (``count`` 0: whatever the prefill holds), else
    the slice with the heads both hold. ValueError names both ranges where
    there is none, or where a share of a block is not one run (heads not
    outermost in a block)."""
    if mine is None or count == 0 or (first, count) == (mine.first, mine.count):
        return None
    lo, hi = max(mine.first, first), min(mine.first + mine.count, first + count)
    if lo >= hi or not head_major:
        raise ValueError(
            f"the decode rank holds KV heads [{first}, {first + count}), this prefill "
            f"rank [{mine.first}, {mine.first + mine.count}): "
            + ("none in common" if lo >= hi else "a share of a block needs heads outermost")
        )
    unit = block_bytes // mine.count
    return BlockSlice((lo - mine.first) * unit, (lo - first) * unit, (hi - lo) * unit)


def _overlap(a: RankHeads, b: RankHeads) -> tuple[int, int]:
    return max(a.first, b.first), min(a.first + a.count, b.first + b.count)


def rank_endpoint(endpoint: str, rank: int) -> str:
    """Rank ``rank``'s control endpoint, ``tcp://HOST:PORT``: rank 0's is
    ``endpoint`` (``tcp://HOST:PORT`` or ``HOST:PORT``, parsed by
    ``kvguard.decode.control.tcp_address``), rank r's its port + r."""
    try:
        host, port = tcp_address(endpoint)
        if not 0 < port + rank < 65536:
            raise ValueError(port + rank)
    except ValueError:
        raise ValueError(f"not a tcp://host:port endpoint for rank {rank}: {endpoint!r}") from None
    return tcp_url(host, port + rank)


class BadEndpoint(ValueError):
    """No rank endpoint can be made of a prefill's (``rank_endpoint``)."""


@dataclass(frozen=True, slots=True)
class LegAsk:
    """One leg of a decode request's load, as the receiver asks it."""

    leg_id: str  # the request's own id for a lone leg, else request#rank.prefill_rank
    url: str  # the prefill rank's control endpoint
    fan_in: int  # decode ranks that ask this prefill rank for the same request
    part: tuple[int, int] | None  # (offset, length) of each block it writes; None: whole


class Pairing:
    """A decode rank against prefills of any tensor parallel size: the legs
    of each load and the prefill ranks' endpoints. The one place where a
    load's ``Source`` becomes ranks and addresses."""

    def __init__(
        self, me: RankHeads, head_major: bool, layout: str = "", block_bytes: int = 0
    ) -> None:
        self.me = me
        self.head_major = head_major
        self.layout = layout  # the KV cache layout's name, for errors
        self.block_bytes = block_bytes  # of this rank's blocks: where a leg's heads lie
        self._legs: dict[int, list[Leg] | ValueError] = {}  # prefill TP size -> legs, or why not

    def legs(self, source: Source) -> list[Leg]:
        """``source``'s legs on this rank; ValueError says why the sizes cannot pair."""
        if source.problem:
            raise ValueError(source.problem)
        size = source.tp_size
        if size not in self._legs:
            try:
                self._legs[size] = legs(self.me, size, self.head_major, self.layout)
            except ValueError as exc:
                self._legs[size] = exc
        got = self._legs[size]
        if isinstance(got, ValueError):
            raise got
        return got

    def asks(self, request_id: str, source: Source) -> list[LegAsk]:
        """The legs of ``request_id``'s load from ``source``: the request's
        own id when it has one leg that no other decode rank shares, else one
        id per leg (a prefill rank keeps one answer per load id).
        BadEndpoint when no rank endpoint can be made of ``source``'s,
        ValueError when the sizes cannot pair; either names why."""
        plan = self.legs(source)
        single = len(plan) == 1 and plan[0].fan_in == 1
        out = []
        for leg in plan:
            try:
                url = rank_endpoint(source.endpoint, leg.prefill_rank)
            except ValueError as exc:
                raise BadEndpoint(str(exc)) from None
            leg_id = request_id if single else f"{request_id}#{self.me.rank}.{leg.prefill_rank}"
            out.append(LegAsk(leg_id, url, leg.fan_in, self.part(leg)))
        return out

    def part(self, leg: Leg) -> tuple[int, int] | None:
        """(offset, length) of each of this rank's blocks that ``leg`` writes
        (the prefill's ``block_slice`` seen from here); None: whole blocks."""
        if leg.whole:
            return None
        unit = self.block_bytes // self.me.count
        return leg.dst_head * unit, leg.count * unit

    def urls(self, source: Source) -> list[str]:
        """The endpoints of the prefill ranks this rank loads ``source`` from
        (to renew it); see ``ranks_of``."""
        return [url for url, _ in self._loaded(source)]

    def spare_urls(self, source: Source) -> list[str]:
        """The endpoints of the prefill ranks that hold ``source`` and that
        this rank tells to let go, since no decode rank loads from them (``spares``)."""
        if source.problem:
            return []
        ends = (_endpoint(source, p) for p in spares(self.me, source.tp_size))
        return [url for url in ends if url is not None]

    def ranks_of(self, source: Source) -> list[tuple[str, int]]:
        """(endpoint, fan-in) of each prefill rank this rank tells that a
        request will never load ``source`` (a forget): those it would load
        from, and its spares (fan-in 1: no other decode rank tells them)."""
        return self._loaded(source) + [(url, 1) for url in self.spare_urls(source)]

    def _loaded(self, source: Source) -> list[tuple[str, int]]:
        """(endpoint, fan-in) of each prefill rank this rank loads ``source``
        from: none where the sizes cannot pair, and none for a rank whose
        endpoint cannot be made (its load failed naming it)."""
        try:
            plan = self.legs(source)
        except ValueError:
            return []
        ends = ((_endpoint(source, leg.prefill_rank), leg.fan_in) for leg in plan)
        return [(url, fan_in) for url, fan_in in ends if url is not None]


def _endpoint(source: Source, rank: int) -> str | None:
    try:
        return rank_endpoint(source.endpoint, rank)
    except ValueError:
        return None
