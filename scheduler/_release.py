"""Release after quiesce: quarantine in the core, the callback outside it.

A terminal request's blocks may still be read or written by an engine call
that has not returned (a timed-out transfer is not a cancelled one). The
core keeps such a request in ``ReleaseQuarantine`` until every op submitted
for it has quiesced, then hands it out exactly once. ``run_release`` runs
the user's release callback on the callback thread, re-checking both halves
of that rule (only after quiesce, exactly once) on its own evidence (the
ops' own quiesced flags, the table's record of who is being released): a
violation is counted in the metrics, and a second release is never
performed.
"""

from __future__ import annotations

import structlog

from ._requests import RequestRecord, RequestTable

__all__ = ["ReleaseChecks", "ReleaseQuarantine", "run_release"]

_log = structlog.get_logger("kvguard.scheduler")


class ReleaseQuarantine:
    """Terminal requests waiting for their ops to quiesce (core-owned)."""

    __slots__ = ("_held", "nbytes")

    _held: dict[RequestRecord, None]  # FINISHED requests not yet handed out, in terminal order
    nbytes: int  # sum of their plans' bytes

    def __init__(self) -> None:
        self._held = {}
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._held)

    def held(self) -> list[RequestRecord]:
        return list(self._held)

    def enter(self, req: RequestRecord) -> bool:
        """``req`` just became terminal: True if it may be released at once
        (the usual case: every op already quiesced); else it is held."""
        if self.ready(req):
            return True
        self._held[req] = None
        self.nbytes += req.plan.nbytes
        return False

    @staticmethod
    def ready(req: RequestRecord) -> bool:
        """May its blocks be given back? Only when no op can touch them."""
        return req.unquiesced == 0

    def take(self, req: RequestRecord) -> bool:
        """Hand ``req`` out if it is held and ready; True exactly once per request."""
        if req not in self._held or not self.ready(req):
            return False
        del self._held[req]
        self.nbytes -= req.plan.nbytes
        return True


class ReleaseChecks:
    """The release checks' counters, and who is being released right now.

    Used under the request table's lock (``run_release``, ``RequestTable.forget``).
    """

    __slots__ = ("before_quiesce", "double", "running")

    running: set[RequestRecord]  # release callbacks running, to tell a second release
    before_quiesce: int  # releases that found an op of the request not quiesced
    double: int  # releases of a request already released or not in the table

    def __init__(self) -> None:
        self.running = set()
        self.before_quiesce = 0
        self.double = 0

    def begin(self, req: RequestRecord, held: bool) -> bool:
        if req in self.running or not held:
            self.double += 1
            return False
        self.running.add(req)
        for op in req.ops:
            if not op.quiesced:
                self.before_quiesce += 1
                break
        return True


def run_release(req: RequestRecord, table: RequestTable, checks: ReleaseChecks) -> None:
    """Callback thread: the user's release callback, then the id is free again."""
    with table.lock:
        ok = checks.begin(req, table.holds(req))
    if not ok:
        _log.error("double_release", request_id=req.request_id)
        return
    try:
        fin = req.finished
        if req.release is not None and fin is not None:
            try:
                req.release(req.request_id, fin)
            except BaseException:
                _log.exception("release_callback_failed", request_id=req.request_id)
    finally:
        table.forget(req, checks.running)
