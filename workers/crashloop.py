"""Crash-loop detection for the worker supervisor: a worker that keeps dying on start-up is reported, not
restarted into the same failure forever.

A child that exits within ``startup_window_s`` of its start counts as a start-up crash; each restart after
one waits twice as long as the last (from 1 s), and after ``max_startup_crashes`` in a row its slot is
given up and reported. A child that ran longer than the window resets its slot's count.
"""
from __future__ import annotations

from dataclasses import dataclass, field

STARTUP_WINDOW_S = 60.0  # a worker that dies sooner than this after starting crashed on start-up
MAX_STARTUP_CRASHES = 3  # start-up crashes in a row before a slot (a GPU) is given up


@dataclass(slots=True)
class RestartPolicy:
    startup_window_s: float = STARTUP_WINDOW_S
    max_startup_crashes: int = MAX_STARTUP_CRASHES
    crashes: dict[str, int] = field(default_factory=dict)

    def after_exit(self, slot: str, lived_s: float) -> float | None:
        """Seconds to wait before restarting ``slot``'s worker, or None: stop restarting it."""
        if lived_s >= self.startup_window_s:
            self.crashes[slot] = 0
            return 0.0
        self.crashes[slot] = self.crashes.get(slot, 0) + 1
        if self.crashes[slot] >= self.max_startup_crashes:
            return None
        return float(2 ** (self.crashes[slot] - 1))
