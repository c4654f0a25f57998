"""The worker's Celery app: the vlmq task plus the cost gate and the message gate."""
from __future__ import annotations

import logging
from typing import Any

from vlmq.batch import finalize_job_batch
from vlmq.queue import TASK_NAME, make_celery
from vlmq.settings import Settings
from vlmq.workers.batcher import HandBack
from vlmq.workers.costgate import CostBudget, cost_gate_step
from vlmq.workers.gate import Gate
from vlmq.workers.jobrunner import Delivery, WorkerContext, hand_back, run_job
from vlmq.workers.native import adopt_thread

log = logging.getLogger(__name__)


def make_worker_app(settings: Settings, ctx: WorkerContext, budget: CostBudget, gate: Gate | None = None,
                    first: frozenset[str] = frozenset()) -> Any:
    """The worker app over ``budget``'s queues; ``first``: its own queues (affinity), consumed first."""
    from celery.exceptions import Reject
    from kombu import Queue

    app = make_celery(settings, name="vlmq-worker")
    app.conf.task_queues = [Queue(q, routing_key=q) for q in budget.queue_costs]
    app.conf.worker_concurrency = budget.max_jobs
    app.conf.worker_pool = "threads"
    app.conf.worker_send_task_events = settings.worker_events  # Flower and `celery events` see the tasks (-E)
    app.steps["consumer"].add(cost_gate_step(budget, gate or Gate(), first))
    _hand_back_on_shutdown(settings, ctx)

    @app.task(name=TASK_NAME, acks_late=True, reject_on_worker_lost=True)
    def vlmq_run_job(job_id: str) -> str:
        adopt_thread("vlmq-job")  # Celery made this thread: one OpenMP thread, as every pool beside the model's
        delivery = Delivery()
        try:
            status = run_job(ctx, job_id, delivery)
        except HandBack as e:
            # not the job's fault (an infrastructure error, a shutdown): requeue it for this or another worker;
            # with the broker down the reject fails (logged by kombu) and the message, still in the unacked hash,
            # comes back after the visibility timeout
            hand_back(ctx, job_id, delivery.counted)
            raise Reject(str(e), requeue=True) from e
        except Exception as e:
            # a fault of ours, not the job's (run_job ends every job's own fault itself): never ack it; the
            # attempt stays counted, so a fault that repeats ends the job as poison
            log.exception("job %s: the worker failed serving it; requeueing its message", job_id)
            raise Reject(f"{type(e).__name__}: {e}", requeue=True) from e
        _finalize_batch(ctx, job_id)
        return status

    return app


def _finalize_batch(ctx: WorkerContext, job_id: str) -> None:
    """The worker that ends a batch's last job writes the batch's files; a failure leaves that to the next
    finalizer (``Batch.refresh``), never to this job."""
    try:
        finalize_job_batch(ctx.redis, ctx.storage, job_id, ctx.settings.job_ttl)
    except Exception:
        log.exception("job %s: finalizing its batch failed; the next status read will retry it", job_id)


def _hand_back_on_shutdown(settings: Settings, ctx: WorkerContext) -> None:
    """SIGTERM: stop taking work, let running jobs finish for ``shutdown_grace`` s, then requeue the rest."""
    import threading

    from celery.signals import worker_shutting_down

    @worker_shutting_down.connect(weak=False)
    def _on_shutdown(**_: object) -> None:
        if ctx.fleet is not None:
            ctx.fleet.stop()  # live workers drain this worker's own queues from now on

        def later() -> None:
            handed = ctx.batcher.hand_back_all("worker shutting down")
            if handed:
                log.info("handed %d unfinished jobs back to the queue", handed)

        timer = threading.Timer(settings.shutdown_grace, later)
        timer.daemon = True
        timer.start()
