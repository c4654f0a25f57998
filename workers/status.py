"""Each worker's status hash in Redis (``keys.worker_status``), read by ``vlmq top``: model, device, load, totals."""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from vlmq import keys
from vlmq.workers import metrics

log = logging.getLogger(__name__)
EVERY_S = 2.0
TTL_S = 10  # a worker gone for this long drops out of vlmq top


class StatusWriter(threading.Thread):
    def __init__(self, redis: Any, name: str, fixed: dict[str, str], held_cost: Callable[[], tuple[int, int]]) -> None:
        super().__init__(name="vlmq-status", daemon=True)
        self.redis, self.key, self.fixed, self.held_cost = redis, keys.worker_status(name), fixed, held_cost
        self.started_at = time.time()

    def fields(self) -> dict[str, Any]:
        held, cost = self.held_cost()
        return {**self.fixed, **metrics.totals(), "held": held, "held_cost": cost, "started_at": self.started_at,
                "updated_at": time.time()}

    def run(self) -> None:
        while True:
            try:
                pipe = self.redis.pipeline(transaction=True)
                pipe.hset(self.key, mapping=self.fields())
                pipe.expire(self.key, TTL_S)
                pipe.execute()
            except Exception as e:  # Redis restarting: vlmq top misses this worker for a moment
                log.debug("status not written: %s", e)
            time.sleep(EVERY_S)
