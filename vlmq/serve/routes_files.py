"""``/v1/files``: upload (multipart, ``purpose=batch``), list, retrieve, content, delete (OpenAI's Files API).

Usage: mounted by ``vlmq.serve.app``; ``client.files.create(file=open("requests.jsonl", "rb"), purpose="batch")``
with the official client. An upload is spooled to disk by the multipart parser (never whole in memory), its size
and line count checked, then copied to the object store a chunk at a time (``Storage.put_file``).
"""
from __future__ import annotations

from typing import IO, Any

from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from vlmq import files
from vlmq.client import Client
from vlmq.serve.common import authenticate, limit_of, query, run
from vlmq.serve.errors import ApiError, refuse_unknown

UPLOAD_FIELDS = frozenset({"file", "purpose"})
MAX_FILENAME_CHARS = 255


def _measure(f: IO[bytes], max_bytes: int, max_lines: int) -> int:
    """The upload's byte count, after checking it against both caps (then rewound)."""
    size = lines = 0
    f.seek(0)
    while block := f.read(1 << 20):
        size, lines = size + len(block), lines + block.count(b"\n")
        if size > max_bytes:
            raise ApiError(413, f"a file holds at most {max_bytes} bytes (VLMQ_SERVE_MAX_FILE_BYTES)",
                           code="file_too_large", param="file")
        if lines > max_lines:
            raise ApiError(400, f"a batch file holds at most {max_lines} requests (VLMQ_SERVE_MAX_FILE_LINES)",
                           code="too_many_lines", param="file")
    f.seek(0)
    return size


def _store(client: Client, upload: UploadFile, purpose: str) -> dict[str, Any]:
    s = client.settings
    size = _measure(upload.file, s.serve_max_file_bytes, s.serve_max_file_lines)
    name = (upload.filename or "upload.jsonl")[:MAX_FILENAME_CHARS]
    return files.create(client.storage, client.tenant, upload.file, name, purpose, size)


async def upload(request: Request) -> Response:
    await authenticate(request)  # a bad key is refused before the upload is read
    try:
        form = await request.form(max_files=1, max_fields=8, max_part_size=1 << 16)
    except HTTPException as e:  # Starlette's refusal (too many parts, a part too large)
        raise ApiError(400, f"malformed multipart body: {e.detail}", code="bad_multipart") from None
    except ValueError as e:  # python-multipart's (FormParserError): a malformed envelope
        raise ApiError(400, f"malformed multipart body: {e}", code="bad_multipart") from None
    try:
        refuse_unknown(dict(form), UPLOAD_FIELDS, "upload")
        purpose, upload_file = form.get("purpose"), form.get("file")
        if purpose not in files.PURPOSES:
            raise ApiError(400, f"purpose must be one of {', '.join(files.PURPOSES)}", code="bad_purpose",
                           param="purpose")
        if not isinstance(upload_file, UploadFile):
            raise ApiError(400, "the upload has no file part", code="missing_file", param="file")
        return await run(request, lambda client: _store(client, upload_file, str(purpose)))
    finally:
        await form.close()


async def list_files(request: Request) -> Response:
    params = query(request, frozenset({"after", "limit", "order", "purpose"}))
    limit = limit_of(params, 10_000, 10_000)
    if params.get("order", "desc") not in ("asc", "desc"):
        raise ApiError(400, "order must be asc or desc", code="bad_order", param="order")

    def page(client: Client) -> dict[str, Any]:
        found = files.list_files(client.storage, client.tenant, after=params.get("after"), limit=limit,
                                 purpose=params.get("purpose"))
        if params.get("order") == "asc":
            found["data"].reverse()
        return found

    return await run(request, page)


async def retrieve(request: Request) -> Response:
    file_id = request.path_params["file_id"]
    return await run(request, lambda client: files.retrieve(client.storage, client.tenant, file_id))


async def content(request: Request) -> Response:
    file_id = request.path_params["file_id"]
    return await run(request, lambda client: StreamingResponse(
        files.content(client.storage, client.tenant, file_id), media_type="application/octet-stream"))


async def delete(request: Request) -> Response:
    file_id = request.path_params["file_id"]
    return await run(request, lambda client: files.delete(client.storage, client.tenant, file_id))


ROUTES = [Route("/v1/files", upload, methods=["POST"]), Route("/v1/files", list_files, methods=["GET"]),
          Route("/v1/files/{file_id}", retrieve, methods=["GET"]),
          Route("/v1/files/{file_id}", delete, methods=["DELETE"]),
          Route("/v1/files/{file_id}/content", content, methods=["GET"])]
