"""What every route does: authenticate, parse a JSON body with its caps, run the blocking SDK call off the loop.

Usage: ``return await run(request, lambda client: client.batch(batch_id).refresh())``.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from vlmq.batchfile import check_depth
from vlmq.client import Client
from vlmq.errors import InvalidRequest
from vlmq.serve.door import Door, bearer
from vlmq.serve.errors import ApiError


def door_of(request: Request) -> Door:
    door: Door = request.app.state.door
    return door


async def run(request: Request, call: Callable[[Client], Any]) -> Response:
    """``call`` with the caller's tenant's client, in a worker thread; a dict result is answered as JSON."""
    key, door = bearer(request), door_of(request)
    tenant = getattr(request.state, "tenant", None)  # authenticated already, before its body was read

    def work() -> Any:
        return call(door.client_of(tenant or door.tenant(key)))

    result = await run_in_threadpool(work)
    return result if isinstance(result, Response) else JSONResponse(result)


async def authenticate(request: Request) -> str:
    """The caller's tenant, before anything of its body is read (401 for no key or a bad one)."""
    key, door = bearer(request), door_of(request)
    tenant: str = await run_in_threadpool(door.tenant, key)
    request.state.tenant = tenant
    return tenant


async def json_body(request: Request) -> dict[str, Any]:
    """The request's JSON object (after the caller is authenticated), refused before parsing when nested deeper
    than ``VLMQ_SERVE_MAX_JSON_DEPTH``."""
    await authenticate(request)
    raw = await request.body()
    try:
        text = raw.decode("utf-8")
        check_depth(text, door_of(request).settings.serve_max_json_depth)
        body = json.loads(text)
    except InvalidRequest as e:
        raise ApiError(400, str(e), code="bad_json") from None
    except (ValueError, RecursionError):
        raise ApiError(400, "the request body is not a JSON object (UTF-8)", code="bad_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", code="bad_json")
    return body


def query(request: Request, known: frozenset[str]) -> dict[str, str]:
    """The query parameters, each one of ``known`` (others are refused by name)."""
    from vlmq.serve.errors import refuse_unknown

    params = dict(request.query_params)
    refuse_unknown(params, known, "query")
    return params


def limit_of(params: dict[str, str], default: int, most: int) -> int:
    """The ``limit`` query parameter, 1 to ``most``."""
    raw = params.get("limit", str(default))
    if not raw.isdigit() or not 1 <= int(raw) <= most:
        raise ApiError(400, f"limit must be an integer from 1 to {most}", code="bad_limit", param="limit")
    return int(raw)
