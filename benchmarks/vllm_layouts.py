"""Every KV cache layout vLLM resolves, moved by kvguard and by the raw engine on the same entries.

    .venv-vllm/bin/python -m benchmarks.vllm_layouts [--quick] [--json PATH]

For each of vLLM 0.32's six layouts (views by vLLM's own
``create_kv_cache_views``, ``tests.vllm.layout_peer``), MLA's latent head,
and the tensor parallel pairings the layout allows, one load of ``BLOCKS``
blocks goes from prefill ranks in this process (one engine) to a decode
rank in another process (its own engine): a run and scattered blocks, as a
fragmented pool hands them out. The legs' plans are the connector's
(``tests.layout_helpers.tp_plans``: ``ranks.legs``, ``ranks.block_slice``,
``build_plan``). Each rep moves the load through kvguard's
``MooncakeBackend`` and through the raw engine's
``batch_transfer_sync_write`` on the very same entries, interleaved
(``transfer_bench.compare``); the figures are medians. After the reps the
decode's bytes are checked equal to the prefill's, head for head.

The table is issue 30's: layout x pairing -> bytes equal, entries per load,
GB/s against the raw engine.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

from benchmarks.transfer_bench import compare, raw_write, through
from kvguard.vllm.kv_views import KVGeometry, describe
from kvguard.vllm.ranks import RankHeads
from tests.layout_helpers import LAYOUTS, tp_plans
from tests.vllm.layout_peer import Peer, head_digests, kernel_of, vllm_views
from transfer import KVCache
from transfer.mooncake import MooncakeBackend
from transfer.peer_protocol import peer_info_from_message

__all__ = ["Row", "main", "run"]

LAYERS, HEADS, HEAD_SIZE, MLA_HEAD_SIZE = 8, 8, 64, 576  # MLA: DeepSeek's 512 + 64
SRC_BLOCKS, DST_BLOCKS, BLOCKS = 96, 128, 64  # per rank; a load's blocks
PAIRS = [(1, 1), (2, 1), (1, 2), (2, 2)]
HEAD_RUN = ("LBHNC", "BHLNC")  # a rank's heads are one run of each unit: sizes may differ
PEER_BYTES = 64 << 20  # the decode child's buffer: the largest views above fit


@dataclass(frozen=True)
class Row:
    layout: str
    variant: str  # plain or mla
    prefill_tp: int
    decode_tp: int
    entries: int  # engine entries of one load on one decode rank, every leg
    load_bytes: int
    kvguard_gbps: float
    raw_gbps: float
    ratio: float  # median of per-rep kvguard / raw throughput
    refused: str = ""  # why the pairing cannot be done in this layout


def _blocks(seed: int) -> tuple[list[int], list[int]]:
    """A load: the prefill's first ``BLOCKS`` blocks into half a run, half scattered."""
    rng = random.Random(seed)
    run = list(range(8, 8 + BLOCKS // 2))
    rest = rng.sample([b for b in range(DST_BLOCKS) if b not in run], BLOCKS - len(run))
    return list(range(BLOCKS)), run + rest


@contextmanager
def _prefill(
    backend: MooncakeBackend, name: str, size: int, heads: int, head_size: int, mla: bool
) -> Iterator[list[tuple[KVGeometry, KVCache, list[Any]]]]:
    ranks = []
    try:
        for _ in range(size):
            raw, views = vllm_views(
                name, LAYERS, SRC_BLOCKS, max(1, heads // size), head_size=head_size, mla=mla
            )
            raw.random_(-128, 127)
            geo = describe(views, name, SRC_BLOCKS)
            cache = geo.cache()
            backend.register(cache)
            ranks.append((geo, cache, views))
        yield ranks
    finally:
        for _, cache, _ in ranks:
            backend.unregister(cache)


def _case(
    backend: MooncakeBackend, peer: Peer, name: str, variant: str, p: int, d: int, reps: int
) -> Row:
    mla = variant == "mla"
    heads, head_size = (1, MLA_HEAD_SIZE) if mla else (HEADS, HEAD_SIZE)
    me = RankHeads(d - 1, d, heads)  # the decode's last rank: its legs are the most varied
    src, dst = _blocks(p * 10 + d)
    with _prefill(backend, name, p, heads, head_size, mla) as ranks:
        views = {"name": name, "layers": LAYERS, "blocks": DST_BLOCKS, "heads": me.count}
        views.update(head_size=head_size, mla=mla)
        info = peer_info_from_message(
            bytes.fromhex(peer.ask({"op": "setup", "views": views})["peer"])
        )
        backend.add_peer(info)
        try:
            prefill = [(geo, cache) for geo, cache, _ in ranks]
            try:
                plans = [plan for _, plan in tp_plans(name, prefill, me, info, src, dst)]
            except ValueError as exc:
                return Row(name, variant, p, d, 0, 0, 0.0, 0.0, 0.0, str(exc))
            raws = [raw_write(backend, plan) for plan in plans]
            ours = [through(backend, plan) for plan in plans]
            t_raw, t_ours, ratio = compare(_legs(raws), _legs(ours), reps)
            _check(peer, ranks, me, src, dst, p)
        finally:
            backend.remove_peer(info.session_id)
    nbytes = sum(plan.nbytes for plan in plans)
    entries = sum(plan.num_entries for plan in plans)
    return Row(
        name, variant, p, d, entries, nbytes, nbytes / t_ours / 1e9, nbytes / t_raw / 1e9, ratio
    )


def _legs(moves: list[Callable[[], None]]) -> Callable[[], None]:
    """A load: its legs one after the other, as one rank's engine would."""

    def go() -> None:
        for move in moves:
            move()

    return go


def _check(
    peer: Peer,
    ranks: list[tuple[KVGeometry, KVCache, list[Any]]],
    me: RankHeads,
    src: list[int],
    dst: list[int],
    p_size: int,
) -> None:
    """The decode rank's bytes equal the prefill's, head for head, every layer."""
    got = peer.ask({"op": "heads", "blocks": dst})["heads"]
    for i, s in enumerate(src):
        for h in range(me.count):
            head = me.first + h
            p = me.rank % p_size if me.heads == 1 else (
                me.rank if p_size == me.size else head // (me.heads // p_size)
            )  # fmt: skip
            mine = RankHeads(p, p_size, me.heads)
            views = ranks[p][2]
            want = head_digests(views, [s], kernel_of(views, SRC_BLOCKS))[0]
            if got[i][h] != want[head - mine.first]:
                raise AssertionError(f"block {s} head {head}: the decode's bytes differ")


def run(quick: bool = False) -> list[Row]:
    reps = 3 if quick else 9
    rows = []
    with MooncakeBackend(transfer_timeout_s=5) as backend:
        peer = Peer(PEER_BYTES)
        try:
            for variant in ("plain", "mla"):
                for name in LAYOUTS:
                    for p, d in PAIRS:
                        row = _case(backend, peer, name, variant, p, d, reps)
                        rows.append(row)
                        print(_line(row), flush=True)
        finally:
            peer.stop()
    return rows


HEADER = (
    "| layout | variant | prefill TP -> decode TP | bytes equal | entries/load | MiB/load "
    "| kvguard GB/s | raw engine GB/s | kvguard / raw |\n|---|---|---|---|---|---|---|---|---|"
)


def _line(r: Row) -> str:
    pair = f"| {r.layout} | {r.variant} | {r.prefill_tp} -> {r.decode_tp} "
    if r.refused:
        return pair + "| refused | - | - | - | - | - |"
    return (
        pair + f"| yes | {r.entries} | {r.load_bytes / 2**20:.0f} | {r.kvguard_gbps:.2f} "
        f"| {r.raw_gbps:.2f} | {r.ratio:.2f} |"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="3 reps a case instead of 9")
    ap.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    args = ap.parse_args(argv)
    print(HEADER, flush=True)
    rows = run(args.quick)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
