"""The job store: job statuses, job records in Redis, their atomic transitions, and results in storage.

``Client`` writes records through it and ``Job`` reads them through it; workers use the
module-level :func:`transition` and :func:`read` on their own Redis connection.

Lifetimes (nothing here is kept forever): a record is written with a TTL of ``VLMQ_JOB_TTL``
and every transition that passes a TTL (``JobStore`` always does; workers do on final
statuses) sets it again; others keep it. So a record expires ``VLMQ_JOB_TTL`` after submit,
or after the job ends: a job that never ends does not outlive it. The done list lives ``DONE_TTL`` seconds; the
cancel flag and idempotency keys live ``VLMQ_JOB_TTL``.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from enum import Enum
from typing import Any, TypeVar

import redis as redis_lib

from vlmq import functions, keys
from vlmq.errors import BackendError, JobNotFound
from vlmq.storage import Storage

T = TypeVar("T")
DONE_TTL = 600  # seconds a done list wakes waiters; after that they find the final status by reading the record


class WireEnum(str, Enum):
    """A status with a lowercase wire value: ``str()`` and formatting give it (``queued``, not ``JobStatus.QUEUED``)."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


class JobStatus(WireEnum):
    """Lifecycle of a job as users see it."""

    QUEUED = "queued"
    STARTED = "started"
    FINISHED = "finished"
    FAILED = "failed"
    CANCELED = "canceled"

    @property
    def is_final(self) -> bool:
        """Whether the job can no longer change."""
        return self in (JobStatus.FINISHED, JobStatus.FAILED, JobStatus.CANCELED)


def now() -> float:
    """Wall-clock timestamp stored in records (seconds since the epoch)."""
    return time.time()


def decode_record(raw: Mapping[bytes, bytes] | Mapping[str, str]) -> dict[str, str]:
    """Redis hash (bytes) to a str dict."""
    return {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
            for k, v in raw.items()}


TRANSITION = functions.TRANSITION  # the script (vlmq.functions holds the library's sources)


def transition(redis: Any, job_id: str, allowed: Iterable[JobStatus], new: JobStatus,
               fields: Mapping[str, object] | None = None, ttl: int = 0,
               flag_key: str | None = None) -> tuple[bool, str | None]:
    """Move a job to ``new`` if its status is one of ``allowed``; stamp ``<new>_at``.

    A final status also wakes waiters blocked on the job's done list.

    Args:
        redis: a Redis client.
        job_id: the job.
        allowed: statuses the job may be in.
        new: the status to move to.
        fields: more record fields to set with the status.
        ttl: seconds the record lives from now (0 keeps its current TTL).
        flag_key: a key set to ``1`` (with ``ttl``) if the job exists, whether or not the move is allowed.

    Returns:
        (changed, previous status or None if the job does not exist).
    """
    reply = functions.call(redis, *transition_call(job_id, allowed, new, fields, ttl, flag_key))
    return transition_reply(reply)


def transition_call(job_id: str, allowed: Iterable[JobStatus], new: JobStatus,
                    fields: Mapping[str, object] | None = None, ttl: int = 0,
                    flag_key: str | None = None) -> tuple[str, list[str], list[object]]:
    """``(function, keys, args)`` of :func:`transition` (for ``vlmq.functions.call_many``)."""
    pairs: list[object] = [f"{new.value}_at", repr(now())]
    for k, v in (fields or {}).items():
        pairs += [k, v]
    allowed_csv = ",".join(s.value for s in allowed)
    job_keys = [keys.job(job_id), keys.done(job_id)] + ([flag_key] if flag_key else [])
    return "transition", job_keys, [allowed_csv, new.value, ttl, int(new.is_final), DONE_TTL, keys.batch(""),
                                    keys.new_batch_id(keys.tenant_of(job_id), ""), *pairs]


def transition_reply(reply: object) -> tuple[bool, str | None]:
    """:func:`transition`'s result from the script's reply."""
    if reply is None:
        return False, None
    text = reply.decode() if isinstance(reply, bytes) else str(reply)
    if text.startswith("!"):
        return False, text[1:]
    return True, text


def read(redis: Any, job_id: str) -> dict[str, str]:
    """The job record as a str dict (empty if missing)."""
    return decode_record(redis.hgetall(keys.job(job_id)))


