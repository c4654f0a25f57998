"""The ``Job`` handle users hold, and the result a finished job returns.

``JobStatus``, ``now`` and ``decode_record`` live in ``vlmq.store`` and are re-exported here.
"""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from vlmq.errors import JobFailed, JobTimeout
from vlmq.store import JobStatus, JobStore, decode_record, now

__all__ = ["Job", "JobResult", "JobStatus", "decode_record", "new_job_id", "now"]
WAIT_SLICE = 5.0  # seconds of one blocking wait on the done list (the SDK's Redis socket timeout is 10 s)


def new_job_id() -> str:
    """A random, URL-safe job id."""
    return uuid.uuid4().hex


@dataclass(slots=True)
class JobResult:
    """What a finished job returns.

    Attributes:
        job_id: the job.
        model: model name that served it.
        text: the generated answer.
        token_ids: generated token ids (without the prompt).
        finish_reason: ``stop`` (end-of-turn token, a stop string or stop token, a complete response format) or
            ``length`` (hit max_new_tokens).
        usage: ``prompt_tokens``, ``image_tokens``, ``generated_tokens`` (all choices').
        logprobs: with ``logprobs`` asked for, one entry per token in OpenAI's shape (``token``, ``logprob``,
            ``bytes``, ``top_logprobs``); None otherwise.
        choices: with ``n`` > 1, every choice (``index``, ``text``, ``token_ids``, ``finish_reason``, and
            ``logprobs`` where asked); the first is also this result's own fields. None for one answer.
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
    logprobs: list[dict[str, Any]] | None = None
    choices: list[dict[str, Any]] | None = None

    @classmethod
    def from_json(cls, data: bytes) -> JobResult:
        """Parse a stored result document."""
        doc = json.loads(data)
        return cls(doc["job_id"], doc["model"], doc["text"], list(doc["token_ids"]), doc["finish_reason"],
                   dict(doc["usage"]), dict(doc["timings"]), doc["worker"], doc, doc.get("logprobs"),
                   doc.get("choices"))


class Job:
    """Handle on a submitted job; cheap to create, every call reads the job store.

    Args:
        store: the job store the job was submitted to (``Client.store``).
        job_id: the job's id.
    """

    def __init__(self, store: JobStore, job_id: str) -> None:
        self._store = store
        self.id = job_id

    def __repr__(self) -> str:
        return f"Job({self.id!r})"

    def info(self) -> dict[str, str]:
        """The job record: status, cost, timestamps (``<status>_at``), error fields.

        Raises:
            JobNotFound: if there is no such job.
            BackendError: if Redis fails.
        """
        return self._store.read(self.id)

    def status(self) -> JobStatus:
        """Current status (prints as its lowercase value, e.g. ``queued``)."""
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
            # woken at once by the worker's final transition (no polling); a slice only keeps each blocking
            # call under the client's socket timeout
            ended = self._store.wait_done(self.id, min(WAIT_SLICE, left) if left is not None else WAIT_SLICE)
            if ended == JobStatus.FINISHED.value:  # final once: the record need not be read again
                return JobResult.from_json(self._store.result_bytes(self.id))

    def _final(self, status: JobStatus, record: dict[str, str]) -> JobResult:
        if status is JobStatus.CANCELED:
            raise JobFailed("canceled", f"job {self.id} was canceled", retryable=False)
        if status is JobStatus.FAILED:
            raise JobFailed(record.get("error_type", "unknown"), record.get("error_message", ""),
                            record.get("retryable") == "1")
        return JobResult.from_json(self._store.result_bytes(self.id))

    def deliveries(self) -> list[dict[str, Any]]:
        """Every webhook delivery attempt for this job, oldest first (the newest 50, kept ``VLMQ_JOB_TTL``).

        Each is a dict: ``event_id`` (the ``webhook-id``), ``type``, ``attempt``, ``at``, ``url``,
        ``status_code`` (None without an answer), ``outcome`` (``delivered``, ``retry``, ``failed``,
        ``refused``, ``disabled``), ``error``, ``duration_s`` and, for a retry, ``next_at``.

        Raises:
            BackendError: if Redis fails.
        """
        from vlmq.webhooks import read_deliveries

        return self._store.call(read_deliveries, self._store.redis, self._store.own(self.id))

    def cancel(self) -> bool:
        """Cancel the job. Returns True if it is now canceled, False if it had already ended.

        A queued job is never started; a started one stops at the worker's next check.

        Raises:
            JobNotFound: no such job.
        """
        return self._store.cancel(self.id)
