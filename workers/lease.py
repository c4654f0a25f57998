"""Lease renewal: keep the messages a worker holds invisible to others while it works on them.

kombu's Redis transport re-delivers any message whose score in ``unacked_index``
is older than the visibility timeout, even if its worker is healthy and busy. A
thread in the worker process refreshes the score of every message the worker
holds (``ZADD XX``: never re-adds an acked tag). A SIGKILLed worker stops
renewing, so its messages come back after the timeout as before.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any

log = logging.getLogger(__name__)
UNACKED_INDEX = "unacked_index"


def held_delivery_tags() -> list[str]:
    from celery.worker import state

    requests = list(state.reserved_requests) + list(state.active_requests)
    return list({r.message.delivery_tag for r in requests if r.message is not None})


class LeaseRenewer:
    def __init__(self, redis: Any, visibility_timeout: int) -> None:
        self.redis = redis
        self.period = max(0.5, visibility_timeout / 4)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="vlmq-lease", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def renew(self) -> int:
        tags = held_delivery_tags()
        if tags:
            self.redis.zadd(UNACKED_INDEX, {tag: time.time() for tag in tags}, xx=True)
        return len(tags)

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            try:
                self.renew()
            except Exception:  # Redis blips must not kill the thread; the next period retries
                log.warning("lease renewal failed", exc_info=True)
