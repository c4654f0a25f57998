"""``/v1/chat/completions`` (one request run as a job and awaited) and ``/v1/models``.

Usage: mounted by ``vlmq.serve.app``; ``client.chat.completions.create(model="tiny-shapes", messages=[...])``.
The body is checked as a batch line's (``Client.submit_body``: every field applied or refused by name);
``stream: true`` is refused (400, ``param: stream``): answers are written whole by the workers. The wait is
bounded by ``VLMQ_SERVE_CHAT_TIMEOUT``; past it the job is cancelled and the answer is 504.
"""
from __future__ import annotations

import time
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from vlmq.batch import output_line
from vlmq.client import Client
from vlmq.errors import JobTimeout
from vlmq.models import BUNDLED_MODEL
from vlmq.serve.common import json_body, run
from vlmq.serve.errors import ApiError


def _complete(client: Client, body: dict[str, Any]) -> dict[str, Any]:
    job, account = client.submit_body(body)
    try:
        result = job.result(timeout=client.settings.serve_chat_timeout)
    except JobTimeout:
        job.cancel()
        raise
    record = {"id": job.id, "finished_at": repr(time.time()), **account}
    completion: dict[str, Any] = output_line(record, result.raw)["response"]["body"]
    return completion


async def chat_completions(request: Request) -> Response:
    body = await json_body(request)
    if body.get("stream", False) is not False:
        raise ApiError(400, "stream: true is not served (a job's answer is written whole); send stream: false",
                       code="unsupported_field", param="stream")
    return await run(request, lambda client: _complete(client, body))


def _models(client: Client) -> dict[str, Any]:
    names = sorted({BUNDLED_MODEL, *client.settings.models})
    return {"object": "list", "data": [{"id": n, "object": "model", "created": 0, "owned_by": "vlmq"}
                                       for n in names]}


async def models(request: Request) -> Response:
    return await run(request, _models)


ROUTES = [Route("/v1/chat/completions", chat_completions, methods=["POST"]),
          Route("/v1/models", models, methods=["GET"])]
