"""Lease renewal: keep the messages a worker holds invisible to others while it works on them.

kombu's Redis transport re-delivers any message whose score in ``unacked_index``
is older than the visibility timeout, even if its worker is healthy and busy. A
thread in the worker process refreshes the score of every message the worker
holds (``ZADD XX``: never re-adds an acked tag). A SIGKILLed worker stops
renewing, so its messages come back after the timeout as before.
"""
from __future__ import annotations

import logging
import time
from typing import Any

from vlmq.workers import broker
from vlmq.workers.native import worker_thread

log = logging.getLogger(__name__)


class LeaseRenewer:
    def __init__(self, redis: Any, visibility_timeout: int) -> None:
        self.redis = redis
        self.period = max(0.5, visibility_timeout / 4)
        self._thread = worker_thread(self._run, "vlmq-lease")

    def start(self) -> None:
        self._thread.start()

    def renew(self) -> int:
        tags = broker.held_delivery_tags()
        broker.renew_leases(self.redis, tags)
        return len(tags)

    def _run(self) -> None:
        while True:  # a daemon thread: it ends with the worker process
            time.sleep(self.period)
            try:
                self.renew()
            except Exception:  # Redis blips must not kill the thread; the next period retries
                log.warning("lease renewal failed", exc_info=True)
