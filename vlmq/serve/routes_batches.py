"""``/v1/batches``: create from an uploaded File, retrieve, cancel, list (OpenAI's Batch API).

Usage: mounted by ``vlmq.serve.app``; ``client.batches.create(input_file_id=..., endpoint="/v1/chat/completions",
completion_window="24h")`` with the official client.
"""
from __future__ import annotations

import re
import tempfile
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from vlmq import files, keys
from vlmq.batch import BatchInvalid, BatchStatus, list_page
from vlmq.batchfile import ENDPOINT
from vlmq.client import Client
from vlmq.serve.common import json_body, limit_of, query, run
from vlmq.serve.errors import ApiError, refuse_unknown

CREATE_FIELDS = frozenset({"input_file_id", "endpoint", "completion_window", "metadata"})


def _own(client: Client, batch_id: str) -> str:
    if not re.fullmatch(keys.BATCH_ID_RE, batch_id) or keys.tenant_of(batch_id) != client.tenant:
        raise ApiError(404, f"no batch {batch_id[:80]!r}", code="not_found")
    return batch_id


def _lines_over(path: Path, most: int) -> bool:
    with open(path, "rb") as f:
        return sum(1 for raw in f if raw.strip()) > most


def _create(client: Client, body: dict[str, Any]) -> dict[str, Any]:
    if body.get("endpoint") != ENDPOINT:
        raise ApiError(400, f"endpoint must be {ENDPOINT} (the only one vlmq serves)", code="unsupported_endpoint",
                       param="endpoint")
    file_id = body.get("input_file_id")
    if not isinstance(file_id, str):
        raise ApiError(400, "input_file_id must be a File id", code="bad_input_file", param="input_file_id")
    if files.retrieve(client.storage, client.tenant, file_id)["purpose"] != "batch":
        raise ApiError(400, f"{file_id} was not uploaded with purpose=batch", code="bad_input_file",
                       param="input_file_id")
    with tempfile.TemporaryDirectory(prefix="vlmq-serve-") as folder:  # empty: a line's local path finds nothing
        path = Path(folder) / "input.jsonl"
        with open(path, "wb") as out:
            for chunk in files.content(client.storage, client.tenant, file_id):
                out.write(chunk)
        if _lines_over(path, client.settings.serve_max_file_lines):
            raise ApiError(400, f"a batch file holds at most {client.settings.serve_max_file_lines} requests "
                           "(VLMQ_SERVE_MAX_FILE_LINES)", code="batch_too_large", param="input_file_id")
        try:
            batch = client.submit_batch(path, completion_window=body.get("completion_window", "24h"),
                                        metadata=body.get("metadata"), webhook="", input_file_id=file_id)
        except BatchInvalid as e:  # refused whole: the failed batch, as OpenAI answers it
            return client.batch(e.batch_id).refresh()
    return batch.refresh()


async def create(request: Request) -> Response:
    body = await json_body(request)
    refuse_unknown(body, CREATE_FIELDS, "batch")
    return await run(request, lambda client: _create(client, body))


async def retrieve(request: Request) -> Response:
    batch_id = request.path_params["batch_id"]
    return await run(request, lambda client: client.batch(_own(client, batch_id)).refresh())


def _cancel(client: Client, batch_id: str) -> dict[str, Any]:
    batch = client.batch(_own(client, batch_id))
    status = BatchStatus(batch.refresh()["status"])
    if status.is_final and status is not BatchStatus.CANCELLED:
        raise ApiError(409, f"batch {batch_id} is {status.value}; only a running batch can be cancelled",
                       code="batch_not_cancellable")
    return batch.cancel()


async def cancel(request: Request) -> Response:
    batch_id = request.path_params["batch_id"]
    return await run(request, lambda client: _cancel(client, batch_id))


async def list_batches(request: Request) -> Response:
    params = query(request, frozenset({"after", "limit"}))
    limit = limit_of(params, 20, 100)
    return await run(request, lambda client: list_page(client.store, client.tenant, params.get("after"), limit))


ROUTES = [Route("/v1/batches", create, methods=["POST"]), Route("/v1/batches", list_batches, methods=["GET"]),
          Route("/v1/batches/{batch_id}", retrieve, methods=["GET"]),
          Route("/v1/batches/{batch_id}/cancel", cancel, methods=["POST"])]
