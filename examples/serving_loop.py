"""A step-based prefill serving loop that embeds the kvguard Scheduler.

Run it as is::

    python examples/serving_loop.py                      # in-process decode cache
    python examples/serving_loop.py --backend mooncake   # a real decode process

This is the shape of a prefill engine's scheduler step in vLLM or SGLang,
reduced to what touches KV transfers. The loop drives kvguard itself: the
scheduler is built with ``driver="external"``, and its sans-I/O core
advances only when the loop calls ``step()`` -- once per iteration, like
vLLM's ``get_finished()`` or xLLM's scheduler step. (``--driver thread``
runs the same loop with kvguard's own stepping thread instead.) Each step:

0. ``step()``: apply what happened since the last step (completions,
   quiescence, aborts), fire due deadlines and retries, start queued
   transfers. It returns how soon it wants the next step: a loop that would
   otherwise sleep longer (an idle engine) must come back by then;
1. ``poll()``: collect the transfers that ended since the last step (vLLM's
   ``get_finished()``) and retire their requests -- DONE ones go on to
   decode, FAILED ones would be re-prefilled or reported to the client;
2. admit the requests whose prefill just finished: allocate destination
   blocks on the decode side and ``submit()`` their KV blocks;
3. once, ``abort()`` a request, as when a client disconnects mid-transfer.

The one rule the loop must follow: destination blocks go back to the free
list only in the release callback. The scheduler calls it once per request,
after the request is terminal AND every engine call that touched its blocks
has returned -- a transfer that timed out may still be writing, and freeing
its blocks earlier would let the late write corrupt the next request.

Exit status 0 when every request ended terminal, every DONE request's blocks
arrived byte for byte, and nothing was released before the engine let go.
"""

from __future__ import annotations

import argparse
import logging
import random
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence

import structlog

from lifecycle import TransferState
from scheduler import Finished, RetryPolicy, Scheduler
from transfer import KVCache, KVLayout, LocalBackend, PeerInfo, TransferBackend

# The same geometry on both sides: 2 layers x K/V = 4 buffers of 1 MiB.
LAYOUT = KVLayout(num_layers=2, num_blocks=256, block_bytes=4096)


class BlockPool:
    """The decode side's free destination blocks. Thread-safe: the serving
    loop allocates, the scheduler's callback thread frees."""

    def __init__(self, num_blocks: int) -> None:
        self._lock = threading.Lock()
        self._free = list(range(num_blocks))

    def allocate(self, n: int, rng: random.Random) -> list[int] | None:
        with self._lock:
            if len(self._free) < n:
                return None  # no room: the request waits for a later step
            rng.shuffle(self._free)
            taken, self._free = self._free[:n], self._free[n:]
            return taken

    def free(self, blocks: Sequence[int]) -> None:
        with self._lock:
            self._free.extend(blocks)

    def __len__(self) -> int:
        with self._lock:
            return len(self._free)


class Decode:
    """Where the blocks go, and how to check that they arrived intact."""

    backend: TransferBackend
    peer: PeerInfo
    verify: Callable[[Sequence[int], Sequence[int]], bool]
    close: Callable[[], None]


def local_decode(src: KVCache) -> Decode:
    """Decode cache in this process; LocalBackend copies with torch."""
    dst = KVCache(LAYOUT)
    backend = LocalBackend(workers=2)
    backend.register_source(src)
    d = Decode()
    d.backend = backend
    d.peer = backend.register_peer("decode-0", dst)
    d.verify = lambda s, t: src.blocks_equal(dst, s, t) == []
    d.close = backend.close
    return d


