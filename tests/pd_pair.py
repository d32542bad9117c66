"""A prefill and a decode of the vLLM connector without vLLM: ``PrefillSender``
and ``DecodeReceiver`` over real ZeroMQ on loopback, bytes moved by an
in-process backend that can garble what it wrote (tests/test_pd_integrity.py,
tests/test_pd_hostile.py)."""

from __future__ import annotations

import time
from collections.abc import Callable

from kvguard.curve import ClientKeys, ServerKeys
from kvguard.vllm.decode_loads import DecodeReceiver, LoadOutcome
from kvguard.vllm.integrity import Verifier
from kvguard.vllm.prefill_pushes import PrefillSender
from kvguard.vllm.ranks import RankHeads
from transfer import KVCache, KVLayout, LocalBackend
from transfer.backend import TransferBackend, TransferOp
from transfer.peer_protocol import peer_message_of

SRC_LAYOUT = KVLayout(num_layers=2, num_blocks=16, block_bytes=256)
PEER = "decode:1"
Corrupt = Callable[[KVCache, list[int]], None]


class GarblingBackend(LocalBackend):
    """Copies every byte, then garbles the destination and reports success."""

    def __init__(self) -> None:
        super().__init__(workers=2)
        self.garble: tuple[KVCache, list[int], Corrupt] | None = None

    def _copy(self, op: TransferOp) -> None:
        super()._copy(op)
        if self.garble is not None:
            cache, blocks, corrupt = self.garble
            corrupt(cache, blocks)


def flip(cache: KVCache, blocks: list[int]) -> None:
    row = cache.rows(1)
    row[blocks[1], 77] = int(row[blocks[1], 77]) ^ 0x10


def stale(cache: KVCache, blocks: list[int]) -> None:
    for b in range(cache.layout.num_buffers):  # what the block held before: zeros here
        cache.rows(b)[blocks[-1]] = 0


def half(cache: KVCache, blocks: list[int]) -> None:
    n = cache.layout.block_bytes
    for b in range(cache.layout.num_buffers):
        cache.rows(b)[blocks[0], n // 2 :] = 0


class Pair:
    def __init__(
        self,
        *,
        verify: bool = True,
        dst_layout: KVLayout = SRC_LAYOUT,
        prefill_heads: RankHeads | None = None,
        decode_heads: tuple[int, int] = (0, 0),
        wrap: Callable[[LocalBackend], TransferBackend] = lambda b: b,
        server_keys: ServerKeys | None = None,
        client_keys: ClientKeys | None = None,
        sum_early: bool = True,
    ) -> None:
        """``wrap``: what the sender moves bytes with, around the backend;
        ``server_keys``, ``client_keys``: CURVE on the control channel."""
        self.src = KVCache(SRC_LAYOUT)
        self.src.fill_seeded(7)
        self.dst = KVCache(dst_layout)
        self.backend = GarblingBackend()
        self.backend.register_source(self.src)
        info = self.backend.register_peer(PEER, self.dst)
        self.sender = PrefillSender(
            wrap(self.backend),
            self.src,
            "tcp://127.0.0.1:0",
            heads=prefill_heads,
            head_major=prefill_heads is not None,
            curve=server_keys,
            sum_early=sum_early,
        )
        self.verifier = Verifier(self.dst) if verify else None
        self.receiver = DecodeReceiver(
            peer_message_of(info),
            heartbeat_s=0.2,
            heartbeat_timeout_s=0.6,
            heads=decode_heads,
            verify=self.verifier,
            curve=client_keys,
        )
        self.released: set[str] = set()
        self.outcomes: dict[str, LoadOutcome] = {}

    def load(
        self, rid: str, src: list[int], dst: list[int], part: tuple[int, int] | None = None
    ) -> LoadOutcome:
        """Hold ``src`` as ``rid``, load it into ``dst``: the load's outcome,
        once the prefill released the hold too."""
        self.sender.hold(rid, src, time.monotonic() + 10)
        self.receiver.expect(rid, self.sender.endpoint, rid, dst, time.monotonic() + 10, part=part)
        self.until(lambda: rid in self.outcomes and rid in self.released)
        return self.outcomes[rid]

    def poll(self) -> None:
        self.released |= self.sender.take_released()
        for out in self.receiver.take_finished():
            assert out.request_id not in self.outcomes, "reported twice"
            self.outcomes[out.request_id] = out

    def until(self, cond: Callable[[], bool], timeout: float = 10.0) -> None:
        """Poll until ``cond``; ``timeout`` is a hang guard, not a speed figure."""
        t0 = time.monotonic()
        while not cond():
            assert time.monotonic() - t0 < timeout, "condition not reached"
            time.sleep(0.002)
            self.poll()

    def close(self) -> None:
        self.receiver.close()
        self.sender.close(timeout=2.0)
        self.backend.close()
