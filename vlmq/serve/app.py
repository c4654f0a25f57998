"""The ASGI application of ``vlmq serve``: routes, error handlers, health, readiness and metrics.

Usage: ``uvicorn --factory vlmq.serve.app:from_env`` (what ``vlmq serve`` runs), or ``create_app(settings)``.
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import anyio.to_thread
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from vlmq.errors import VlmqError
from vlmq.serve import routes_batches, routes_chat, routes_files
from vlmq.serve.door import Door
from vlmq.serve.errors import ApiError, api_error
from vlmq.serve.guard import Guard, Metrics
from vlmq.settings import Settings

log = logging.getLogger(__name__)
THREADS = 256  # blocking SDK calls in flight at once (a chat completion holds one while its job runs)


async def healthz(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


async def readyz(request: Request) -> Response:
    try:
        checks = await run_in_threadpool(request.app.state.door.ready)
    except Exception as e:  # whatever fails, the replica is not ready
        return ApiError(503, f"not ready: {type(e).__name__}: {e}", code="not_ready").response()
    return JSONResponse({"status": "ready", **checks})


async def metrics(request: Request) -> Response:
    return Response(generate_latest(request.app.state.metrics.registry), media_type=CONTENT_TYPE_LATEST)


async def _on_api_error(request: Request, exc: Exception) -> Response:
    return api_error(exc).response()


async def _on_http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "bad_request")
    message = "no such route" if exc.status_code == 404 else str(exc.detail)
    return ApiError(exc.status_code, message, code=code).response()


async def _on_any_error(request: Request, exc: Exception) -> Response:
    error = api_error(exc)
    if error.status == 500:
        log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
    return error.response()


def create_app(settings: Settings) -> Starlette:
    """The application for a pool's settings."""
    metrics_ = Metrics()

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        anyio.to_thread.current_default_thread_limiter().total_tokens = THREADS
        yield
        app.state.door.close()

    routes = [*routes_files.ROUTES, *routes_batches.ROUTES, *routes_chat.ROUTES,
              Route("/healthz", healthz), Route("/readyz", readyz), Route("/metrics", metrics)]
    # vlmq's own errors are answered where they are raised; anything else is a 500, logged with its traceback
    handlers: dict[Any, Any] = {ApiError: _on_api_error, VlmqError: _on_api_error, HTTPException: _on_http_error,
                                Exception: _on_any_error}
    app = Starlette(routes=routes, exception_handlers=handlers, lifespan=lifespan,
                    middleware=[Middleware(Guard, settings=settings, metrics=metrics_)])
    app.state.door, app.state.metrics = Door(settings), metrics_
    return app


def from_env() -> Starlette:
    """The application configured from ``VLMQ_*`` (``uvicorn --factory``)."""
    return create_app(Settings.from_env())
