"""Every Redis key vlmq uses, under one prefix."""
from __future__ import annotations

PREFIX = "vlmq:"


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


def queue_lists(queue_name: str) -> list[str]:
    """The Redis lists behind one Celery queue: one per priority step (0 = the bare name)."""
    return [queue_name] + [f"{queue_name}:{p}" for p in range(1, 10)]


def input_object(sha256: str) -> str:
    """Storage key of a content-addressed input image."""
    return f"inputs/{sha256}"


def result_object(job_id: str) -> str:
    """Storage key of a job's result JSON."""
    return f"results/{job_id}.json"


def job_pattern() -> str:
    """``SCAN`` pattern matching every job record (the retention sweep reads the live ones' inputs)."""
    return f"{PREFIX}job:*"


def retention_lock() -> str:
    """``SET NX EX`` lock: the worker that sets it runs this period's object-store retention sweep.

    Written by ``vlmq.workers.retention``; it expires after the sweep period and is never deleted, so
    the fleet sweeps at most once per period.
    """
    return f"{PREFIX}retention-sweep"


# kombu's Redis transport: messages delivered but not acked (hash and its index by delivery time) and the
# restore sweep's mutex; shared by every queue in the database
KOMBU_UNACKED = "unacked"
KOMBU_UNACKED_INDEX = "unacked_index"
KOMBU_UNACKED_MUTEX = "unacked_mutex"
# exchange bindings: ``_kombu.binding.<exchange>`` and ``_kombu.binding_permanent.<exchange>`` (sets of the queues
# bound to it) and ``_kombu.binding_deadlines`` (when the bindings of expiring queues lapse; kombu 5.7)
KOMBU_BINDING_PREFIX = "_kombu.binding"


def is_queue_list(name: str) -> bool:
    """Whether ``name`` is one of the Redis lists behind a vlmq Celery queue (see :func:`queue_lists`)."""
    base = name.partition(":")[0]
    model, _, cost_class = base.removeprefix("vlmq.").rpartition(".")
    return base.startswith("vlmq.") and bool(model and cost_class) and name in queue_lists(base)


def has_owner(name: str) -> bool:
    """Whether a key without a TTL is owned: kombu deletes it when it empties (queue lists, unacked
    structures) or keeps it on purpose (exchange bindings, a handful per pool)."""
    return (is_queue_list(name) or name in (KOMBU_UNACKED, KOMBU_UNACKED_INDEX, KOMBU_UNACKED_MUTEX)
            or name.startswith(KOMBU_BINDING_PREFIX))
