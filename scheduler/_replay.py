"""Reading a journal back: each line checked against the transition table,
each request's path replayed from INITIAL.

``read_journal`` skips (and reports, by line) what it cannot use: a line that
is not a record, a record of a transition the table does not have, a record
that does not continue its request's path. ``journal`` writes the format
(documented there) and re-exports everything public here.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from lifecycle import DISPATCH, INITIAL, TERMINAL, Event, FailureReason, TransferState

__all__ = [
    "EdgeKey",
    "JournalError",
    "JournalProblem",
    "JournalRecord",
    "Replay",
    "RequestTrace",
    "read_journal",
]

EdgeKey = tuple[TransferState, Event, TransferState]


class JournalProblem(NamedTuple):
    """A line that was skipped (or a record that breaks its request's path)."""

    line: int  # 1-based line number in the file
    message: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.message}"


class JournalError(Exception):
    """The journal cannot be used at all: missing, unreadable, or no record in it."""

    def __init__(self, message: str, problems: tuple[JournalProblem, ...] = ()) -> None:
        super().__init__(message)
        self.problems = problems  # why each line was unusable, when there were lines


class JournalRecord(NamedTuple):
    line: int
    request_id: str
    event: Event
    source: TransferState
    dest: TransferState
    reason: FailureReason | None
    attempt: int
    ts: float  # time.time() of the journal call
    ignored: bool  # a late event on a terminal request: source == dest, no transition


def _str(v: Any) -> str:
    if not isinstance(v, str) or not v:
        raise ValueError(f"expected a non-empty string, got {v!r}")
    return v


def _int(v: Any) -> int:
    if type(v) is not int or v < 0:
        raise ValueError(f"expected an integer >= 0, got {v!r}")
    return v


