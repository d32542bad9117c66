"""The journal on disk: transition records as JSON lines, written and replayed.

One module is the file format's public home, both ways. ``JsonlJournal`` is
a ``lifecycle.Journal`` whose structlog logger writes one JSON object per
line; ``read_journal`` (``_replay``, re-exported here) parses such a file
back and replays every request's path through the transition table. A record
is what ``lifecycle.Journal`` emits::

    {"event": "fail", "request_id": "req-000007", "source": "TRANSFERRING",
     "dest": "FAILED", "reason": "TIMEOUT", "attempt": 2, "ts": 1733131200.5,
     "level": "warning"}

plus ``"ignored": true`` on a late event that hit a terminal request (then
``source == dest``). The structlog ``event`` key is the lifecycle event.

Embedding (the library never calls ``structlog.configure``; this logger is
built with ``structlog.wrap_logger`` and carries its own processors)::

    with JsonlJournal("journal.jsonl") as journal:
        sched = Scheduler(backend, cache, journal=journal)
        ...
        sched.close()  # before the journal: close() journals SHUTDOWN failures
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import TextIO

import structlog

from lifecycle import Journal

from ._replay import (
    EdgeKey,
    JournalError,
    JournalProblem,
    JournalRecord,
    Replay,
    RequestTrace,
    read_journal,
)

__all__ = [
    "EdgeKey",
    "JournalError",
    "JournalProblem",
    "JournalRecord",
    "JsonlJournal",
    "Replay",
    "RequestTrace",
    "read_journal",
]


class _LineWriter:
    """The structlog "logger" at the end of the chain: one line per record.

    A record is written and flushed under one lock, so lines from the
    scheduler's threads never interleave and a crashed process leaves a
    journal that ends at its last transition. After close() records are
    dropped (and counted): a late event must not raise into the lifecycle
    that fired it.
    """

    __slots__ = ("_file", "_lock", "dropped", "written")

    _file: TextIO | None  # None once closed
    _lock: threading.Lock  # guards _file and both counters
    written: int
    dropped: int  # records that arrived after close()

    def __init__(self, file: TextIO) -> None:
        self._file = file
        self._lock = threading.Lock()
        self.written = 0
        self.dropped = 0

    def msg(self, line: str) -> None:
        with self._lock:
            if self._file is None:
                self.dropped += 1
                return
            self._file.write(line + "\n")
            self._file.flush()
            self.written += 1

    # structlog calls the method named after the level; all levels are lines.
    debug = info = warning = error = critical = msg

    def close(self) -> None:
        with self._lock:
            file, self._file = self._file, None
        if file is not None:
            file.close()


class JsonlJournal(Journal):
    """A ``lifecycle.Journal`` that appends JSON lines to a file.

    Pass it as ``Scheduler(journal=...)`` (or ``RequestLifecycle(journal=...)``).
    Every level is written, whatever the application configured: the file
    is the complete record. Use it as a context manager, or call close()
    after the scheduler is closed.
    """

    __slots__ = ("_writer", "path")

    path: Path
    _writer: _LineWriter

    def __init__(self, path: str | os.PathLike[str], *, append: bool = False) -> None:
        self.path = Path(path)
        # Opened here so a bad path fails before any request exists.
        self._writer = _LineWriter(self.path.open("a" if append else "w", encoding="utf-8"))
        super().__init__(
            structlog.wrap_logger(
                self._writer,
                # Explicit processors, wrapper and context: nothing comes from
                # (or changes) the application's structlog configuration.
                processors=[
                    structlog.processors.add_log_level,
                    structlog.processors.JSONRenderer(),
                ],
                wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG),
                context_class=dict,
                cache_logger_on_first_use=True,
            )
        )

    @property
    def written(self) -> int:
        return self._writer.written

    @property
    def dropped(self) -> int:
        return self._writer.dropped

    def close(self) -> None:
        self._writer.close()

    def __enter__(self) -> JsonlJournal:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
