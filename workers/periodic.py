"""A fleet-wide periodic job on a worker's own thread: at most one worker runs it per period (a Redis lock with the
period's TTL), and an outage skips a period instead of killing the thread (the retention and orphan sweeps)."""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from vlmq.workers.native import worker_thread

log = logging.getLogger(__name__)


class FleetPeriodic:
    """Subclasses set `what` (for logs) and implement `sweep()`, which starts with `if not self.my_turn(): return
    None`."""

    what = "periodic job"

    def __init__(self, redis: Any, lock_key: str, period: float, name: str = "",
                 clock: Callable[[], float] = time.time) -> None:
        self.redis, self.lock_key, self.period, self.name, self.clock = redis, lock_key, period, name, clock
        self._stop = threading.Event()
        self._thread = worker_thread(self._run, f"vlmq-{self.what.replace(' ', '-')}")

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def my_turn(self) -> bool:
        """Take this period's lock: False when another worker (or this one) already ran in it."""
        return bool(self.redis.set(self.lock_key, self.name or "1", nx=True, ex=max(1, round(self.period))))

    def sweep(self) -> int | None:
        raise NotImplementedError

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.sweep()
            except Exception:  # an outage must not kill the thread; the next period retries
                log.warning("%s failed", self.what, exc_info=True)
            self._stop.wait(self.period)