class JobStore:
    """Job records in Redis and results in object storage, for producers and ``Job`` handles.

    Every Redis failure surfaces as ``BackendError``. A tenant's store sees only that tenant's jobs:
    any other job id raises ``JobNotFound`` before Redis is asked (and the tenant's Redis ACL refuses
    it anyway, which surfaces as ``BackendError``).

    Args:
        redis: a Redis client (``redis.Redis``).
        storage: where workers write results.
        job_ttl: seconds a record, cancel flag or idempotency key is kept (``VLMQ_JOB_TTL``).
        where: the broker URL, named in error messages.
        tenant: the tenant whose jobs this store reaches (None: every job).
    """

    def __init__(self, redis: Any, storage: Storage, job_ttl: int, where: str = "Redis",
                 tenant: str | None = None) -> None:
        self.redis = redis
        self.storage = storage
        self.job_ttl = job_ttl
        self.tenant = tenant
        self._where = where

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run one Redis call; a Redis failure becomes ``BackendError``."""
        try:
            return fn(*args, **kwargs)
        except redis_lib.exceptions.NoPermissionError as e:
            raise BackendError(f"Redis at {self._where} refused: {e}. These credentials may not touch this key; "
                               "a tenant's credentials reach only its own jobs (Client(tenant=...), "
                               "VLMQ_TENANT)") from e
        except redis_lib.RedisError as e:
            raise BackendError(f"Redis at {self._where} failed: {e}") from e

    def own(self, job_id: str) -> str:
        """``job_id`` if this store may reach it.

        Raises:
            JobNotFound: a tenant's store given another tenant's (or an untenanted) job id.
        """
        if self.tenant is not None and keys.tenant_of(job_id) != self.tenant:
            raise JobNotFound(f"no job {job_id!r} for tenant {self.tenant!r}; a tenant sees only its own jobs, "
                              f"whose ids start with {self.tenant + '.'!r}")
        return job_id

    def create(self, records: Iterable[Mapping[str, Any]]) -> None:
        """Write new job records (each with an ``id``), with the record TTL, in one round trip."""
        pipe = self.redis.pipeline(transaction=False)
        for record in records:
            pipe.hset(keys.job(record["id"]), mapping=dict(record))
            pipe.expire(keys.job(record["id"]), self.job_ttl)
        self.call(pipe.execute)

    def read(self, job_id: str) -> dict[str, str]:
        """The job record as a str dict.

        Raises:
            JobNotFound: no such job (never submitted, or its record expired).
        """
        record = self.call(read, self.redis, self.own(job_id))
        if not record:
            raise JobNotFound(f"no job {job_id!r} (never submitted, or its record expired)")
        return record

    def transition(self, job_id: str, allowed: Iterable[JobStatus], new: JobStatus,
                   fields: Mapping[str, object] | None = None) -> tuple[bool, str | None]:
        """:func:`transition` that also refreshes the record's TTL."""
        return self.call(transition, self.redis, self.own(job_id), allowed, new, fields, self.job_ttl)

    def wait_done(self, job_id: str, timeout: float) -> str | None:
        """Block until the job's done list has an entry, or ``timeout`` seconds pass.

        The list is rotated onto itself (``BLMOVE`` with one key), so it keeps its entry and its TTL
        for other waiters.

        Returns:
            The final status the entry names, or None on timeout.
        """
        done = keys.done(self.own(job_id))
        entry = self.call(self.redis.blmove, done, done, max(timeout, 0.01), "LEFT", "RIGHT")
        return entry.decode() if isinstance(entry, bytes) else entry

    def cancel(self, job_id: str) -> bool:
        """Cancel a queued or started job; sets the flag workers check. Nothing is written for an unknown id.

        Returns:
            True if the job is now canceled, False if it had already ended.

        Raises:
            JobNotFound: no such job.
        """
        changed, previous = self.call(transition, self.redis, self.own(job_id), [JobStatus.QUEUED, JobStatus.STARTED],
                                      JobStatus.CANCELED, None, self.job_ttl, keys.canceled(job_id))
        if previous is None:
            raise JobNotFound(f"no job {job_id!r}")
        return changed or previous == JobStatus.CANCELED.value

    def result_bytes(self, job_id: str) -> bytes:
        """The stored result document of a finished job.

        Raises:
            BackendError: the result object is missing or storage failed.
        """
        try:
            return self.storage.get(keys.result_object(self.own(job_id)))
        except KeyError as e:
            raise BackendError(f"job {job_id} is finished but its result object is missing from {self.storage.url}; "
                               "producers and workers must share VLMQ_STORAGE_URL") from e
