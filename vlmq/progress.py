"""Progress of a count towards a total, for a terminal and for a log alike.

On a terminal it is one line redrawn in place (a bar); anywhere else (a pipe, a file, CI) it is a plain line
each time the count crosses a 10% step or every ``interval`` seconds, so a captured log stays readable.
Usage::

    progress = Progress("jobs", sys.stdout)
    progress.update(done, total)      # as often as you like
    progress.close()                  # ends the terminal's line
"""
from __future__ import annotations

import time
from typing import TextIO


class Progress:
    """Report ``done`` out of ``total`` to ``stream``."""

    def __init__(self, unit: str, stream: TextIO, *, label: str = "", interval: float = 5.0) -> None:
        self.unit, self.stream, self.label, self.interval = unit, stream, label, interval
        self.tty = stream.isatty()
        self.started = self.last_line = time.monotonic()
        self.last_step = -1  # the last 10% step a plain line was printed for
        self.drawn = False

    def update(self, done: int, total: int, note: str = "") -> None:
        """The count is now ``done`` of ``total``; ``note`` is shown after it (a status, a failure count)."""
        now = time.monotonic()
        text = f"{self.label}{done}/{total} {self.unit}  {now - self.started:5.1f} s{'  ' + note if note else ''}"
        if self.tty:
            width = 30
            filled = width * done // max(total, 1)
            self.stream.write(f"\r  [{'#' * filled}{'-' * (width - filled)}] {text}")
            self.stream.flush()
            self.drawn = True
            return
        step = 10 * done // max(total, 1)
        if step != self.last_step or now - self.last_line >= self.interval:
            self.stream.write(f"  {text}\n")
            self.stream.flush()
            self.last_step, self.last_line = step, now

    def close(self) -> None:
        """End the terminal's redrawn line (a plain stream needs nothing)."""
        if self.tty and self.drawn:
            self.stream.write("\n")
            self.stream.flush()
