"""The pure bookkeeping behind cost-bounded reservation."""
from __future__ import annotations

import pytest

from vlmq.workers.costgate import CostBudget

COSTS = {"q.xs": 2304, "q.s": 3072, "q.m": 6144}


def test_fitting_queues_shrink_as_messages_are_held() -> None:
    budget = CostBudget(COSTS, budget=8000, max_jobs=16)
    assert budget.fitting([]) == {"q.xs", "q.s", "q.m"}
    assert budget.fitting(["q.xs"]) == {"q.xs", "q.s"}  # 5696 left
    assert budget.fitting(["q.xs", "q.s"]) == {"q.xs"}  # 2624 left
    assert budget.fitting(["q.xs", "q.xs", "q.xs"]) == set()  # 1088 left
    assert budget.fitting(["q.m"]) == set()  # 1856 left


def test_job_count_limit_and_unknown_queues() -> None:
    budget = CostBudget(COSTS, budget=100_000, max_jobs=2)
    assert budget.fitting(["q.xs", "other"]) == set()
    assert budget.held_cost(["q.xs", "other"]) == 2304


def test_a_queue_that_can_never_fit_is_refused_up_front() -> None:
    with pytest.raises(ValueError, match="q.m"):
        CostBudget(COSTS, budget=5000, max_jobs=4)
