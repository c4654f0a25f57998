"""Cost-bounded reservation: a worker pops a message only from queues whose class cost still fits.

Celery with ``worker_disable_prefetch`` stops fetching when the pool is full;
this goes further. It sums the class cost bounds of the messages the worker
holds and issues its Redis ``BRPOP`` only over the queues whose bound fits the
rest of the budget. Messages that do not fit are never popped: they stay in
Redis, visible to other workers and to queue-length autoscalers.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from types import MethodType
from typing import Any

from celery import bootsteps

log = logging.getLogger(__name__)


class CostBudget:
    """Pure bookkeeping: which queues fit, given the costs of held messages."""

    def __init__(self, queue_costs: Mapping[str, int], budget: int, max_jobs: int) -> None:
        too_big = [q for q, c in queue_costs.items() if c > budget]
        if too_big:
            raise ValueError(f"queues {too_big} cost more than the worker budget {budget}")
        self.queue_costs = dict(queue_costs)
        self.budget = budget
        self.max_jobs = max_jobs

    def held_cost(self, held_queues: Iterable[str]) -> int:
        return sum(self.queue_costs.get(q, 0) for q in held_queues)

    def fitting(self, held_queues: Iterable[str]) -> set[str]:
        held = list(held_queues)
        if len(held) >= self.max_jobs:
            return set()
        room = self.budget - self.held_cost(held)
        return {q for q, c in self.queue_costs.items() if c <= room}


def _held_queues() -> list[str]:
    from celery.worker import state

    return [(r.delivery_info or {}).get("routing_key", "") for r in list(state.reserved_requests)]


def _gated_brpop(channel: Any, fitting: Callable[[], set[str]]) -> Callable[..., None]:
    """kombu's Redis ``Channel._brpop_start`` restricted to the queues that fit."""
    def brpop_start(self: Any, timeout: float | None = None) -> None:
        allowed = fitting()
        queues = [q for q in self._queue_cycle.consume(len(self.active_queues)) if q in allowed]
        if not queues:
            return
        keys = [self._q_for_pri(q, pri) for pri in self.priority_steps for q in queues]
        command = ["BRPOP", *keys, (self.brpop_timeout if timeout is None else timeout) or 0]
        if self.global_keyprefix:
            command = self.client._prefix_args(command)
        self._in_poll = self.client.connection
        self._brpop_sent_at = time.monotonic()
        self.client.connection.send_command(*command)

    return MethodType(brpop_start, channel)


class CostGate(bootsteps.StartStopStep):
    """Consumer bootstep installing the gate on the task channel (after Celery's Tasks step)."""

    requires = ("celery.worker.consumer.tasks:Tasks",)

    def start(self, c: Any) -> None:
        budget: CostBudget = c.app.vlmq_budget
        channel = c.task_consumer.channel
        if not hasattr(channel, "_brpop_start"):
            raise RuntimeError("the vlmq cost gate needs the Redis transport")

        def fitting() -> set[str]:
            return budget.fitting(_held_queues())

        original = channel.qos.can_consume
        channel.qos.can_consume = MethodType(lambda qos: bool(fitting()) and original(), channel.qos)
        channel._brpop_start = _gated_brpop(channel, fitting)
        log.info("cost gate on: budget %d over %s", budget.budget, budget.queue_costs)
