"""ASGI middleware in front of every route: body caps, slow-client timeouts, and request metrics.

Usage: ``Guard(app, settings, Metrics())``. A declared ``Content-Length`` over the cap is answered 413 before a byte
of the body is read; a body that grows past it stops at the cap (413); a client that leaves more than
``VLMQ_SERVE_READ_TIMEOUT`` between two chunks, or takes more than ``VLMQ_SERVE_BODY_TIMEOUT`` in all, gets 408.
"""
from __future__ import annotations

import re
import time
from typing import Any

import anyio
from prometheus_client import CollectorRegistry, Counter, Histogram

from vlmq.serve.errors import ApiError
from vlmq.settings import Settings

MULTIPART_OVERHEAD = 64 << 10  # bytes a multipart envelope may add to an upload of the largest size
ROUTES = [(re.compile(p), label) for p, label in (
    (r"/v1/files", "/v1/files"), (r"/v1/files/[^/]+", "/v1/files/{id}"),
    (r"/v1/files/[^/]+/content", "/v1/files/{id}/content"), (r"/v1/batches", "/v1/batches"),
    (r"/v1/batches/[^/]+", "/v1/batches/{id}"), (r"/v1/batches/[^/]+/cancel", "/v1/batches/{id}/cancel"),
    (r"/v1/chat/completions", "/v1/chat/completions"), (r"/v1/models", "/v1/models"),
    (r"/healthz", "/healthz"), (r"/readyz", "/readyz"), (r"/metrics", "/metrics"))]


class Metrics:
    """Requests by route, method and status, and latency by route, in a registry of their own (``/metrics``)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("vlmq_serve_requests", "HTTP requests answered", ["route", "method", "status"],
                                registry=self.registry)
        self.latency = Histogram("vlmq_serve_request_seconds", "seconds from request to the end of the answer",
                                 ["route"], registry=self.registry,
                                 buckets=(.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 300))


def route_of(path: str) -> str:
    """A path's route label (ids replaced), ``other`` for anything not served."""
    return next((label for pattern, label in ROUTES if pattern.fullmatch(path)), "other")


class BodyTooLarge(ApiError):
    def __init__(self, limit: int) -> None:
        super().__init__(413, f"the request body is larger than {limit} bytes (VLMQ_SERVE_MAX_FILE_BYTES for "
                         "uploads, VLMQ_SERVE_MAX_BODY_BYTES otherwise)", code="request_too_large")


class SlowClient(ApiError):
    def __init__(self) -> None:
        super().__init__(408, "the request body came too slowly (VLMQ_SERVE_READ_TIMEOUT between chunks, "
                         "VLMQ_SERVE_BODY_TIMEOUT in all)", code="request_timeout")


class Guard:
    """The middleware (see the module docstring)."""

    def __init__(self, app: Any, settings: Settings, metrics: Metrics) -> None:
        self.app, self.settings, self.metrics = app, settings, metrics

    def _limit(self, scope: dict[str, Any]) -> int:
        if scope["method"] == "POST" and scope["path"] == "/v1/files":
            return self.settings.serve_max_file_bytes + MULTIPART_OVERHEAD
        return self.settings.serve_max_body_bytes

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started, status = time.perf_counter(), [500]

        async def send_noting(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            limit = self._limit(scope)
            declared = dict(scope["headers"]).get(b"content-length")
            if declared is not None and (not declared.isdigit() or len(declared) > 18):
                await _answer(ApiError(400, "Content-Length is not a byte count", code="bad_request"), scope,
                              send_noting)
            elif declared is not None and int(declared) > limit:
                await _answer(BodyTooLarge(limit), scope, send_noting)
            else:
                await self.app(scope, self._capped(receive, limit), send_noting)
        finally:
            route = route_of(scope["path"])
            self.metrics.requests.labels(route, scope["method"], str(status[0])).inc()
            self.metrics.latency.labels(route).observe(time.perf_counter() - started)

    def _capped(self, receive: Any, limit: int) -> Any:
        seen, deadline, whole = [0], time.monotonic() + self.settings.serve_body_timeout, [False]

        async def capped_receive() -> dict[str, Any]:
            if whole[0]:  # the body has been read: later calls wait for a disconnect, as long as it takes
                return dict(await receive())
            wait = min(self.settings.serve_read_timeout, deadline - time.monotonic())
            try:
                with anyio.fail_after(max(wait, 0.001)):
                    message: dict[str, Any] = await receive()
            except TimeoutError:
                raise SlowClient() from None
            if message["type"] == "http.request":
                seen[0] += len(message.get("body", b""))
                if seen[0] > limit:
                    raise BodyTooLarge(limit)
                whole[0] = not message.get("more_body", False)
            return message

        return capped_receive


async def _answer(error: ApiError, scope: dict[str, Any], send: Any) -> None:
    await error.response()(scope, _nothing, send)


async def _nothing() -> dict[str, Any]:
    return {"type": "http.disconnect"}