def _float(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise ValueError(f"expected a number, got {v!r}")
    return float(v)


def _state(v: Any) -> TransferState:
    try:
        return TransferState[_str(v)]
    except KeyError:
        raise ValueError(f"unknown state {v!r}") from None


def _event(v: Any) -> Event:
    try:
        return Event(_str(v))
    except ValueError:
        raise ValueError(f"unknown event {v!r}") from None


def _reason(v: Any) -> FailureReason | None:
    if v is None:
        return None
    try:
        return FailureReason[_str(v)]
    except KeyError:
        raise ValueError(f"unknown failure reason {v!r}") from None


# The keys every record has, and how each is read into a JournalRecord field.
_FIELDS: Mapping[str, Callable[[Any], Any]] = {
    "request_id": _str,
    "event": _event,
    "source": _state,
    "dest": _state,
    "reason": _reason,
    "attempt": _int,
    "ts": _float,
}


def _parse(line_no: int, text: str) -> JournalRecord:
    """One line -> a record that the table allows; ValueError says why not."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON at column {exc.colno}: {exc.msg.removesuffix(' at')}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    missing = [k for k in _FIELDS if k not in obj]
    if missing:
        raise ValueError(f"missing key(s) {', '.join(missing)}")
    fields: dict[str, Any] = {}
    for key, read in _FIELDS.items():
        try:
            fields[key] = read(obj[key])
        except ValueError as exc:
            raise ValueError(f"{key}: {exc}") from None
    rec = JournalRecord(line=line_no, ignored=obj.get("ignored", False) is True, **fields)
    if rec.ignored:
        # Terminal states absorb: only a terminal request ignores events, and it stays put.
        if rec.source not in TERMINAL or rec.dest is not rec.source:
            raise ValueError(
                f"an ignored {rec.event.value!r} must stay in a terminal state, "
                f"got {rec.source.name} -> {rec.dest.name}"
            )
    elif DISPATCH.get((rec.source, rec.event), (None, None))[0] is not rec.dest:
        raise ValueError(
            f"{rec.source.name} --{rec.event.value}--> {rec.dest.name} "
            "is not in the transition table"
        )
    return rec


def _path_order(
    records: Iterable[JournalRecord],
) -> tuple[list[JournalRecord], list[JournalRecord]]:
    """Arrange one request's transitions as its path from INITIAL.

    A lifecycle journals after releasing its lock, so two threads' records
    of one request (a worker's ``start`` and the watchdog's ``fail``) can
    reach the file swapped. The path is still unique: each next record
    leaves the current state at the current attempt (``start`` opens the
    next attempt). Records that do not continue it are returned apart:
    a line before them is missing.
    """
    left = list(records)
    path: list[JournalRecord] = []
    state, attempt = INITIAL, 0
    while left:
        rec = next(
            (
                r
                for r in left
                if r.source is state and r.attempt == attempt + (r.event is Event.START)
            ),
            None,
        )
        if rec is None:
            break
        left.remove(rec)
        path.append(rec)
        state, attempt = rec.dest, rec.attempt
    return path, left


@dataclass(frozen=True, slots=True)
class RequestTrace:
    """Everything the journal says about one request."""

    request_id: str
    path: tuple[JournalRecord, ...]  # transitions from INITIAL, in path order
    ignored: tuple[JournalRecord, ...]  # late events on the terminal request
    stray: tuple[JournalRecord, ...]  # transitions that do not continue `path`

    @property
    def state(self) -> TransferState:
        return self.path[-1].dest if self.path else INITIAL

    @property
    def is_terminal(self) -> bool:
        return self.state in TERMINAL

    @property
    def reason(self) -> FailureReason | None:
        return self.path[-1].reason if self.is_terminal else None

    @property
    def attempt(self) -> int:
        return self.path[-1].attempt if self.path else 0

    @property
    def first_ts(self) -> float:
        """Stands in for the submit time, which is not journaled."""
        return min(r.ts for r in (*self.path, *self.ignored, *self.stray))

    @property
    def last_ts(self) -> float:
        return max(r.ts for r in (*self.path, *self.ignored, *self.stray))

    @property
    def latency_s(self) -> float | None:
        """First record -> terminal record; None while not terminal."""
        return self.path[-1].ts - self.first_ts if self.is_terminal else None

    def timeline(self) -> list[JournalRecord]:
        """Every record, transitions in path order, late events after them."""
        return [*self.path, *sorted((*self.ignored, *self.stray), key=lambda r: r.ts)]


@dataclass(frozen=True, slots=True)
class Replay:
    """A journal file, read and replayed request by request."""

    path: Path
    requests: Mapping[str, RequestTrace]  # in order of first appearance
    problems: tuple[JournalProblem, ...]  # skipped lines and broken paths, by line
    records: int  # lines read as records

    def edge_counts(self) -> Counter[EdgeKey]:
        """How often each table edge was taken (late ignored events excluded)."""
        return Counter((r.source, r.event, r.dest) for t in self.requests.values() for r in t.path)

    def terminal_counts(self) -> Counter[TransferState]:
        return Counter(t.state for t in self.requests.values() if t.is_terminal)

    def non_terminal(self) -> list[RequestTrace]:
        """Requests that never reached a terminal state here, oldest first."""
        return sorted(
            (t for t in self.requests.values() if not t.is_terminal), key=lambda t: t.first_ts
        )

    @property
    def end_ts(self) -> float:
        return max((t.last_ts for t in self.requests.values()), default=0.0)


def read_journal(path: str | os.PathLike[str]) -> Replay:
    """Read every usable record; skip (and report) the lines that are not.

    Raises JournalError when the file cannot be read or holds no usable
    record; any other bad line is a JournalProblem with its line number.
    """
    path = Path(path)
    problems: list[JournalProblem] = []
    by_request: dict[str, list[JournalRecord]] = {}
    records = 0
    try:
        with path.open(encoding="utf-8", errors="replace") as f:
            for line_no, text in enumerate(f, 1):
                if not text.strip():
                    continue
                try:
                    rec = _parse(line_no, text)
                except ValueError as exc:
                    problems.append(JournalProblem(line_no, f"malformed record: {exc}"))
                    continue
                records += 1
                by_request.setdefault(rec.request_id, []).append(rec)
    except FileNotFoundError:
        raise JournalError(f"{path}: no such file") from None
    except OSError as exc:
        raise JournalError(f"{path}: cannot read: {exc.strerror or exc}") from None
    if not records:
        raise JournalError(
            f"{path}: no usable record"
            + (f" ({len(problems)} malformed lines)" if problems else " (empty file)"),
            tuple(problems),
        )
    requests: dict[str, RequestTrace] = {}
    for rid, recs in by_request.items():
        path_recs, stray = _path_order(r for r in recs if not r.ignored)
        for r in stray:
            problems.append(
                JournalProblem(
                    r.line,
                    f"request {rid!r}: {r.source.name} --{r.event.value}--> {r.dest.name} "
                    f"(attempt {r.attempt}) does not continue its path, which ends in "
                    f"{path_recs[-1].dest.name if path_recs else INITIAL.name}: "
                    "a record before it is missing",
                )
            )
        requests[rid] = RequestTrace(
            rid, tuple(path_recs), tuple(r for r in recs if r.ignored), tuple(stray)
        )
    problems.sort()
    return Replay(path, requests, tuple(problems), records)
