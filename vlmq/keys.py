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
