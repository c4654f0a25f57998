"""Celery configuration shared by producers (the SDK) and workers.

Messages are JSON (msgpack also accepted); pickle is never accepted. The
reliability settings: late acks (a message is acked only after its job's
status is durable), reject on worker lost (a crashed pool requeues instead of
acking), no ack on failure or timeout (see ``docs/guarantees.md``), no
prefetch (a worker holds only what it works on; see ``vlmq.workers.costgate``).
"""
from __future__ import annotations

from typing import Any

from vlmq import keys
from vlmq.settings import Settings

TASK_NAME = "vlmq.run_job"
PRIORITY_STEPS = list(keys.PRIORITY_STEPS)  # 0 is the highest priority (Celery on Redis)
DEFAULT_PRIORITY = 5


def celery_config(settings: Settings) -> dict[str, Any]:
    """Celery settings for the vlmq app.

    Workers renew the visibility of what they hold (see ``vlmq.workers.lease``), so the
    visibility timeout only bounds how long a dead worker's messages stay hidden; the
    restore sweep runs every quarter of it instead of kombu's default ~100 s.
    """
    visibility_timeout = settings.visibility_timeout
    restore_interval = max(1, min(10, visibility_timeout // 4))
    transport = {
        "priority_steps": PRIORITY_STEPS,
        "sep": keys.PRIORITY_SEP,
        "queue_order_strategy": "priority",
        "visibility_timeout": visibility_timeout,
        "unacked_restore_interval": restore_interval,
        "unacked_restore_throttle": 1,
        # the restore sweep holds this lock for milliseconds; kombu's 300 s default means a worker killed
        # while holding it stops every restore for five minutes (the sweep is transactional without it)
        "unacked_mutex_expire": max(5, 2 * restore_interval),
        "socket_connect_timeout": 3,
        "max_retries": 1,
    }
    return {
        "broker_url": settings.broker_url,
        "broker_transport_options": transport,
        "broker_connection_timeout": 3,
        "broker_connection_retry_on_startup": True,
        "task_serializer": "json",
        "accept_content": ["json", "msgpack"],
        "result_accept_content": ["json", "msgpack"],
        "task_ignore_result": True,
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        # a task never fails for a job's own fault (the worker ends the job and returns) nor for an
        # infrastructure error (it rejects with requeue); what is left is a time limit, which requeues, and a
        # failure Celery itself reports (docs/guarantees.md, "Infrastructure errors")
        "task_acks_on_failure_or_timeout": False,
        "task_default_priority": DEFAULT_PRIORITY,
        "task_create_missing_queues": True,
        "worker_prefetch_multiplier": 1,
        "worker_disable_prefetch": True,
        "worker_hijack_root_logger": False,
        "worker_cancel_long_running_tasks_on_connection_loss": True,
        "visibility_timeout": visibility_timeout,
    }


def make_celery(settings: Settings, name: str = "vlmq") -> Any:
    """A Celery app configured for vlmq (no tasks registered: producers send by name)."""
    from celery import Celery

    app = Celery(name)
    app.conf.update(celery_config(settings))
    return app
