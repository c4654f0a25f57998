"""Cost-bounded reservation: a worker pops a message only from queues whose class cost still fits.

Celery with ``worker_disable_prefetch`` stops fetching when the pool is full;
this goes further. It sums the class cost bounds of the messages the worker
holds and pops (atomically, see ``redispop``) only from the queues whose bound
fits the rest of the budget. Messages that do not fit are never popped: they stay in
Redis, visible to other workers and to queue-length autoscalers.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from types import MethodType
from typing import Any

from celery import bootsteps

from vlmq.workers import redispop

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


def _gated_keys(fitting: Callable[[], set[str]]) -> Callable[[Any], list[str]]:
    """The Redis keys to pop from: kombu's queue cycle restricted to the queues that fit, by priority."""
    def queue_keys(channel: Any) -> list[str]:
        allowed = fitting()
        queues = [q for q in channel._queue_cycle.consume(len(channel.active_queues)) if q in allowed]
        return [channel._q_for_pri(q, pri) for pri in channel.priority_steps for q in queues]

    return queue_keys


class CostGate(bootsteps.StartStopStep):
    """Consumer bootstep installing the gate on the task channel (after Celery's Tasks step)."""

    requires = ("celery.worker.consumer.tasks:Tasks",)

    def start(self, c: Any) -> None:
        budget: CostBudget = c.app.vlmq_budget
        channel = c.task_consumer.channel
        if not hasattr(channel, "_brpop_start") or not hasattr(channel, "handlers"):
            raise RuntimeError("the vlmq cost gate needs the Redis transport")

        def fitting() -> set[str]:
            return budget.fitting(_held_queues())

        original = channel.qos.can_consume
        channel.qos.can_consume = MethodType(lambda qos: bool(fitting()) and original(), channel.qos)
        redispop.install(channel, _gated_keys(fitting))
        log.info("cost gate on: budget %d over %s", budget.budget, budget.queue_costs)