def mooncake_decode(src: KVCache) -> Decode:
    """A decode process (``python -m kvguard.decode.service``) owning a KV cache
    registered with Mooncake; P2P handshake over TCP on 127.0.0.1."""
    from kvguard.decode.service import ReceiverProcess
    from transfer.mooncake import MooncakeBackend
    from transfer.peer_protocol import block_digests

    proc = ReceiverProcess(LAYOUT)
    proc.start()  # prints its PeerInfo (session id, registered regions) when ready
    try:
        # MC_TRANSFER_TIMEOUT=5 s (the engine's minimum): a call to a frozen
        # peer returns after 5 s, so quarantined blocks come back soon.
        backend = MooncakeBackend(transfer_timeout_s=5)
        backend.register(src)
    except BaseException:
        proc.close()
        raise

    def close() -> None:
        try:
            backend.close()
        finally:
            proc.close()  # kills and reaps the child by pid, frozen or not

    d = Decode()
    d.backend = backend
    d.peer = proc.peer
    # The receiver hashes its blocks; we hash our source blocks.
    d.verify = lambda s, t: proc.checksums(t) == block_digests(src, s)
    d.close = close
    return d


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="A step-based serving loop embedding kvguard.")
    ap.add_argument("--backend", choices=("local", "mooncake"), default="local")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--per-step", type=int, default=4, help="requests admitted per step")
    ap.add_argument("--blocks", type=int, default=8, help="KV blocks per request")
    ap.add_argument("--deadline", type=float, default=5.0, help="seconds per transfer")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--journal", action="store_true", help="print every state transition")
    ap.add_argument(
        "--driver",
        choices=("external", "thread"),
        default="external",
        help="external: this loop steps the scheduler; thread: kvguard's own thread does",
    )
    args = ap.parse_args(argv)
    # kvguard never configures logging; an application does. Its journal is one
    # structlog record per transition (debug), failures at warning level.
    level = logging.DEBUG if args.journal else logging.ERROR
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(level))
    rng = random.Random(args.seed)

    # The prefill side's KV cache, as the model's forward pass left it.
    src = KVCache(LAYOUT)
    src.fill_seeded(args.seed)
    decode = local_decode(src) if args.backend == "local" else mooncake_decode(src)
    pool = BlockPool(LAYOUT.num_blocks)
    blocks_of: dict[str, tuple[list[int], list[int]]] = {}  # request -> (src, dst) blocks
    integrity_errors: list[str] = []

    def release(request_id: str, fin: Finished) -> None:
        # The scheduler's callback thread: terminal, and no engine call touches the
        # blocks any more. Verify DONE transfers *before* the blocks can be
        # reused, then hand them back.
        srcs, dsts = blocks_of[request_id]
        if fin.state is TransferState.DONE and dsts and not decode.verify(srcs, dsts):
            integrity_errors.append(request_id)
        pool.free(dsts)

    sched = Scheduler(
        decode.backend,
        src,
        workers=args.workers,
        default_deadline_s=args.deadline,
        retry=RetryPolicy(max_attempts=3),
        release=release,
        driver=args.driver,
    )
    outcomes: dict[str, Finished] = {}
    submitted: list[str] = []
    abort_note = "no abort"
    t0 = time.monotonic()
    try:
        sched.add_peer(decode.peer)
        for step in range(args.steps):
            # 0. Advance kvguard's core: this is the only place it runs.
            if args.driver == "external":
                sched.step()

            # 1. Retire what finished since the last step.
            for fin in sched.poll():
                outcomes[fin.request_id] = fin

            # 2. Admit new requests: their prefill just produced KV blocks.
            for k in range(args.per_step):
                rid = f"req-{step}-{k}"
                if step == 1 and k == 0:
                    # A full prefix-cache hit: nothing to send, DONE at once.
                    srcs: list[int] = []
                    dsts: list[int] | None = []
                else:
                    srcs = rng.sample(range(LAYOUT.num_blocks), args.blocks)
                    dsts = pool.allocate(args.blocks, rng)
                if dsts is None:
                    continue  # decode side is full: retry the admission next step
                blocks_of[rid] = (srcs, dsts)
                # The first request of a step goes first (say, a short prompt).
                prio = 1 if k == 0 else 0
                sched.submit(rid, srcs, dsts, peer=decode.peer.session_id, priority=prio)
                submitted.append(rid)

            # 3. A client disconnects: abort its transfer. If the transfer has
            #    already ended, abort() is a no-op and says so.
            if step == 2:
                victim = submitted[-1]
                won = sched.abort(victim)
                abort_note = f"abort({victim}): {'ABORTED' if won else 'already finished'}"

            time.sleep(0.005)  # the model's forward pass for this step

        # Shut down gracefully: let in-flight transfers end (each has a deadline,
        # so this is bounded; with the external driver, drain() steps the core
        # itself while it waits), then collect the last outcomes.
        drained = sched.drain(timeout=args.deadline + 10.0)
        for fin in sched.poll():
            outcomes[fin.request_id] = fin
        metrics = sched.metrics()
    finally:
        sched.close()
        decode.close()

    wall = time.monotonic() - t0
    states = Counter(f.state.name for f in outcomes.values())
    reasons = Counter(f.reason.name for f in outcomes.values() if f.reason is not None)
    non_terminal = len(set(submitted) - set(outcomes))
    print(
        f"serving loop: backend={args.backend} steps={args.steps} requests={len(submitted)} "
        f"driver={args.driver}"
    )
    failed = ", ".join(f"{r} {n}" for r, n in sorted(reasons.items())) or "none"
    print(f"  done: {states['DONE']}  failed: {states['FAILED']} ({failed})")
    print(f"  {abort_note}")
    print(
        f"  integrity errors: {len(integrity_errors)}  "
        f"released before quiesce: {metrics.released_before_quiesce}  "
        f"non-terminal: {non_terminal}  blocks free: {len(pool)}/{LAYOUT.num_blocks}"
    )
    print(f"  wall: {wall:.2f}s  GB moved: {metrics.bytes_done / 1e9:.3f}")
    problems = []
    if not drained or non_terminal:
        problems.append(f"{non_terminal} request(s) not terminal")
    if integrity_errors:
        problems.append(f"integrity errors in {integrity_errors[:5]}")
    if metrics.released_before_quiesce or metrics.double_releases:
        problems.append("blocks released before quiesce")
    if len(pool) != LAYOUT.num_blocks:
        problems.append(f"{LAYOUT.num_blocks - len(pool)} destination blocks leaked")
    print("FAILED: " + "; ".join(problems) if problems else "OK")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
