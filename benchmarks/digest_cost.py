"""What one load's digest costs where it runs: beside a thread that wants the GIL.

``transfer.checksum.region_digest`` reads a load's blocks in every buffer with
torch calls; each call releases the GIL and must take it back, which beside a
busy Python thread (vLLM's worker between steps, the connector's own
threads) can wait for the interpreter's switch interval (5 ms). vLLM 0.32
lays every layer out in one allocation a constant stride apart, and the
digest reads such buffers as one group, a torch call per block run, not
per buffer and run (``KVCache.groups``).

Two caches of the same layout, digested alternately round by round:
``grouped`` (one allocation, as vLLM's) and ``per buffer`` (an allocation
each: a call per buffer, as before groups). Each is timed alone and beside
a thread running Python. Reported: the median time of one digest and the
torch calls it made.

    python -m benchmarks.digest_cost [--layers 11] [--blocks 54] [--block-bytes 47616]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from torch.overrides import TorchFunctionMode

from benchmarks.control_cost import cache_for
from transfer import KVCache, KVLayout
from transfer.checksum import region_digest

__all__ = ["main"]


class _Calls(TorchFunctionMode):
    count = 0

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        _Calls.count += 1
        return func(*args, **(kwargs or {}))


@contextmanager
def _busy() -> Iterator[None]:
    """A thread running Python (and so asking for the GIL) meanwhile."""
    stop = threading.Event()

    def spin() -> None:
        n = 0
        while not stop.is_set():
            n += 1

    thread = threading.Thread(target=spin, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def _caches(layout: KVLayout) -> dict[str, KVCache]:
    out = {"grouped": cache_for(layout, False), "per buffer": cache_for(layout, True)}
    for cache in out.values():
        cache.fill_seeded(1)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.digest_cost", description=__doc__)
    parser.add_argument("--layers", type=int, default=11, help="2 buffers (K, V) each")
    parser.add_argument("--blocks", type=int, default=54, help="blocks per load, one run")
    parser.add_argument("--block-bytes", type=int, default=47616, help="per buffer")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--digests", type=int, default=10, help="per cache, round and setting")
    args = parser.parse_args(argv)
    layout = KVLayout(args.layers, args.blocks + 8, args.block_bytes)
    caches = _caches(layout)
    blocks = list(range(4, 4 + args.blocks))
    first = {name: region_digest(c, blocks) for name, c in caches.items()}
    if len(set(first.values())) != 1:
        raise SystemExit(f"the caches digest differently: {first}")
    calls = {}
    for name, cache in caches.items():
        _Calls.count = 0
        with _Calls():
            region_digest(cache, blocks)
        calls[name] = _Calls.count
    times: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.rounds):
        for setting in ("alone", "beside a busy thread"):
            for name, cache in caches.items():
                with _busy() if setting != "alone" else _nothing():
                    for _ in range(args.digests):
                        t0 = time.perf_counter()
                        region_digest(cache, blocks)
                        times.setdefault((name, setting), []).append(time.perf_counter() - t0)
    mb = layout.num_buffers * args.blocks * args.block_bytes / 1e6
    print(
        f"{mb:.1f} MB a load over {layout.num_buffers} buffers, {args.rounds} rounds x "
        f"{args.digests} digests, caches and settings interleaved"
    )
    print("| cache | torch calls | alone, ms p50 | beside a busy thread, ms p50 |")
    print("|---|---|---|---|")
    for name in caches:
        alone = statistics.median(times[name, "alone"]) * 1e3
        busy = statistics.median(times[name, "beside a busy thread"]) * 1e3
        print(f"| {name} | {calls[name]} | {alone:.1f} | {busy:.1f} |")
    return 0


@contextmanager
def _nothing() -> Iterator[None]:
    yield


if __name__ == "__main__":
    raise SystemExit(main())
