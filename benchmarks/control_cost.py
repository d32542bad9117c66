"""What the vLLM connector's safety costs on its control path: CURVE and the digest.

Two halves of the connector (``PrefillSender``, ``DecodeReceiver``) over real
ZeroMQ on loopback, bytes moved by the in-process ``LocalBackend`` (so the
engine's time does not drown the control path's), one load after another:
hold, push, transfer, Result, report. Four variants, interleaved round by
round so that host load hits each alike:

* ``plain``: no keys, no digest;
* ``verify``: the default: the prefill digests what it writes, the decode
  checks it (``kvguard.vllm.integrity``);
* ``curve``: CURVE keys on the control channel (``kvguard.curve``), no digest;
* ``curve+verify``.

Reported per variant: loads per second and the median / p99 time of one
load, and the cost against ``plain`` in the same run. ``--block-bytes``
times ``--blocks`` times 2 x ``--layers`` buffers is the KV of one load. The
buffers lie in one allocation, as vLLM 0.32 lays out its layers
(``--per-buffer``: one allocation each, as ``KVCache`` makes them).

    python -m benchmarks.control_cost [--loads 200] [--rounds 5] [--blocks 16]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import structlog
import torch

from kvguard.curve import ClientKeys, ServerKeys, keygen
from kvguard.vllm.decode_loads import DecodeReceiver
from kvguard.vllm.integrity import Verifier
from kvguard.vllm.prefill_pushes import PrefillSender
from transfer import KVCache, KVLayout, LocalBackend
from transfer.peer_protocol import peer_message_of

__all__ = ["cache_for", "main"]

VARIANTS = ("plain", "verify", "curve", "curve+verify")


def cache_for(layout: KVLayout, per_buffer: bool) -> KVCache:
    """Zeroed buffers in one allocation, as vLLM 0.32 lays out its layers, or one each."""
    if per_buffer:
        return KVCache(layout)
    whole = torch.zeros(layout.num_buffers, layout.buffer_bytes, dtype=torch.uint8)
    return KVCache(layout, tensors=list(whole))  # its rows: one allocation


class _Pair:
    def __init__(self, layout: KVLayout, variant: str, keys: Path, per_buffer: bool) -> None:
        self.src = cache_for(layout, per_buffer)
        self.src.fill_seeded(1)
        self.dst = cache_for(layout, per_buffer)
        self.backend = LocalBackend(workers=2)
        self.backend.register_source(self.src)
        info = self.backend.register_peer("decode:1", self.dst)
        curve = variant.startswith("curve")
        server = ServerKeys.load(keys / "p.key_secret", keys / "allowed") if curve else None
        client = ClientKeys.load(keys / "d.key_secret", keys / "p.key") if curve else None
        verify = variant.endswith("verify")  # kvguard_verify, on both sides
        self.sender = PrefillSender(
            self.backend, self.src, "tcp://127.0.0.1:0", curve=server, sum_early=verify
        )
        self.receiver = DecodeReceiver(
            peer_message_of(info),
            verify=Verifier(self.dst) if verify else None,
            curve=client,
        )
        self.n = 0

    def load(self, blocks: list[int]) -> float:
        self.n += 1
        rid = f"r{self.n}"
        t0 = time.perf_counter()
        self.sender.hold(rid, blocks, time.monotonic() + 30)
        self.receiver.expect(rid, self.sender.endpoint, rid, blocks, time.monotonic() + 30)
        released: set[str] = set()
        done = False
        while not (done and rid in released):
            for out in self.receiver.take_finished():
                if not out.ok:
                    raise RuntimeError(f"load {rid} failed: {out.reason}: {out.detail}")
                done = True
            released |= self.sender.take_released()
            time.sleep(0.0002)
        return time.perf_counter() - t0

    def close(self) -> None:
        self.receiver.close()
        self.sender.close(timeout=2.0)
        self.backend.close()


def _keys(folder: Path) -> None:
    keygen(folder, "p")
    keygen(folder, "d")
    (folder / "allowed").mkdir()
    (folder / "allowed" / "d.key").write_bytes((folder / "d.key").read_bytes())


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.control_cost", description=__doc__)
    parser.add_argument("--loads", type=int, default=200, help="per variant and round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--blocks", type=int, default=16, help="blocks per load")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--block-bytes", type=int, default=8192)
    parser.add_argument("--per-buffer", action="store_true", help="an allocation per buffer")
    args = parser.parse_args(argv)
    # An application: it may quiet the library's per-transition records.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    layout = KVLayout(args.layers, max(64, 2 * args.blocks), args.block_bytes)
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    rates: dict[str, list[float]] = {v: [] for v in VARIANTS}
    with tempfile.TemporaryDirectory() as tmp:
        _keys(Path(tmp))
        pairs = {v: _Pair(layout, v, Path(tmp), args.per_buffer) for v in VARIANTS}
        try:
            blocks = list(range(args.blocks))
            for pair in pairs.values():  # warm: links up, handshakes done
                pair.load(blocks)
            for _ in range(args.rounds):
                for v, pair in pairs.items():
                    t0 = time.perf_counter()
                    times[v] += [pair.load(blocks) for _ in range(args.loads)]
                    rates[v].append(args.loads / (time.perf_counter() - t0))
        finally:
            for pair in pairs.values():
                pair.close()
    mb = args.blocks * layout.num_buffers * args.block_bytes / 1e6
    print(f"{args.rounds} rounds x {args.loads} loads of {mb:.1f} MB each, variants interleaved")
    print("| variant | loads/s (median of rounds) | load p50 ms | load p99 ms | p50 vs plain |")
    print("|---|---|---|---|---|")
    base = statistics.median(times["plain"])
    for v in VARIANTS:
        t = sorted(times[v])
        p50, p99 = statistics.median(t), t[min(len(t) - 1, int(0.99 * len(t)))]
        print(
            f"| {v} | {statistics.median(rates[v]):.0f} | {p50 * 1e3:.2f} | {p99 * 1e3:.2f} "
            f"| {100 * (p50 / base - 1):+.1f}% |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
