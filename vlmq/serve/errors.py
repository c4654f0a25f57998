"""OpenAI's error shape (``{"error": {"message", "type", "param", "code"}}``) and which status each vlmq error gets.

Usage: ``raise ApiError(404, "no such batch", code="not_found")``; ``api_error(exc)`` maps any exception.
"""
from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse

from vlmq.errors import BackendError, InvalidRequest, JobFailed, JobNotFound, JobTimeout, QueueFull

QUEUE_FULL_RETRY_AFTER = "2"  # seconds a client told 429 (a full queue) waits before it retries
# the body field an InvalidRequest code is about (OpenAI's ``param``), where one field is
PARAMS = {"bad_model": "model", "unknown_model": "model", "bad_max_new_tokens": "max_tokens",
          "bad_temperature": "temperature", "bad_seed": "seed", "bad_metadata": "metadata", "bad_user": "user",
          "bad_completion_window": "completion_window", "bad_image_source": "messages", "image_count": "messages"}
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "invalid_request_error", 408: "invalid_request_error", 409: "invalid_request_error",
          413: "invalid_request_error", 429: "rate_limit_error", 504: "timeout_error"}
# a job's own fault (bad input): 400; anything else that failed it is the pool's: 500
_SERVER_FAULTS = ("poison", "internal", "engine_error", "unknown")


class ApiError(Exception):
    """An error answered in OpenAI's shape.

    Args:
        status: the HTTP status (the ``openai`` client maps it to its exception classes).
        message: what went wrong and what to do next.
        code: a short machine-readable reason.
        param: the request field it is about.
        headers: extra response headers (``Retry-After``).
    """

    def __init__(self, status: int, message: str, *, code: str | None = None, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.headers = headers or {}

    def response(self) -> JSONResponse:
        """The JSON response."""
        kind = _TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")
        body = {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status, headers=self.headers)


def api_error(exc: BaseException) -> ApiError:
    """The ``ApiError`` an exception is answered with."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, InvalidRequest):
        return ApiError(400, str(exc), code=exc.code, param=PARAMS.get(exc.code))
    if isinstance(exc, JobNotFound):
        return ApiError(404, str(exc).strip("'\""), code="not_found")
    if isinstance(exc, QueueFull):
        return ApiError(429, str(exc), code="queue_full", headers={"Retry-After": QUEUE_FULL_RETRY_AFTER})
    if isinstance(exc, JobTimeout):
        return ApiError(504, str(exc), code="timeout")
    if isinstance(exc, JobFailed):
        status = 503 if exc.retryable else 500 if exc.error_type in _SERVER_FAULTS else 400
        return ApiError(status, f"{exc.error_type}: {exc.message}", code=exc.error_type)
    if isinstance(exc, BackendError):
        return ApiError(503, f"the pool's Redis or object store failed: {exc}", code="backend_unavailable")
    return ApiError(500, "internal error; the server logged it", code="internal_error")


def refuse_unknown(given: dict[str, Any], known: frozenset[str], where: str) -> None:
    """Refuse fields outside ``known`` by name (a field we accept is a field we apply)."""
    unknown = sorted(set(given) - known)
    if unknown:
        raise ApiError(400, f"{where} field(s) {', '.join(unknown)[:200]} are not supported", code="unsupported_field",
                       param=unknown[0][:64])
