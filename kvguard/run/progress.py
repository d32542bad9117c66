"""The progress bar of ``kvguard run``, and a logger that prints above it.

Warnings raised mid-run (``scheduler.stuck``) would otherwise land in the
middle of the bar's line; the bar blanks itself, lets the line through and
redraws on the next update.
"""

from __future__ import annotations

import logging
import time
from typing import Any, TextIO

import structlog

__all__ = ["Progress"]


class Progress:
    """One line on stderr, redrawn at most every 0.1 s; ``force`` draws and ends it."""

    def __init__(self, total: int, out: TextIO, enabled: bool) -> None:
        self.total, self.out, self.enabled = total, out, enabled
        self._last = 0.0
        self._drawn = 0  # length of the bar on the current line; 0: none

    def note(self, line: str) -> None:
        """A line above the bar (a warning): blank the bar, print, redraw later."""
        if self._drawn:
            self.out.write("\r" + " " * self._drawn + "\r")
            self._drawn = 0
        self.out.write(line + "\n")
        self.out.flush()
        self._last = 0.0

    # structlog's logger protocol: it calls the method named after the level.
    msg = debug = info = warning = error = critical = note

    def show(self, done: int, failed: int, live: int, force: bool = False) -> None:
        now = time.monotonic()
        if not self.enabled or (not force and now - self._last < 0.1):
            return
        self._last = now
        width = 30
        ended = done + failed
        filled = int(width * ended / self.total)
        bar = "#" * filled + "." * (width - filled)
        text = f"[{bar}] {ended}/{self.total}  done {done}  failed {failed}  live {live} "
        self.out.write("\r" + text)
        self._drawn = len(text)
        if force:
            self.out.write("\n")
            self._drawn = 0
        self.out.flush()

    def logger(self) -> Any:
        """A structlog logger printing above the bar, whatever the app configured."""
        return structlog.wrap_logger(
            self,
            processors=[
                structlog.processors.add_log_level,
                structlog.processors.TimeStamper(fmt="%H:%M:%S"),
                structlog.dev.ConsoleRenderer(colors=False),
            ],
            wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
            context_class=dict,
            cache_logger_on_first_use=True,
        )
