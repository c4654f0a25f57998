"""Cost-bounded reservation: a worker pops a message only from queues whose class cost still fits.

Celery with ``worker_disable_prefetch`` stops fetching when the pool is full;
this goes further. It sums the class cost bounds of the messages the worker
holds and pops (atomically, see ``broker``) only from the queues whose bound
fits the rest of the budget. Messages that do not fit are never popped: they stay in
Redis, visible to other workers and to queue-length autoscalers.
"""
from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

from celery import bootsteps

from vlmq.models import ModelSpec, class_cost, cost_classes
from vlmq.settings import Settings
from vlmq.workers import broker

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


def explain_class_cost(spec: ModelSpec, cost_class: str, settings: Settings) -> str:
    """What one job of a class costs this worker, in tokens, and why (for the start-up log)."""
    bound = cost_classes(settings).bound(cost_class)
    model_max = spec.policy.max_vision_tokens()
    if bound is None:
        vision = f"{model_max} vision (the largest image {spec.name} accepts; the class has no upper bound)"
    elif bound > model_max:
        vision = f"{bound} vision (the class bound; no {spec.name} image exceeds {model_max})"
    else:
        vision = f"{bound} vision (the class bound)"
    total = class_cost(spec, cost_class, settings)
    return f"class {cost_class} costs {total} tokens = {vision} + {settings.text_token_bound} text " \
           "(VLMQ_TEXT_TOKEN_BOUND)"


def cost_gate_step(budget: CostBudget, gate: broker.MessageGate,
                   first: frozenset[str] = frozenset()) -> type[bootsteps.StartStopStep]:
    """A consumer bootstep (after Celery's Tasks step) installing the cost gate and the message gate.

    ``first``: the worker's own queues (affinity routing), popped before the shared ones at each priority.
    """

    class CostGate(bootsteps.StartStopStep):
        requires = (broker.CONSUMER_TASKS_STEP,)

        def start(self, c: Any) -> None:
            broker.install(broker.task_channel(c), lambda: budget.fitting(broker.held_queues()), gate, first)
            log.info("cost gate on: budget %d tokens, at most %d jobs, over %d queues", budget.budget,
                     budget.max_jobs, len(budget.queue_costs))

    return CostGate
