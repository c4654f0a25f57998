"""Job statuses, job records in Redis, results, and the ``Job`` handle users hold."""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

from vlmq import keys
from vlmq.errors import BackendError, JobFailed, JobNotFound, JobTimeout

if TYPE_CHECKING:
    from vlmq.client import Client


class JobStatus(str, Enum):
    """Lifecycle of a job as users see it (lowercase wire values)."""

    QUEUED = "queued"
    STARTED = "started"
    FINISHED = "finished"
    FAILED = "failed"
    CANCELED = "canceled"

    @property
    def is_final(self) -> bool:
        """Whether the job can no longer change."""
        return self in (JobStatus.FINISHED, JobStatus.FAILED, JobStatus.CANCELED)


def new_job_id() -> str:
    """A random, URL-safe job id."""
    return uuid.uuid4().hex


def now() -> float:
    """Wall-clock timestamp stored in records (seconds since the epoch)."""
    return time.time()


@dataclass(slots=True)
class JobResult:
    """What a finished job returns.

    Attributes:
        job_id: the job.
        model: model name that served it.
        text: the generated answer.
        token_ids: generated token ids (without the prompt).
        finish_reason: ``stop`` (end-of-turn token) or ``length`` (hit max_new_tokens).
        usage: ``prompt_tokens``, ``image_tokens``, ``generated_tokens``.
        timings: seconds spent per phase (``queue``, ``fetch``, ``decode_image``, ``model``, ``total``).
        worker: name of the worker process that served it.
        raw: the stored JSON document.
    """

    job_id: str
    model: str
    text: str
    token_ids: list[int]
    finish_reason: str
    usage: dict[str, int]
    timings: dict[str, float]
    worker: str
    raw: dict[str, Any] = field(repr=False, default_factory=dict)

    @classmethod
    def from_json(cls, data: bytes) -> JobResult:
        """Parse a stored result document."""
        doc = json.loads(data)
        return cls(doc["job_id"], doc["model"], doc["text"], list(doc["token_ids"]), doc["finish_reason"],
                   dict(doc["usage"]), dict(doc["timings"]), doc["worker"], doc)


def decode_record(raw: dict[bytes, bytes] | dict[str, str]) -> dict[str, str]:
    """Redis hash (bytes) to a str dict."""
    return {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
            for k, v in raw.items()}


class Job:
    """Handle on a submitted job; cheap to create, every call reads Redis."""

    def __init__(self, client: Client, job_id: str) -> None:
        self._client = client
        self.id = job_id

    def __repr__(self) -> str:
        return f"Job({self.id!r})"

    def info(self) -> dict[str, str]:
        """The job record: status, cost, timestamps (``<status>_at``), error fields.

        Raises:
            JobNotFound: if there is no such job.
            BackendError: if Redis fails.
        """
        record = self._client._read_record(self.id)
        if not record:
            raise JobNotFound(f"no job {self.id!r} (never submitted, or its record expired)")
        return record

    def status(self) -> JobStatus:
        """Current status."""
        return JobStatus(self.info()["status"])

    def result(self, timeout: float | None = None) -> JobResult:
        """Wait for the job to end and return its result.

        Args:
            timeout: seconds to wait; None waits forever.

        Returns:
            The result of a finished job.

        Raises:
            JobTimeout: the job did not end in time (it may still finish).
            JobFailed: the job failed or was canceled.
            JobNotFound: no such job.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            record = self.info()
            status = JobStatus(record["status"])
            if status.is_final:
                return self._final(status, record)
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise JobTimeout(f"job {self.id} still {status.value} after {timeout} s")
            # woken at once by the worker's final transition; re-read the record every second regardless
            self._client._wait_done(self.id, min(1.0, left) if left is not None else 1.0)

    def _final(self, status: JobStatus, record: dict[str, str]) -> JobResult:
        if status is JobStatus.CANCELED:
            raise JobFailed("canceled", f"job {self.id} was canceled", retryable=False)
        if status is JobStatus.FAILED:
            raise JobFailed(record.get("error_type", "unknown"), record.get("error_message", ""),
                            record.get("retryable") == "1")
        try:
            return JobResult.from_json(self._client.storage.get(keys.result_object(self.id)))
        except KeyError as e:
            raise BackendError(f"job {self.id} is finished but its result object is missing") from e

    def cancel(self) -> bool:
        """Cancel the job. Returns True if it is now canceled, False if it had already ended.

        A queued job is never started; a started one stops at the worker's next check.
        """
        return self._client._cancel(self.id)
