"""Every Redis key vlmq uses, under one prefix, and the names of kombu's keys that vlmq reads or writes.

kombu's Redis transport owns the queue lists and the unacked structures; their names are spelled here
only (``vlmq.workers.broker`` checks at start-up that kombu still uses them).
"""
from __future__ import annotations

PREFIX = "vlmq:"
PRIORITY_SEP = ":"  # kombu's ``sep`` transport option: priority p > 0 of queue q lives in the list ``q:p``
PRIORITY_STEPS = tuple(range(10))  # kombu's ``priority_steps``: 0 (highest) to 9, one list each
UNACKED = "unacked"  # kombu: hash delivery_tag -> [message, exchange, routing_key] of every delivered message
UNACKED_INDEX = "unacked_index"  # kombu: sorted set delivery_tag -> delivery time; leases refresh the score


def job(job_id: str) -> str:
    """Hash with the job record."""
    return f"{PREFIX}job:{job_id}"


def idempotency(key: str) -> str:
    """String holding the job id submitted under an idempotency key."""
    return f"{PREFIX}idem:{key}"


def done(job_id: str) -> str:
    """List pushed once when a job reaches a final status; ``Job.result`` blocks on it."""
    return f"{PREFIX}done:{job_id}"


def canceled(job_id: str) -> str:
    """Durable cancellation flag, checked by workers before and during work."""
    return f"{PREFIX}cancel:{job_id}"


def result_guard(job_id: str) -> str:
    """``SET NX`` guard: the first worker to finish a job owns its result."""
    return f"{PREFIX}result-owner:{job_id}"


def queue(model: str, cost_class: str) -> str:
    """Celery queue name for a model and cost class."""
    return f"vlmq.{model}.{cost_class}"


def priority_list(queue_name: str, priority: int) -> str:
    """kombu's Redis list for one priority step of a queue (0 is the bare queue name)."""
    return f"{queue_name}{PRIORITY_SEP}{priority}" if priority else queue_name


def queue_lists(queue_name: str) -> list[str]:
    """The Redis lists behind one Celery queue: one per priority step (0 = the bare name)."""
    return [priority_list(queue_name, p) for p in PRIORITY_STEPS]


def dead_letter(queue_name: str) -> str:
    """List of messages the worker's gate refused from one queue (reason + raw bytes); bounded, with a TTL.

    Written by the gate (``vlmq.workers.gate``); read by operators.
    """
    return f"{PREFIX}dead:{queue_name}"


def idle_wait(token: str) -> str:
    """A list nobody writes: an idle worker's ``BLPOP`` on it is a short server-side sleep between pops."""
    return f"{PREFIX}idle-wait:{token}"


def input_object(sha256: str) -> str:
    """Storage key of a content-addressed input image."""
    return f"inputs/{sha256}"


def result_object(job_id: str) -> str:
    """Storage key of a job's result JSON."""
    return f"results/{job_id}.json"
