"""The one error hierarchy of vlmq.

Remote failures travel as strings (``error_type`` and ``message``), never as
pickled exceptions.
"""
from __future__ import annotations


class VlmqError(Exception):
    """Base class of every error vlmq raises on purpose."""


class InvalidRequest(VlmqError, ValueError):
    """The request is malformed or over a limit; raised at submit, before anything is enqueued.

    ``code`` is a short machine-readable reason (for example ``image_too_large``).
    """

    def __init__(self, message: str, code: str = "invalid_request") -> None:
        super().__init__(message)
        self.code = code


class JobNotFound(VlmqError, KeyError):
    """No job with this id exists (it never did, or its record expired)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "job not found"


class JobTimeout(VlmqError, TimeoutError):
    """The job did not reach a final status within the given timeout; it may still finish."""


class JobFailed(VlmqError):
    """The job ended ``failed`` (or ``canceled``); carries the worker's error as strings.

    Attributes:
        error_type: short code such as ``invalid_image`` or ``poison``.
        message: human-readable explanation.
        retryable: whether submitting the same job again may succeed.
    """

    def __init__(self, error_type: str, message: str, retryable: bool = False) -> None:
        super().__init__(f"{error_type}: {message}")
        self.error_type = error_type
        self.message = message
        self.retryable = retryable


class BackendError(VlmqError):
    """Redis or the object store failed or could not be reached."""


class QueueFull(VlmqError):
    """The queue for this model and cost class is at its configured maximum depth."""


class HandBack(VlmqError):
    """Raised on a worker: the job cannot be served here now (shutdown, storage outage), so its message is
    requeued, not acked, and its record goes back to ``queued``. Never reaches a producer."""
