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
each: a call per buffer, as before groups). Or, with ``--against REV``,
this tree's digest and the one at git revision REV, of the same cache in
one allocation. Each is timed alone and beside a thread running Python.
Reported: the median time of one digest and the torch calls it made.

    python -m benchmarks.digest_cost [--layers 11] [--blocks 54] [--block-bytes 47616]
    python -m benchmarks.digest_cost --against d855e0f
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import threading
import time
import types
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


Digest = Callable[[KVCache, Sequence[int]], bytes]


def _digest_at(rev: str) -> Digest:
    """``region_digest`` as ``transfer/checksum.py`` was at git revision ``rev``."""
    src = subprocess.run(
        ["git", "show", f"{rev}:transfer/checksum.py"], capture_output=True, text=True, check=True
    ).stdout
    module = types.ModuleType(f"transfer._checksum_at_{rev}")
    module.__package__ = "transfer"  # its ``from .cache import KVCache``
    exec(compile(src, f"{rev}:transfer/checksum.py", "exec"), module.__dict__)
    fn: Digest = module.region_digest
    return fn


def _variants(layout: KVLayout, against: str) -> dict[str, tuple[KVCache, Digest]]:
    """What is timed: this tree's digest of a cache in one allocation, and of
    one with an allocation per buffer; or, ``against`` a revision, this
    tree's and that revision's digest of the same cache in one allocation."""
    grouped = cache_for(layout, False)
    grouped.fill_seeded(1)
    if against:
        return {"this tree": (grouped, region_digest), against: (grouped, _digest_at(against))}
    apart = cache_for(layout, True)
    apart.fill_seeded(1)
    return {"grouped": (grouped, region_digest), "per buffer": (apart, region_digest)}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.digest_cost", description=__doc__)
    parser.add_argument("--layers", type=int, default=11, help="2 buffers (K, V) each")
    parser.add_argument("--blocks", type=int, default=54, help="blocks per load, one run")
    parser.add_argument("--block-bytes", type=int, default=47616, help="per buffer")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--digests", type=int, default=10, help="per variant, round and setting")
    parser.add_argument(
        "--against", default="", help="a git revision: its digest against this tree's"
    )
    args = parser.parse_args(argv)
    layout = KVLayout(args.layers, args.blocks + 8, args.block_bytes)
    variants = _variants(layout, args.against)
    blocks = list(range(4, 4 + args.blocks))
    first = {name: digest(c, blocks) for name, (c, digest) in variants.items()}
    if len(set(first.values())) != 1:
        raise SystemExit(f"the variants digest differently: {first}")
    calls = {}
    for name, (cache, digest) in variants.items():
        _Calls.count = 0
        with _Calls():
            digest(cache, blocks)
        calls[name] = _Calls.count
    times: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.rounds):
        for setting in ("alone", "beside a busy thread"):
            for name, (cache, digest) in variants.items():
                with _busy() if setting != "alone" else _nothing():
                    for _ in range(args.digests):
                        t0 = time.perf_counter()
                        digest(cache, blocks)
                        times.setdefault((name, setting), []).append(time.perf_counter() - t0)
    mb = layout.num_buffers * args.blocks * args.block_bytes / 1e6
    print(
        f"{mb:.1f} MB a load over {layout.num_buffers} buffers, {args.rounds} rounds x "
        f"{args.digests} digests, variants and settings interleaved"
    )
    print("| variant | torch calls | alone, ms p50 | beside a busy thread, ms p50 |")
    print("|---|---|---|---|")
    for name in variants:
        alone = statistics.median(times[name, "alone"]) * 1e3
        busy = statistics.median(times[name, "beside a busy thread"]) * 1e3
        print(f"| {name} | {calls[name]} | {alone:.1f} | {busy:.1f} |")
    return 0


@contextmanager
def _nothing() -> Iterator[None]:
    yield


if __name__ == "__main__":
    raise SystemExit(main())
