"""The worker's Celery app: the vlmq task plus the cost gate."""
from __future__ import annotations

from typing import Any

from vlmq.queue import TASK_NAME, make_celery
from vlmq.settings import Settings
from vlmq.workers.costgate import CostBudget, CostGate
from vlmq.workers.jobrunner import HandBack, WorkerContext, run_job


def make_worker_app(settings: Settings, ctx: WorkerContext, budget: CostBudget) -> Any:
    from celery.exceptions import Reject
    from kombu import Queue

    app = make_celery(settings, name="vlmq-worker")
    app.conf.task_queues = [Queue(q, routing_key=q) for q in budget.queue_costs]
    app.conf.worker_concurrency = budget.max_jobs
    app.conf.worker_pool = "threads"
    app.vlmq_budget = budget
    app.steps["consumer"].add(CostGate)

    @app.task(name=TASK_NAME, acks_late=True, reject_on_worker_lost=True)
    def vlmq_run_job(job_id: str) -> str:
        try:
            return run_job(ctx, job_id)
        except HandBack as e:
            # not the job's fault: requeue it unacked for this or another worker
            raise Reject(str(e), requeue=True) from e

    return app
